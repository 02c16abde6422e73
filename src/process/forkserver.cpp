// The forkserver start method: a single-threaded server, exec'd from this program the
// first time it is needed (so it holds none of the parent's threads or state), forks
// children on request. Each request carries the launch record and a status channel; the
// server replies on the channel with the child's pid and, when it reaps the child, its
// raw wait status.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <pthread.h>

#include <map>
#include <mutex>

#include <fmt/format.h>

#include "child.h"
#include "launch.h"
#include "shm/region.h"
#include "torchpar/core/syscall.h"

namespace torchpar::detail {
namespace {

void write_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;  // the client went away: nothing to tell
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void reap(std::map<pid_t, UniqueFd>& children) {
  for (;;) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;
    auto it = children.find(pid);
    if (it == children.end()) continue;
    const int32_t st = status;
    write_all(it->second.get(), &st, sizeof st);
    children.erase(it);
  }
}

struct Client {
  std::mutex* mu = new std::mutex();  // heap: a forked child replaces it (see below)
  UniqueFd sock;
  int server_pid = -1;
};

Client& client() {
  static Client* c = [] {
    auto* cl = new Client();
    // A fork()ed child must not share our connection to the server (interleaved frames) or
    // a mutex another thread held at fork time: it starts its own server when it needs one.
    ::pthread_atfork(nullptr, nullptr, [] {
      Client& me = client();
      me.mu = new std::mutex();
      me.sock.reset();
      me.server_pid = -1;
    });
    return cl;
  }();
  return *c;
}

}  // namespace

void run_forkserver(int sock) {
  std::map<pid_t, UniqueFd> children;
  for (;;) {
    struct pollfd pfd {
      sock, POLLIN, 0
    };
    const int r = ::poll(&pfd, 1, 50);
    reap(children);
    if (r <= 0) continue;
    Payload req;
    try {
      req = recv_payload(sock, std::chrono::seconds(10));
    } catch (...) {
      break;  // the client closed (or broke) the connection: we are done
    }
    if (req.fds.size() < 2) continue;
    UniqueFd status = std::move(req.fds[0]);
    UniqueFd slot_fd = std::move(req.fds[1]);
    const pid_t server = ::getpid();
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != server) ::_exit(1);
      ::close(sock);
      status.reset();
      children.clear();  // the siblings' status channels are the server's, not ours
      void* slot = map_shared_fd_noexcept(slot_fd.get(), kErrorSlotBytes);
      slot_fd.reset();
      if (slot == nullptr) exit_child(71);
      std::vector<UniqueFd> args;
      for (size_t i = 2; i < req.fds.size(); ++i) args.push_back(std::move(req.fds[i]));
      std::string name;  // from the launch record, for the error report
      const int code = run_child_body(slot, name, [&] {
        auto rec = loads<LaunchRecord>(Payload{std::move(req.bytes), {}});
        name = rec.name;
        run_launch_record(std::move(rec), std::move(args));
      });
      exit_child(code);
    }
    const int32_t reply = pid;
    write_all(status.get(), &reply, sizeof reply);
    if (pid > 0) children.emplace(pid, std::move(status));
  }
  // Our client is gone; our children die with us (PDEATHSIG).
  exit_child(0);
}

std::pair<int, UniqueFd> forkserver_start(const Payload& record, std::vector<int> arg_fds,
                                          int slot_fd) {
  Client& c = client();
  std::lock_guard<std::mutex> lock(*c.mu);
  if (c.server_pid > 0) {
    int st = 0;
    if (::waitpid(c.server_pid, &st, WNOHANG) == c.server_pid) {  // the server died: restart it
      c.sock.reset();
      c.server_pid = -1;
    }
  }
  if (!c.sock.valid()) {
    int sv[2];
    check_syscall("socketpair", "forkserver",
                  [&] { return ::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv); });
    UniqueFd mine(sv[0]), theirs(sv[1]);
    c.server_pid = exec_self({theirs.get()}, fmt::format("TORCHPAR_FORKSERVER={}", theirs.get()),
                             "forkserver");
    c.sock = std::move(mine);
  }
  int sv[2];
  check_syscall("socketpair", "forkserver status",
                [&] { return ::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv); });
  UniqueFd status_mine(sv[0]), status_theirs(sv[1]);
  Payload req;
  req.bytes = record.bytes;
  req.fds.emplace_back(status_theirs.dup());
  auto dup = [](int fd) {
    return UniqueFd(check_syscall("fcntl(F_DUPFD_CLOEXEC)", "forkserver request",
                                  [&] { return ::fcntl(fd, F_DUPFD_CLOEXEC, 0); }));
  };
  req.fds.push_back(dup(slot_fd));
  for (int fd : arg_fds) req.fds.push_back(dup(fd));
  send_payload(c.sock.get(), req);
  status_theirs.reset();
  // The server answers with the child's pid (it may be starting up: allow time for exec).
  struct pollfd pfd {
    status_mine.get(), POLLIN, 0
  };
  if (::poll(&pfd, 1, 60000) <= 0) throw Error("forkserver did not answer within 60 s");
  int32_t pid = -1;
  if (::recv(status_mine.get(), &pid, sizeof pid, MSG_WAITALL) != sizeof pid || pid <= 0)
    throw Error("forkserver could not start the child (fork failed or the server died)");
  return {pid, std::move(status_mine)};
}

}  // namespace torchpar::detail
