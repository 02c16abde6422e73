// `torchpar run`: starts N ranks of a program on this node with the environment torchrun
// sets, prefixes their output with the rank, stops all when one fails, forwards signals.
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "torchpar/core/auth.h"
#include "torchpar/core/error.h"
#include "torchpar/core/fd.h"
#include "torchpar/dist/world.h"
#include "torchpar/process/exec.h"

namespace torchpar::cli {
namespace {

struct RunOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  int max_restarts = 0;
  double grace = 5.0;
  bool no_prefix = false;
  std::vector<std::string> program;
};

volatile sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }

struct Rank {
  int rank = 0;
  pid_t pid = -1;
  int out = -1;  // read ends of the child's stdout / stderr
  int err = -1;
  std::string out_buf, err_buf;
  bool running = false;
  int status = 0;
};

/// The most a rank's unterminated line holds in the launcher: a rank writing megabytes
/// without a newline has them forwarded in pieces of this size instead of buffered whole
/// (a 300 MB line took the launcher to 598 MiB).
constexpr size_t kMaxLineBytes = size_t{64} * 1024;

/// Writes all of `data` to `fd`, going on after EINTR and short writes (the signal handlers
/// are installed without SA_RESTART); gives up on any other error (a closed stdout).
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

pid_t start_rank(const RunOptions& o, JobGroup& group, int local, int port, int restart,
                 int* out_fd, int* err_fd) {
  int po[2], pe[2];
  if (::pipe2(po, O_CLOEXEC) != 0 || ::pipe2(pe, O_CLOEXEC) != 0) {
    throw std::runtime_error(fmt::format("pipe: {}", std::strerror(errno)));
  }
  UniqueFd out_read(po[0]), out_write(po[1]), err_read(pe[0]), err_write(pe[1]);
  const int world = o.nnodes * o.nproc_per_node;
  const int rank = o.node_rank * o.nproc_per_node + local;
  ExecOptions exec;
  exec.env = {
      fmt::format("RANK={}", rank),
      fmt::format("WORLD_SIZE={}", world),
      fmt::format("LOCAL_RANK={}", local),
      fmt::format("LOCAL_WORLD_SIZE={}", o.nproc_per_node),
      fmt::format("GROUP_RANK={}", o.node_rank),
      fmt::format("MASTER_ADDR={}", o.master_addr),
      fmt::format("MASTER_PORT={}", port),
      fmt::format("TORCHELASTIC_RESTART_COUNT={}", restart),
      fmt::format("TORCHELASTIC_MAX_RESTARTS={}", o.max_restarts),
  };
  exec.stdout_fd = out_write.get();
  exec.stderr_fd = err_write.get();
  exec.die_with_parent = true;  // the launcher is single-threaded: PDEATHSIG means "we died"
  const pid_t pid = group.start(o.program, exec);
  ::fcntl(out_read.get(), F_SETFL, O_NONBLOCK);
  ::fcntl(err_read.get(), F_SETFL, O_NONBLOCK);
  *out_fd = out_read.release();
  *err_fd = err_read.release();
  return pid;
}

/// One attempt: returns 0 when every rank exited 0, else the first failure's code.
int run_once(const RunOptions& o, int port, int restart, bool* interrupted) {
  std::vector<Rank> ranks(static_cast<size_t>(o.nproc_per_node));
  // Every rank and whatever it starts share one process group, ended as a whole, also
  // when this launcher is SIGKILLed (the group's keeper sees its lifeline close).
  JobGroup group(std::chrono::duration<double>(o.grace));
  for (int i = 0; i < o.nproc_per_node; ++i) {
    auto& r = ranks[static_cast<size_t>(i)];
    r.rank = o.node_rank * o.nproc_per_node + i;
    r.pid = start_rank(o, group, i, port, restart, &r.out, &r.err);
    r.running = true;
  }
  int first_failure = 0;
  std::optional<std::chrono::steady_clock::time_point> kill_at;
  auto stop_all = [&](int sig) { group.signal(sig); };
  for (;;) {
    // forward a signal we got, once
    if (g_signal != 0 && !*interrupted) {
      *interrupted = true;
      std::fprintf(stderr, "torchpar run: got signal %d; stopping every rank\n",
                   static_cast<int>(g_signal));
      stop_all(g_signal);
      kill_at = std::chrono::steady_clock::now() +
                std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                    std::chrono::duration<double>(o.grace));
      if (first_failure == 0) first_failure = 128 + g_signal;
    }
    std::vector<pollfd> fds;
    for (auto& r : ranks) {
      if (r.out >= 0) fds.push_back({r.out, POLLIN, 0});
      if (r.err >= 0) fds.push_back({r.err, POLLIN, 0});
    }
    if (!fds.empty())
      ::poll(fds.data(), fds.size(), 50);
    else
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    for (auto& r : ranks) {
      const std::string prefix = o.no_prefix ? "" : fmt::format("[{}]: ", r.rank);
      auto flush_out = [&] { flush_lines(r.out_buf, STDOUT_FILENO, prefix, r.out < 0); };
      auto flush_err = [&] { flush_lines(r.err_buf, STDERR_FILENO, prefix, r.err < 0); };
      if (r.out >= 0) drain(r.out, r.out_buf, flush_out);
      if (r.err >= 0) drain(r.err, r.err_buf, flush_err);
      flush_out();
      flush_err();
    }
    bool any_running = false;
    for (auto& r : ranks) {
      if (!r.running) continue;
      int status = 0;
      const pid_t p = ::waitpid(r.pid, &status, WNOHANG);
      if (p == r.pid) {
        r.running = false;
        r.status = status;
        if (exit_code_of(status) != 0 && first_failure == 0) {
          first_failure = exit_code_of(status);
          std::fprintf(stderr, "torchpar run: rank %d (pid %d) %s; stopping the other ranks\n",
                       r.rank, static_cast<int>(r.pid), describe_wait_status(status).c_str());
          stop_all(SIGTERM);
          kill_at = std::chrono::steady_clock::now() +
                    std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                        std::chrono::duration<double>(o.grace));
        }
      } else {
        any_running = true;
      }
    }
    if (kill_at && std::chrono::steady_clock::now() > *kill_at) {
      stop_all(SIGKILL);
      kill_at.reset();
    }
    bool pipes_open = false;
    for (auto& r : ranks) pipes_open = pipes_open || r.out >= 0 || r.err >= 0;
    if (!any_running && (!pipes_open || kill_at)) {
      for (auto& r : ranks) {
        if (r.out >= 0) ::close(r.out);
        if (r.err >= 0) ::close(r.err);
      }
      return first_failure;
    }
    if (!any_running) {
      // ranks are gone; give grandchildren holding the pipes a moment, then stop reading
      kill_at = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    }
  }
}

}  // namespace

Command add_run(CLI::App& app) {
  auto o = std::make_shared<RunOptions>();
  auto* cmd = app.add_subcommand(
      "run",
      "Start N ranks of a program with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, "
      "MASTER_ADDR, MASTER_PORT set (like torchrun), and TORCHPAR_AUTHKEY: the caller's, else a "
      "fresh random key per one-node job (RPC needs it). Output lines get a \"[rank]: \" prefix "
      "(a line over 64 KiB is forwarded in 64 KiB lines, each prefixed); "
      "the first failing rank's exit code ends the run after the others are stopped; "
      "SIGINT/SIGTERM are forwarded.");
  cmd->add_option("-n,--nproc-per-node", o->nproc_per_node, "ranks on this node")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--nnodes", o->nnodes, "nodes in the job")->check(CLI::Range(1, 4096));
  cmd->add_option("--node-rank", o->node_rank, "this node's index in [0, nnodes)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--master-addr", o->master_addr, "address of the node serving rank 0's store");
  cmd->add_option("--master-port", o->master_port,
                  "port of rank 0's store (default: a free port when --nnodes is 1, else 29500)")
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--max-restarts", o->max_restarts,
                  "restart every rank up to this many times after a failure")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--grace", o->grace, "seconds between SIGTERM and SIGKILL when stopping ranks")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--no-prefix", o->no_prefix, "do not prefix output lines with the rank");
  cmd->add_option("program", o->program, "program and its arguments (after --)")->required();
  return [o] {
    if (o->node_rank >= o->nnodes) {
      std::fprintf(stderr, "torchpar run: --node-rank %d must be below --nnodes %d\n", o->node_rank,
                   o->nnodes);
      return 2;
    }
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    ::sigaction(SIGINT, &sa, nullptr);
    ::sigaction(SIGTERM, &sa, nullptr);
    // The job's key reaches the ranks in their environment, never through the store: the
    // caller's TORCHPAR_AUTHKEY (the same on every node), else 32 fresh random bytes for a
    // one-node job (kept across --max-restarts: one job, one key). A key that is set but
    // unusable stops the launch here instead of in every rank.
    try {
      if (!authkey_from_env()) {
        if (o->nnodes == 1) {
          ::setenv(kAuthKeyEnv, to_hex(random_authkey(32)).c_str(), 1);
        } else {
          std::fprintf(stderr,
                       "torchpar run: warning: --nnodes %d without TORCHPAR_AUTHKEY: nodes cannot "
                       "agree on a fresh key, so the ranks' store falls back to the per-user key "
                       "file (a shared home directory) and RPC refuses to start; give every "
                       "node's launcher the same TORCHPAR_AUTHKEY (64 hex digits, e.g. from "
                       "`openssl rand -hex 32`)\n",
                       o->nnodes);
        }
      }
    } catch (const ValueError& e) {
      std::fprintf(stderr, "torchpar run: %s\n", e.what());
      return 2;
    }
    int code = 0;
    bool interrupted = false;
    for (int attempt = 0; attempt <= o->max_restarts; ++attempt) {
      int port = o->master_port;
      if (port == 0) port = o->nnodes == 1 ? find_free_port(/*loopback_only=*/false) : 29500;
      code = run_once(*o, port, attempt, &interrupted);
      if (code == 0 || interrupted) break;
      if (attempt < o->max_restarts) {
        std::fprintf(stderr, "torchpar run: restarting every rank (%d of %d)\n", attempt + 1,
                     o->max_restarts);
      }
    }
    return code;
  };
}

}  // namespace torchpar::cli
