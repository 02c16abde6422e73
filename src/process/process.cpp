#include "torchpar/process/process.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "child.h"
#include "launch.h"
#include "shm/allocator.h"
#include "shm/region.h"
#include "torchpar/core/syscall.h"

extern char** environ;

namespace torchpar {
namespace detail {

struct ProcessImpl {
  ProcessOptions options;
  LaunchSpec spec;
  pid_t pid = -1;
  UniqueFd pidfd;
  std::optional<int> exitcode;
  bool started = false;
  ShmRegion slot;  // the child's error (child.h); mapped here, its fd goes to the child
  bool fork_refs = false;
  UniqueFd status;  // forkserver: the server writes the wait status here
};

namespace {

std::atomic<int> g_process_counter{0};

// PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process.
// Children forked from the main thread live as long as the process; a start from any other
// thread forks on this one long-lived launcher thread instead (created on first use, never
// joined; a forked child starts without one), so a child outlives the thread that started
// it, as in Python, and still dies with the process.
class Launcher {
 public:
  // Runs `fn` (a fork or clone and its bookkeeping) on the launcher thread and waits for it;
  // its exception is rethrown here. Bounded: `fn` never blocks.
  void run(std::function<void()> fn) {
    std::packaged_task<void()> task(std::move(fn));
    auto done = task.get_future();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!started_) {
        std::thread([this] { loop(); }).detach();
        started_ = true;
      }
      queue_.push_back(std::move(task));
    }
    cv_.notify_one();
    done.get();
  }
  bool started() {
    std::lock_guard<std::mutex> lock(mu_);
    return started_;
  }

 private:
  [[noreturn]] void loop() {
    for (;;) {
      std::packaged_task<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !queue_.empty(); });
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<void()>> queue_;
  bool started_ = false;
};

std::atomic<Launcher*> g_launcher{nullptr};

Launcher& launcher() {
  static std::once_flag once;
  std::call_once(once, [] {
    // A forked child has no launcher thread (only the forking thread survives a fork); its
    // copy of the old one (and of its possibly held mutex) is abandoned, never used.
    ::pthread_atfork(nullptr, nullptr, [] { g_launcher.store(nullptr); });
  });
  Launcher* l = g_launcher.load();
  if (l == nullptr) {
    auto* fresh = new Launcher();  // leaked: its thread lives until the process ends
    if (g_launcher.compare_exchange_strong(l, fresh))
      l = fresh;
    else
      delete fresh;  // another thread won; `l` is its launcher
  }
  return *l;
}

bool on_main_thread() { return ::syscall(SYS_gettid) == ::getpid(); }

// Runs `fn` (which forks or clones) where the child's PDEATHSIG is tied to the process.
void run_forking(const std::function<void()>& fn) {
  if (on_main_thread())
    fn();
  else
    launcher().run(fn);
}

// Threads of this process other than our launcher.
int count_user_threads();

int count_threads() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/task")) {
    while (auto* e = ::readdir(d))
      if (e->d_name[0] != '.') ++n;
    ::closedir(d);
  }
  return n;
}

// A 4 KiB shared page for the child's error, backed by a sealed memfd (so spawn can pass
// it), reserved before mapping: a full memory is a ShmError here, never a SIGBUS later.
// Kept mapped in `p` (unmapped with it); returns the fd for the child.
UniqueFd make_slot(ProcessImpl& p) {
  p.slot = ShmRegion::create_memfd(kErrorSlotBytes, "torchpar-error-slot");
  return p.slot.release_fd();
}

int count_user_threads() {
  Launcher* l = g_launcher.load();
  return count_threads() - (l != nullptr && l->started() ? 1 : 0);
}

int decode_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return -WTERMSIG(status);
  return -1;
}

void start_fork(ProcessImpl& p) {
  const int threads = count_user_threads();
  if (p.options.threads > 1 && threads > 1)
    throw Error(fmt::format(
        "start method 'fork' with {} intra-op threads per child is refused: this process already "
        "runs {} threads, and LibTorch/OpenMP thread pools deadlock in a forked child; use the "
        "'spawn' start method or threads=1",
        p.options.threads, threads));
  make_slot(p);  // a forked child inherits the mapping; the fd is not needed
  void* slot = p.slot.data();
  const pid_t parent = ::getpid();
  pid_t pid = -1;
  // As Python's Process.start: buffered output is written once, by the parent, not again by
  // the child when it exits.
  std::fflush(nullptr);
  run_forking([&] {
    pid = ::fork();
    if (pid < 0) throw_system_error("fork", errno, p.options.name);
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);
      parent_releases_fork_refs();
      const int code = run_child_body(slot, p.options.name, [&] {
        set_child_threads(p.options.threads);
        p.spec.direct();
      });
      exit_child(code);
    }
  });
  claim_fork_refs(pid);
  p.fork_refs = true;
  p.pid = pid;
}

// The launch record of a spawn/forkserver child, and its argument payload (for the fds).
Payload make_record(ProcessImpl& p, const char* method, Payload& args) {
  if (!is_initialized())
    throw Error(
        fmt::format("start method '{}' needs torchpar::init(argc, argv) as the first "
                    "statement of main(): the child re-executes this program and init() "
                    "runs the target there",
                    method));
  if (!p.spec.spawnable)
    throw Error(
        fmt::format("start method '{}' cannot run this target: {}; use a free function "
                    "or the 'fork' start method",
                    method, p.spec.not_spawnable_reason));
  args = p.spec.make_args();
  LaunchRecord rec;
  rec.trampoline = to_code_address(reinterpret_cast<const void*>(p.spec.trampoline));
  rec.fn = to_code_address(p.spec.fn);
  rec.threads = p.options.threads;
  rec.name = p.options.name;
  rec.args = args.bytes;
  return dumps(rec);
}

void start_spawn(ProcessImpl& p) {
  Payload args;
  Payload record = make_record(p, "spawn", args);
  // The child reads the record (pread, its size from fstat) before it runs anything else.
  ShmRegion record_region = ShmRegion::create_memfd(record.bytes.size(), "torchpar-launch");
  std::memcpy(record_region.data(), record.bytes.data(), record.bytes.size());
  UniqueFd record_fd = record_region.release_fd();
  UniqueFd slot_fd = make_slot(p);
  std::vector<int> keep{record_fd.get(), slot_fd.get()};
  std::string spec =
      fmt::format("TORCHPAR_SPAWN={},{},{}", record_fd.get(), slot_fd.get(), ::getpid());
  for (const auto& fd : args.fds) {
    keep.push_back(fd.get());
    spec += fmt::format(",{}", fd.get());
  }
  p.pid = exec_self(keep, spec, p.options.name);
}

void start_forkserver(ProcessImpl& p, Payload record, const std::vector<int>& arg_fds) {
  UniqueFd slot_fd = make_slot(p);
  auto [pid, status] = forkserver_start(record, arg_fds, slot_fd.get());
  p.pid = pid;
  p.status = std::move(status);
}

}  // namespace

int exec_self(const std::vector<int>& keep, const std::string& env_entry, const std::string& what) {
  if (!is_initialized())
    throw Error(
        "start methods 'spawn' and 'forkserver' need torchpar::init(argc, argv) as the "
        "first statement of main(): the child re-executes this program and init() runs "
        "the target there");
  // Everything the child needs is built before the fork: after it, only raw syscalls.
  const std::string var = env_entry.substr(0, env_entry.find('=') + 1);
  std::vector<std::string> env_strings;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e)
    if (std::strncmp(*e, var.c_str(), var.size()) != 0) env_strings.emplace_back(*e);
  env_strings.push_back(env_entry);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_strings = saved_argv();
  std::vector<char*> argv;
  for (auto& s : argv_strings) argv.push_back(s.data());
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();

  // Raw clone: no atfork handlers (the child execs at once and takes no references).
  long pid = -1;
  run_forking([&] {
    pid = ::syscall(SYS_clone, SIGCHLD, 0, 0, 0, 0);
    if (pid < 0) throw_system_error("clone", errno, what);
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);
      for (int fd : keep) ::fcntl(fd, F_SETFD, 0);
      ::execve("/proc/self/exe", argv.data(), envp.data());
      static const char msg[] = "torchpar: exec of /proc/self/exe failed in a child\n";
      (void)!::write(2, msg, sizeof msg - 1);
      ::_exit(127);
    }
  });
  return static_cast<int>(pid);
}

namespace {}  // namespace
}  // namespace detail

Process::Process(ProcessOptions options, detail::LaunchSpec spec)
    : impl_(std::make_unique<detail::ProcessImpl>()) {
  impl_->options = std::move(options);
  impl_->spec = std::move(spec);
  if (impl_->options.name.empty())
    impl_->options.name = fmt::format("Process-{}", ++detail::g_process_counter);
}

Process::Process(Process&&) noexcept = default;

Process& Process::operator=(Process&& other) noexcept {
  if (this != &other) {
    finish();
    impl_ = std::move(other.impl_);
  }
  return *this;
}

Process::~Process() { finish(); }

void Process::finish() noexcept {
  if (!impl_ || !impl_->started || impl_->exitcode) return;
  try {
    if (impl_->options.daemon) kill();
    join();  // a non-daemon child is waited for, as Python waits at interpreter exit
  } catch (...) {
  }
}

void Process::start() {
  auto& p = *impl_;
  if (p.started) throw Error(fmt::format("{}: a process can only be started once", p.options.name));
  const StartMethod m = p.options.start_method.value_or(current_start_method());
  if (m == StartMethod::kFork) {
    detail::start_fork(p);
  } else if (m == StartMethod::kSpawn) {
    detail::start_spawn(p);
  } else {
    Payload args;
    Payload record = detail::make_record(p, "forkserver", args);
    std::vector<int> fds;
    for (const auto& fd : args.fds) fds.push_back(fd.get());
    detail::start_forkserver(p, std::move(record), fds);
  }
  p.started = true;
  const long fd = ::syscall(SYS_pidfd_open, p.pid, 0);
  if (fd >= 0) p.pidfd.reset(static_cast<int>(fd));
}

namespace {
// Forkserver children are not ours to wait for: the server sends their wait status.
bool poll_status(detail::ProcessImpl& p, int wait_ms);

void record_exit(detail::ProcessImpl& p, int status) {
  p.exitcode = detail::decode_status(status);
  p.pidfd.reset();
  if (p.fork_refs) {
    detail::release_fork_refs(p.pid);
    p.fork_refs = false;
  }
}
bool poll_status(detail::ProcessImpl& p, int wait_ms) {
  struct pollfd pfd {
    p.status.get(), POLLIN, 0
  };
  if (::poll(&pfd, 1, wait_ms) <= 0) return false;
  int32_t st = 0;
  const ssize_t n = ::recv(p.status.get(), &st, sizeof st, MSG_WAITALL);
  // No status (the server died): report the child as killed.
  record_exit(p, n == sizeof st ? st : SIGKILL);
  p.status.reset();
  return true;
}
}  // namespace

bool Process::join(Timeout timeout) {
  auto& p = *impl_;
  if (!p.started) throw Error(fmt::format("{}: join() before start()", p.options.name));
  if (p.exitcode) return true;
  const auto deadline =
      timeout
          ? std::optional(std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(*timeout))
          : std::nullopt;
  if (p.status.valid()) {
    for (;;) {
      int wait_ms = 100;
      if (deadline) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            *deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0) return poll_status(p, 0);
        wait_ms = static_cast<int>(std::min<int64_t>(left.count(), 100));
      }
      if (poll_status(p, wait_ms)) return true;
    }
  }
  for (;;) {
    int status = 0;
    const pid_t r = ::waitpid(p.pid, &status, WNOHANG);
    if (r == p.pid) {
      record_exit(p, status);
      return true;
    }
    if (r < 0 && errno == ECHILD) {  // reaped elsewhere: gone, status unknown
      record_exit(p, 255 << 8);
      return true;
    }
    if (r < 0 && errno != EINTR) detail::throw_system_error("waitpid", errno, p.options.name);
    int wait_ms = -1;
    if (deadline) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          *deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      wait_ms = static_cast<int>(std::min<int64_t>(left.count(), INT32_MAX));
    }
    if (p.pidfd.valid()) {
      struct pollfd pfd {
        p.pidfd.get(), POLLIN, 0
      };
      ::poll(&pfd, 1, wait_ms);
    } else {
      std::this_thread::sleep_for(
          std::chrono::milliseconds(wait_ms < 0 ? 5 : std::min(wait_ms, 5)));
    }
  }
}

bool Process::is_alive() {
  auto& p = *impl_;
  if (!p.started || p.exitcode) return false;
  if (p.status.valid()) return !poll_status(p, 0);
  int status = 0;
  const pid_t r = ::waitpid(p.pid, &status, WNOHANG);
  if (r == p.pid) {
    record_exit(p, status);
    return false;
  }
  if (r < 0 && errno == ECHILD) {
    // Someone else reaped it (a waitpid(-1) elsewhere): it is gone, its status unknown.
    record_exit(p, 255 << 8);
    return false;
  }
  return true;
}

std::optional<int> Process::exitcode() {
  is_alive();
  return impl_->exitcode;
}

int Process::pid() const { return impl_->started ? impl_->pid : -1; }

void Process::terminate() {
  if (impl_->started && !impl_->exitcode) ::kill(impl_->pid, SIGTERM);
}

void Process::kill() {
  if (impl_->started && !impl_->exitcode) ::kill(impl_->pid, SIGKILL);
}

const std::string& Process::name() const { return impl_->options.name; }
bool Process::daemon() const { return impl_->options.daemon; }
int detail::process_wait_fd(const Process& p) {
  return p.impl_->status.valid() ? p.impl_->status.get() : p.impl_->pidfd.get();
}

std::optional<std::pair<std::string, std::string>> Process::error() const {
  if (impl_->slot.data() == nullptr) return std::nullopt;
  std::string type, msg;
  if (!detail::read_error_slot(impl_->slot.data(), &type, &msg)) return std::nullopt;
  return std::make_pair(type, msg);
}

}  // namespace torchpar
