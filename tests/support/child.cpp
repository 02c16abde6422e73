#include "child.h"

#include <dirent.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <thread>

namespace torchpar::testing {

Child fork_child(const std::function<int(int)>& fn) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
    throw std::runtime_error("socketpair failed");
  const pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(98);
    ::close(sv[0]);
    int rc = 97;
    try {
      rc = fn(sv[1]);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child %d: exception: %s\n", ::getpid(), e.what());
      rc = 99;
    }
    std::fflush(stderr);
    ::_exit(rc);
  }
  ::close(sv[1]);
  return Child{pid, sv[0]};
}

int wait_child(Child& child, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  for (;;) {
    pid_t r = ::waitpid(child.pid, &status, WNOHANG);
    if (r == child.pid) break;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(child.pid, SIGKILL);
      ::waitpid(child.pid, &status, 0);
      if (child.sock >= 0) ::close(child.sock);
      child.sock = -1;
      return -1000;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (child.sock >= 0) ::close(child.sock);
  child.sock = -1;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return -WTERMSIG(status);
}

void send_line(int sock, const std::string& line) {
  std::string s = line + "\n";
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::send(sock, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) throw std::runtime_error("send_line failed");
    off += static_cast<size_t>(n);
  }
}

std::string recv_line(int sock, std::chrono::milliseconds timeout) {
  std::string out;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) throw std::runtime_error("recv_line timed out");
    struct pollfd pfd {
      sock, POLLIN, 0
    };
    if (::poll(&pfd, 1, static_cast<int>(left.count())) <= 0) continue;
    char c;
    ssize_t n = ::recv(sock, &c, 1, 0);
    if (n <= 0) throw std::runtime_error("recv_line: peer closed");
    if (c == '\n') return out;
    out.push_back(c);
  }
}

std::vector<std::string> shm_entries(const std::string& prefix) {
  std::vector<std::string> out;
  DIR* d = ::opendir("/dev/shm");
  if (d == nullptr) return out;
  while (auto* e = ::readdir(d)) {
    if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) out.emplace_back(e->d_name);
  }
  ::closedir(d);
  return out;
}

unsigned long long meminfo_shmem_bytes() {
  FILE* f = std::fopen("/proc/meminfo", "r");
  char line[256];
  unsigned long long kb = 0;
  while (f != nullptr && std::fgets(line, sizeof line, f) != nullptr) {
    if (std::sscanf(line, "Shmem: %llu kB", &kb) == 1) break;
  }
  if (f != nullptr) std::fclose(f);
  return kb * 1024;
}

int count_open_fds() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  while (auto* e = ::readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(d);
  return n - 1;  // the directory stream itself
}

char proc_state(int pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", pid);
  char state = '?';
  if (FILE* f = std::fopen(path, "r")) {
    int read_pid = 0;
    char comm[256];
    if (std::fscanf(f, "%d %255s %c", &read_pid, comm, &state) != 3) state = '?';
    std::fclose(f);
  }
  return state;
}

}  // namespace torchpar::testing
