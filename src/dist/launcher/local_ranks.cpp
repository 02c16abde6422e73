#include "dist/launcher/local_ranks.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "torchpar/core/error.h"
#include "torchpar/core/fd.h"
#include "torchpar/core/syscall.h"

namespace torchpar::detail {

struct LocalRanks::Rank {
  int rank = 0;
  pid_t pid = -1;
  int out = -1;  // read ends of the child's stdout / stderr
  int err = -1;
  std::string out_buf, err_buf;
  bool running = false;
  int status = 0;
};

namespace {

using Clock = std::chrono::steady_clock;

/// The most a rank's unterminated line holds in the launcher: a rank writing megabytes
/// without a newline has them forwarded in pieces of this size instead of buffered whole
/// (a 300 MB line took the launcher to 598 MiB).
constexpr size_t kMaxLineBytes = size_t{64} * 1024;

/// Writes complete lines of `buf` to `fd`, each prefixed, and keeps the incomplete tail;
/// `all` (the rank's pipe closed) writes the tail too, ended with a newline. A tail of
/// kMaxLineBytes or more is written in pieces of kMaxLineBytes, each a line of its own when
/// there is a prefix (so that every output line names its rank), as they are without one.
void flush_lines(std::string& buf, int fd, const std::string& prefix, bool all) {
  size_t start = 0;
  for (;;) {
    const size_t nl = buf.find('\n', start);
    if (nl == std::string::npos) break;
    write_all(fd, prefix + buf.substr(start, nl - start + 1));
    start = nl + 1;
  }
  for (; buf.size() - start >= kMaxLineBytes; start += kMaxLineBytes)
    write_all(fd, prefix + buf.substr(start, kMaxLineBytes) + (prefix.empty() ? "" : "\n"));
  buf.erase(0, start);
  if (all && !buf.empty()) {
    write_all(fd, prefix + buf + "\n");
    buf.clear();
  }
}

/// Reads what is there on `fd` into buf; closes it on EOF. Whenever buf holds
/// kMaxLineBytes, `flush` (flush_lines) empties it, so a rank's output is never held whole.
template <typename Flush>
void drain(int& fd, std::string& buf, const Flush& flush) {
  char tmp[65536];
  for (;;) {
    const ssize_t n = ::read(fd, tmp, sizeof(tmp));
    if (n > 0) {
      buf.append(tmp, static_cast<size_t>(n));
      if (buf.size() >= kMaxLineBytes) flush();
      continue;
    }
    if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
      ::close(fd);
      fd = -1;
    }
    return;
  }
}

Clock::time_point after(std::chrono::duration<double> d) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(d);
}

}  // namespace

void write_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && errno != EINTR) {
      return;
    }
  }
}

LocalRanks::LocalRanks(const std::vector<std::string>& program,
                       const std::vector<RankLaunch>& launches, std::chrono::duration<double> grace,
                       bool prefix_output)
    : group_(grace), grace_(grace), prefix_output_(prefix_output) {
  try {
    start(program, launches);
  } catch (...) {
    reap_all();  // the destructor does not run for a constructor that throws
    throw;
  }
}

void LocalRanks::start(const std::vector<std::string>& program,
                       const std::vector<RankLaunch>& launches) {
  ranks_.reserve(launches.size());
  for (const auto& l : launches) {
    int po[2], pe[2];
    if (::pipe2(po, O_CLOEXEC) != 0) throw_system_error("pipe2", errno, "rank output");
    UniqueFd out_read(po[0]), out_write(po[1]);
    if (::pipe2(pe, O_CLOEXEC) != 0) throw_system_error("pipe2", errno, "rank output");
    UniqueFd err_read(pe[0]), err_write(pe[1]);
    ExecOptions exec;
    exec.env = l.env;
    exec.stdout_fd = out_write.get();
    exec.stderr_fd = err_write.get();
    exec.inherit_fds = l.inherit_fds;
    exec.die_with_parent = true;  // the launcher is single-threaded: PDEATHSIG means "we died"
    auto& r = ranks_.emplace_back();
    r.rank = l.rank;
    r.pid = group_.start(program, exec);  // throws: the destructor stops those started
    r.running = true;
    ::fcntl(out_read.get(), F_SETFL, O_NONBLOCK);
    ::fcntl(err_read.get(), F_SETFL, O_NONBLOCK);
    r.out = out_read.release();
    r.err = err_read.release();
  }
}

LocalRanks::~LocalRanks() { reap_all(); }

void LocalRanks::reap_all() noexcept {
  group_.signal(SIGKILL);
  for (auto& r : ranks_) {
    if (r.running) {
      int status = 0;
      while (::waitpid(r.pid, &status, 0) < 0 && errno == EINTR) {
      }
    }
    r.running = false;
    if (r.out >= 0) ::close(r.out);
    if (r.err >= 0) ::close(r.err);
    r.out = r.err = -1;
  }
}

void LocalRanks::poll(std::chrono::milliseconds wait) {
  std::vector<pollfd> fds;
  for (auto& r : ranks_) {
    if (r.out >= 0) fds.push_back({r.out, POLLIN, 0});
    if (r.err >= 0) fds.push_back({r.err, POLLIN, 0});
  }
  if (!fds.empty())
    ::poll(fds.data(), fds.size(), static_cast<int>(wait.count()));
  else
    std::this_thread::sleep_for(std::min(wait, std::chrono::milliseconds(20)));
  for (auto& r : ranks_) {
    const std::string prefix = prefix_output_ ? fmt::format("[{}]: ", r.rank) : "";
    auto flush_out = [&] { flush_lines(r.out_buf, STDOUT_FILENO, prefix, r.out < 0); };
    auto flush_err = [&] { flush_lines(r.err_buf, STDERR_FILENO, prefix, r.err < 0); };
    if (r.out >= 0) drain(r.out, r.out_buf, flush_out);
    if (r.err >= 0) drain(r.err, r.err_buf, flush_err);
    flush_out();
    flush_err();
  }
  for (auto& r : ranks_) {
    if (!r.running) continue;
    int status = 0;
    if (::waitpid(r.pid, &status, WNOHANG) == r.pid) {
      r.running = false;
      r.status = status;
      if (exit_code_of(status) != 0 && !failure_) failure_ = RankFailure{r.rank, r.pid, status};
    }
  }
  if (kill_at_ && Clock::now() > *kill_at_) {
    group_.signal(SIGKILL);
    kill_at_.reset();
  }
  // Ranks are gone; grandchildren holding the pipes get a moment, then we stop reading.
  if (all_exited() && !stop_reading_at_) stop_reading_at_ = Clock::now() + std::chrono::seconds(1);
}

void LocalRanks::terminate(int sig) {
  group_.signal(sig);
  if (!kill_at_ && sig != SIGKILL) kill_at_ = after(grace_);
}

void LocalRanks::stop() {
  terminate(SIGTERM);
  while (!finished()) poll(std::chrono::milliseconds(50));
}

bool LocalRanks::all_exited() const {
  for (const auto& r : ranks_)
    if (r.running) return false;
  return true;
}

bool LocalRanks::all_succeeded() const { return all_exited() && !failure_; }

bool LocalRanks::finished() const {
  if (!all_exited()) return false;
  for (const auto& r : ranks_)
    if (r.out >= 0 || r.err >= 0) return stop_reading_at_ && Clock::now() > *stop_reading_at_;
  return true;
}

}  // namespace torchpar::detail
