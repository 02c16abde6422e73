#pragma once
// Test support: run a function in a forked child with a socket back to the parent, and a
// watchdog so that a hung child fails the test instead of hanging it.

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace torchpar::testing {

struct Child {
  pid_t pid = -1;
  int sock = -1;  // parent's end of a socketpair(AF_UNIX, SOCK_STREAM)
};

/// Forks. The child runs `fn(sock)` and _exits with its return value (an exception prints
/// its message to stderr and exits 99). The child dies with the parent (PDEATHSIG).
Child fork_child(const std::function<int(int sock)>& fn);

/// Waits for the child; after `timeout` kills it (SIGKILL) and returns -1000.
/// Returns the exit code, or -signal when killed by a signal. Closes the socket.
int wait_child(Child& child, std::chrono::milliseconds timeout = std::chrono::seconds(60));

/// Small blocking messages (a line of text) over a socket, with a timeout.
void send_line(int sock, const std::string& line);
std::string recv_line(int sock, std::chrono::milliseconds timeout = std::chrono::seconds(30));

/// Names in /dev/shm that start with `prefix`.
std::vector<std::string> shm_entries(const std::string& prefix);

/// Shmem from /proc/meminfo, bytes.
unsigned long long meminfo_shmem_bytes();

/// Open fds of this process.
int count_open_fds();

/// The state letter of /proc/<pid>/stat (R, S, T, Z, ...); '?' when the pid is gone.
char proc_state(int pid);

}  // namespace torchpar::testing
