#include "trainer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <torch/version.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "fashion_mnist.h"
#include "net.h"
#include "torchpar/torchpar.h"

namespace torchpar::train {
namespace {

using Clock = std::chrono::steady_clock;
using Seconds = std::chrono::duration<double>;

// Messages from workers: (kind, worker, epoch, samples, loss_sum, batches).
enum Kind : int { kReady = 0, kProgress = 1, kEpochDone = 2 };
using Msg = std::tuple<int, int, int, int64_t, double, int64_t>;
constexpr int kStop = -1;
constexpr int kReportEvery = 20;  // batches between progress messages

volatile sig_atomic_t g_stop_signal = 0;
void on_stop_signal(int sig) { g_stop_signal = sig; }

/// The sample indices of `part` of `parts` for `epoch`: a permutation seeded by seed+epoch
/// (the same on every worker), dealt round-robin, every part the same length.
at::Tensor shard(int64_t n, int64_t seed, int epoch, int part, int parts) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed + epoch));
  at::Tensor perm = at::randperm(n, gen, at::kLong);
  const int64_t per = n / parts;
  return perm.slice(0, part, part + per * parts, parts);
}

/// One pass over `idx`; calls report(samples, loss_sum, batches) every kReportEvery batches
/// and at the end with the increments since the last call. `sync_grads` runs between
/// backward and step (ddp's all_reduce).
template <class Report, class Sync>
void train_epoch(Net& net, torch::optim::SGD& opt, const Split& data, const at::Tensor& idx,
                 int batch_size, Report&& report, Sync&& sync_grads) {
  net->train();
  int64_t samples = 0, batches = 0;
  double loss_sum = 0;
  const int64_t n = idx.numel();
  for (int64_t first = 0; first < n; first += batch_size) {
    const auto b = idx.slice(0, first, std::min(n, first + batch_size));
    const auto x = normalize(data.images.index_select(0, b));
    const auto y = data.labels.index_select(0, b);
    opt.zero_grad();
    auto loss = torch::nll_loss(net->forward(x), y);
    loss.backward();
    sync_grads();
    opt.step();
    samples += b.numel();
    loss_sum += loss.item<double>();
    if (++batches == kReportEvery) {
      report(samples, loss_sum, batches);
      samples = batches = 0;
      loss_sum = 0;
    }
  }
  report(samples, loss_sum, batches);
}

struct Eval {
  double loss = 0;
  double accuracy = 0;
};

Eval evaluate(Net& net, const Split& test) {
  torch::NoGradGuard no_grad;
  net->eval();
  double loss = 0;
  int64_t correct = 0;
  for (int64_t first = 0; first < test.size(); first += 1000) {
    const int64_t last = std::min(test.size(), first + 1000);
    const auto x = normalize(test.images.slice(0, first, last));
    const auto y = test.labels.slice(0, first, last);
    const auto out = net->forward(x);
    loss += torch::nll_loss(out, y, {}, at::Reduction::Sum).item<double>();
    correct += out.argmax(1).eq(y).sum().item<int64_t>();
  }
  return {loss / static_cast<double>(test.size()),
          100.0 * static_cast<double>(correct) / static_cast<double>(test.size())};
}

/// ddp averages the gradients of `workers` batches per step: with lr_scaling "linear" its
/// learning rate is lr x workers (the linear scaling rule, Goyal et al. 2017), so an epoch
/// of ddp learns as much as an epoch of single with the same --lr.
double effective_lr(const TrainConfig& c) {
  return c.strategy == "ddp" && c.lr_scaling == "linear" ? c.lr * c.workers : c.lr;
}

torch::optim::SGD make_sgd(Net& net, const TrainConfig& c) {
  return torch::optim::SGD(net->parameters(),
                           torch::optim::SGDOptions(effective_lr(c)).momentum(c.momentum));
}

// ---- workers (spawned) ---------------------------------------------------------------------

/// A worker after its setup: reports ready, then trains one epoch of its shard per `go`
/// message until kStop, reporting progress. after_epoch() runs before the epoch is reported
/// done.
template <class Sync, class AfterEpoch>
void serve_epochs(int index, const TrainConfig& cfg, Net& net, const Split& data, Queue<Msg>& msgs,
                  Queue<int>& go, Sync&& sync_grads, AfterEpoch&& after_epoch) {
  auto opt = make_sgd(net, cfg);
  msgs.put({kReady, index, 0, 0, 0.0, 0});
  for (int epoch = 1;; ++epoch) {
    if (go.get(Seconds(24 * 3600)) == kStop) return;
    const auto idx = shard(data.size(), cfg.seed, epoch, index, cfg.workers);
    train_epoch(
        net, opt, data, idx, cfg.batch_size,
        [&](int64_t s, double l, int64_t b) {
          msgs.put({kProgress, index, epoch, s, l, b});
        },
        sync_grads);
    after_epoch();
    msgs.put({kEpochDone, index, epoch, 0, 0.0, 0});
  }
}

void hogwild_worker(int index, TrainConfig cfg, std::vector<at::Tensor> shared, at::Tensor images,
                    at::Tensor labels, Queue<Msg> msgs, Queue<int> go) {
  torch::manual_seed(cfg.seed + index);
  Net net;
  auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].set_data(shared[i]);  // alias shm
  serve_epochs(
      index, cfg, net, Split{images, labels}, msgs, go, [] {}, [] {});
}

void ddp_worker(int rank, TrainConfig cfg, int port, at::Tensor images, at::Tensor labels,
                Queue<Msg> msgs, Queue<int> go, Queue<std::vector<at::Tensor>> params_out) {
  WorldOptions wo;
  wo.rank = rank;
  wo.world_size = cfg.workers;
  wo.master_addr = "127.0.0.1";
  wo.master_port = port;
  wo.timeout = Seconds(cfg.timeout);
  World world(wo);
  torch::manual_seed(cfg.seed + rank);
  Net net;
  // Every rank starts from rank 0's parameters; each step averages the gradients.
  DistributedDataParallel ddp(*net,
                              world.create_collective_group({}, backend_from_string(cfg.backend)));
  serve_epochs(
      rank, cfg, net, Split{images, labels}, msgs, go, [&] { ddp.synchronize_gradients(); },
      [&] {
        if (rank != 0) return;
        std::vector<at::Tensor> copy;
        for (auto& p : net->parameters()) copy.push_back(p.detach().clone());
        params_out.put(copy);
      });
}

// ---- the parent ------------------------------------------------------------------------------

/// One line per epoch, redrawn in place on a terminal; plain lines (every 10%) otherwise.
class ProgressBar {
 public:
  ProgressBar(int epoch, int epochs, int64_t total)
      : epoch_(epoch),
        epochs_(epochs),
        total_(total),
        tty_(::isatty(STDOUT_FILENO) != 0),
        start_(Clock::now()) {}

  void update(int64_t done, double loss) {
    const double secs = Seconds(Clock::now() - start_).count();
    const double rate = secs > 0 ? static_cast<double>(done) / secs : 0;
    const double frac = total_ > 0 ? std::min(1.0, static_cast<double>(done) / total_) : 1;
    if (tty_) {
      const int width = 30;
      const int fill = static_cast<int>(frac * width);
      std::printf("\repoch %d/%d [%s%s] %6lld/%lld  loss %.4f  %7.0f samples/s", epoch_, epochs_,
                  std::string(static_cast<size_t>(fill), '#').c_str(),
                  std::string(static_cast<size_t>(width - fill), '.').c_str(),
                  static_cast<long long>(done), static_cast<long long>(total_), loss, rate);
      std::fflush(stdout);
    } else if (static_cast<int>(frac * 10) > last_decile_) {
      last_decile_ = static_cast<int>(frac * 10);
      std::printf("epoch %d/%d %3d%% %lld/%lld samples, loss %.4f, %.0f samples/s\n", epoch_,
                  epochs_, last_decile_ * 10, static_cast<long long>(done),
                  static_cast<long long>(total_), loss, rate);
      std::fflush(stdout);
    }
  }
  void finish() {
    if (tty_) std::printf("\n");
  }

 private:
  int epoch_, epochs_;
  int64_t total_;
  bool tty_;
  Clock::time_point start_;
  int last_decile_ = -1;
};

struct EpochMetrics {
  int epoch;
  double train_loss, test_loss, test_accuracy, seconds;
  int64_t samples;
};

struct Run {
  TrainConfig cfg;
  std::vector<EpochMetrics> epochs;
  std::string status = "completed";
  std::string error;
};

std::string now_stamp() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y%m%d-%H%M%S", std::localtime(&t));
  return buf;
}

/// Writes `text` to dir/name through a temporary file and a rename: never half-written.
void write_atomic(const std::filesystem::path& dir, const std::string& name,
                  const std::string& text) {
  const auto tmp = dir / ("." + name + ".tmp");
  {
    std::ofstream f(tmp, std::ios::binary);
    f << text;
    if (!f) throw Error(fmt::format("cannot write {}", tmp.string()));
  }
  std::filesystem::rename(tmp, dir / name);
}

std::string tools_dir() {
  if (const char* d = std::getenv("TORCHPAR_TOOLS_DIR")) return d;
#ifdef TORCHPAR_SOURCE_TOOLS_DIR
  if (std::filesystem::exists(TORCHPAR_SOURCE_TOOLS_DIR "/plot_curves.py")) {
    return TORCHPAR_SOURCE_TOOLS_DIR;
  }
#endif
#ifdef TORCHPAR_INSTALL_TOOLS_DIR
  return TORCHPAR_INSTALL_TOOLS_DIR;
#else
  return "tools";
#endif
}

nlohmann::json metrics_json(const Run& run) {
  const TrainConfig& cfg = run.cfg;
  nlohmann::json j;
  j["strategy"] = cfg.strategy;
  j["workers"] = cfg.strategy == "single" ? 1 : cfg.workers;
  if (cfg.strategy == "ddp") j["backend"] = cfg.backend;
  j["batch_size"] = cfg.batch_size;
  j["lr"] = cfg.lr;
  j["lr_effective"] = effective_lr(cfg);
  if (cfg.strategy == "ddp") j["lr_scaling"] = cfg.lr_scaling;
  j["momentum"] = cfg.momentum;
  j["seed"] = cfg.seed;
  j["threads_per_worker"] = cfg.threads_per_worker;
  j["limit"] = cfg.limit;
  j["data"] = cfg.data;
  j["status"] = run.status;
  if (!run.error.empty()) j["error"] = run.error;
  double secs = 0;
  int64_t samples = 0;
  nlohmann::json epochs = nlohmann::json::array();
  for (const auto& e : run.epochs) {
    epochs.push_back({{"epoch", e.epoch},
                      {"train_loss", e.train_loss},
                      {"test_loss", e.test_loss},
                      {"test_accuracy", e.test_accuracy},
                      {"seconds", e.seconds},
                      {"samples", e.samples},
                      {"samples_per_s", e.seconds > 0 ? e.samples / e.seconds : 0.0}});
    secs += e.seconds;
    samples += e.samples;
  }
  j["epochs"] = epochs;
  j["total_seconds"] = secs;
  j["total_samples"] = samples;
  j["samples_per_s"] = secs > 0 ? samples / secs : 0.0;
  j["versions"] = {{"torchpar", version()},
                   {"libtorch", TORCH_VERSION},
                   {"compiler", fmt::format("gcc {}.{}", __GNUC__, __GNUC_MINOR__)}};
  return j;
}

/// dir/curves.png from dir/metrics.json; a warning on stderr when it cannot be drawn.
void draw_curves(const std::filesystem::path& dir) {
  const std::string script = tools_dir() + "/plot_curves.py";
  // argv, never a shell: --out may hold quotes, spaces or `;` (it reaches python as is).
  int code = -1;
  try {
    ExecOptions exec;
    exec.stdout_fd = STDERR_FILENO;  // the plot script's chatter is diagnostics
    code = run_program({"/usr/bin/python3", script, (dir / "metrics.json").string(),
                        (dir / "curves.png").string()},
                       exec, std::chrono::minutes(2));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torchpar train: warning: %s\n", e.what());
  }
  if (code != 0) {
    std::fprintf(stderr,
                 "torchpar train: warning: curves.png not drawn (needs /usr/bin/python3 with "
                 "python3-matplotlib and %s)\n",
                 script.c_str());
  }
}

void write_outputs(const Run& run, Net& net, bool with_model) {
  const std::filesystem::path dir = run.cfg.out;
  std::filesystem::create_directories(dir);
  write_atomic(dir, "metrics.json", metrics_json(run).dump(2) + "\n");
  if (with_model && !run.epochs.empty()) {
    const auto tmp = dir / ".model.pt.tmp";
    torch::save(net, tmp.string());
    std::filesystem::rename(tmp, dir / "model.pt");
  }
  if (!run.epochs.empty()) draw_curves(dir);
}

/// A worker that ended: how, in words. Empty while it runs (or ended well when allowed).
std::string worker_failure(Process& p, int index, bool exit_ok) {
  auto code = p.exitcode();
  if (!code || (*code == 0 && exit_ok)) return "";
  if (auto e = p.error()) {
    return fmt::format("worker {} (pid {}) raised {}: {}", index, p.pid(), e->first, e->second);
  }
  if (*code < 0) {
    return fmt::format("worker {} (pid {}) was killed by signal {} ({})", index, p.pid(), -*code,
                       ::strsignal(-*code));
  }
  return fmt::format("worker {} (pid {}) exited with code {}", index, p.pid(), *code);
}

class Failed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
class Interrupted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The spawned workers of hogwild and ddp, and the queues between them and the parent.
struct Workers {
  std::vector<Process> procs;
  Queue<Msg> msgs;
  Queue<int> go;
  Queue<std::vector<at::Tensor>> params;  // ddp: rank 0's parameters after each epoch
  Clock::time_point last_heard = Clock::now();
};

/// Waits for worker messages, checking signals and that workers live. Returns nullopt
/// after 100 ms without a message.
std::optional<Msg> next_msg(Workers& w, double timeout) {
  if (g_stop_signal != 0) throw Interrupted(fmt::format("signal {}", int(g_stop_signal)));
  try {
    auto m = w.msgs.get(Seconds(0.1));
    w.last_heard = Clock::now();
    return m;
  } catch (const Empty&) {
  }
  // Killed workers first: the others usually fail *because* of them.
  std::string first, killed;
  for (size_t i = 0; i < w.procs.size(); ++i) {
    const std::string f = worker_failure(w.procs[i], static_cast<int>(i), false);
    if (f.empty()) continue;
    if (first.empty()) first = f;
    if (killed.empty() && w.procs[i].exitcode().value_or(0) < 0) killed = f;
  }
  if (!first.empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // let the rest settle
    for (size_t i = 0; i < w.procs.size() && killed.empty(); ++i) {
      if (w.procs[i].exitcode().value_or(0) < 0) {
        killed = worker_failure(w.procs[i], static_cast<int>(i), false);
      }
    }
    throw Failed(killed.empty() ? first : killed);
  }
  if (Seconds(Clock::now() - w.last_heard).count() > timeout) {
    throw Failed(fmt::format("no word from any worker for {:.0f} s", timeout));
  }
  return std::nullopt;
}

void stop_workers(Workers& w) {
  for (size_t i = 0; i < w.procs.size(); ++i) {
    try {
      w.go.put(kStop, Seconds(1));
    } catch (const std::exception&) {
    }
  }
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  for (auto& p : w.procs) {
    const double left = std::max(0.01, Seconds(deadline - Clock::now()).count());
    if (!p.join(Seconds(left))) {
      p.kill();
      p.join();
    }
  }
}

void kill_workers(std::optional<Workers>& w) {
  if (!w) return;
  for (auto& p : w->procs) p.kill();
  for (auto& p : w->procs) p.join(Seconds(10));
}

// ---- run_train's steps ---------------------------------------------------------------------

/// What a run works on: its options (run.cfg) and results, the data, and the parent's model
/// (trained by single; for hogwild the workers' shared one, for ddp a copy of rank 0's).
struct Session {
  Run run;
  FashionMnist data;
  int64_t per_epoch = 0;  // training samples of an epoch: the same number for every worker
  Net net{nullptr};
  const TrainConfig& cfg() const { return run.cfg; }
};

/// The progress reports of one epoch, summed and drawn.
struct EpochProgress {
  EpochProgress(const Session& s, int epoch) : bar(epoch, s.cfg().epochs, s.per_epoch) {}
  void add(int64_t samples, double loss, int64_t n_batches) {
    done += samples;
    loss_sum += loss;
    batches += n_batches;
    bar.update(done, batches ? loss_sum / batches : 0);
  }
  ProgressBar bar;
  int64_t done = 0, batches = 0;
  double loss_sum = 0;
};

/// Fills in the defaults. Returns 2 (after a message) for a bad strategy or backend, else 0.
int complete_config(TrainConfig& cfg) {
  if (cfg.strategy != "single" && cfg.strategy != "hogwild" && cfg.strategy != "ddp") {
    std::fprintf(stderr, "torchpar train: unknown strategy '%s' (single, hogwild or ddp)\n",
                 cfg.strategy.c_str());
    return 2;
  }
  if (cfg.workers <= 0)
    cfg.workers = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (cfg.strategy == "single") cfg.workers = 1;
  if (cfg.data.empty()) cfg.data = kDefaultDataDir;
  if (cfg.out.empty()) cfg.out = "runs/" + now_stamp();
  try {
    (void)backend_from_string(cfg.backend);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torchpar train: %s\n", e.what());
    return 2;
  }
  return 0;
}

/// Loads the data set and keeps the first --limit training samples. Returns 2 (after a
/// message) for missing or corrupt data, else 0.
int load_data(Session& s) {
  const TrainConfig& cfg = s.cfg();
  try {
    s.data = load_fashion_mnist(cfg.data);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torchpar train: %s\n", e.what());
    return 2;
  }
  auto& train = s.data.train;
  if (cfg.limit > 0 && cfg.limit < train.size()) {
    train.images = train.images.slice(0, 0, cfg.limit).contiguous();
    train.labels = train.labels.slice(0, 0, cfg.limit).contiguous();
  }
  s.per_epoch = train.size() / cfg.workers * cfg.workers;
  return 0;
}

/// Outputs are checked before training: an unwritable --out must not cost a whole run.
/// Returns 2 (after a message) when it is not writable, else 0.
int check_out_writable(const TrainConfig& cfg) {
  try {
    const std::filesystem::path dir = cfg.out;
    std::filesystem::create_directories(dir);
    write_atomic(dir, ".write_check", "");
    std::filesystem::remove(dir / ".write_check");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torchpar train: --out %s is not writable: %s\n", cfg.out.c_str(),
                 e.what());
    return 2;
  }
  return 0;
}

void print_plan(const Session& s) {
  const TrainConfig& cfg = s.cfg();
  std::printf(
      "torchpar train: %s, %d worker%s, %d epoch%s, %lld training samples, batch %d, "
      "lr %g, momentum %g -> %s\n",
      cfg.strategy.c_str(), cfg.workers, cfg.workers == 1 ? "" : "s", cfg.epochs,
      cfg.epochs == 1 ? "" : "s", static_cast<long long>(s.per_epoch), cfg.batch_size,
      effective_lr(cfg), cfg.momentum, cfg.out.c_str());
  std::fflush(stdout);
}

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
}

/// Evaluates the parent's model, records the epoch and prints its line.
void record_epoch(Session& s, int epoch, double secs, const EpochProgress& progress) {
  const Eval ev = evaluate(s.net, s.data.test);
  const double train_loss =
      progress.batches ? progress.loss_sum / static_cast<double>(progress.batches) : 0;
  s.run.epochs.push_back({epoch, train_loss, ev.loss, ev.accuracy, secs, s.per_epoch});
  std::printf(
      "epoch %d: train loss %.4f, test loss %.4f, test accuracy %.2f%%, %.1f s, %.0f "
      "samples/s\n",
      epoch, train_loss, ev.loss, ev.accuracy, secs, static_cast<double>(s.per_epoch) / secs);
  std::fflush(stdout);
}

/// single: every epoch in this process.
void train_single(Session& s) {
  const TrainConfig& cfg = s.cfg();
  auto opt = make_sgd(s.net, cfg);
  for (int epoch = 1; epoch <= cfg.epochs; ++epoch) {
    const auto t0 = Clock::now();
    EpochProgress progress(s, epoch);
    const auto idx = shard(s.data.train.size(), cfg.seed, epoch, 0, 1);
    train_epoch(
        s.net, opt, s.data.train, idx, cfg.batch_size,
        [&](int64_t n, double l, int64_t b) {
          if (g_stop_signal != 0) throw Interrupted("signal");
          progress.add(n, l, b);
        },
        [] {});
    progress.bar.finish();
    record_epoch(s, epoch, Seconds(Clock::now() - t0).count(), progress);
  }
}

/// hogwild / ddp: shares the training data (hogwild: the model too) with cfg.workers spawned
/// workers and waits until every one is ready.
void start_workers(Session& s, Workers& w) {
  const TrainConfig& cfg = s.cfg();
  auto& train = s.data.train;
  share_memory_(train.images);
  share_memory_(train.labels);
  std::vector<at::Tensor> shared;
  if (cfg.strategy == "hogwild") {
    share_memory(*s.net);  // the parameters every worker updates in place
    for (auto& p : s.net->parameters()) shared.push_back(p.detach());
  }
  const int port = cfg.strategy == "ddp" ? find_free_port() : 0;
  ProcessOptions po{.name = "",
                    .daemon = false,
                    .start_method = StartMethod::kSpawn,
                    .threads = cfg.threads_per_worker};
  for (int i = 0; i < cfg.workers; ++i) {
    po.name = fmt::format("train-worker-{}", i);
    if (cfg.strategy == "hogwild") {
      w.procs.emplace_back(po, &hogwild_worker, i, cfg, shared, train.images, train.labels, w.msgs,
                           w.go);
    } else {
      w.procs.emplace_back(po, &ddp_worker, i, cfg, port, train.images, train.labels, w.msgs, w.go,
                           w.params);
    }
    w.procs.back().start();
  }
  w.last_heard = Clock::now();
  for (int ready = 0; ready < cfg.workers;) {
    if (auto m = next_msg(w, cfg.timeout)) {
      if (std::get<0>(*m) == kReady) ++ready;
    }
  }
}

/// One epoch of hogwild / ddp: starts every worker on it and draws their progress; for ddp
/// the parent's model then takes rank 0's parameters. Evaluates the parent's model.
void train_workers_epoch(Session& s, Workers& w, int epoch) {
  const TrainConfig& cfg = s.cfg();
  const auto t0 = Clock::now();
  for (int i = 0; i < cfg.workers; ++i) w.go.put(epoch);
  EpochProgress progress(s, epoch);
  for (int finished = 0; finished < cfg.workers;) {
    auto m = next_msg(w, cfg.timeout);
    if (!m) continue;
    const auto [kind, who, ep, n, l, b] = *m;
    if (kind == kProgress) {
      progress.add(n, l, b);
    } else if (kind == kEpochDone) {
      ++finished;
    }
  }
  const double secs = Seconds(Clock::now() - t0).count();
  progress.bar.finish();
  if (cfg.strategy == "ddp") {
    auto p = w.params.get(Seconds(cfg.timeout));
    torch::NoGradGuard no_grad;
    auto mine = s.net->parameters();
    for (size_t i = 0; i < mine.size(); ++i) mine[i].copy_(p[i]);
  }
  record_epoch(s, epoch, secs, progress);
}

void train_with_workers(Session& s, Workers& w) {
  start_workers(s, w);
  for (int epoch = 1; epoch <= s.cfg().epochs; ++epoch) train_workers_epoch(s, w, epoch);
  stop_workers(w);
}

/// Writes the outputs (with the model when the run completed or finished an epoch) and, for
/// a completed run, the closing line. Returns the exit code.
int finish_run(Session& s, int code) {
  const TrainConfig& cfg = s.cfg();
  try {
    write_outputs(s.run, s.net, code == 0 || !s.run.epochs.empty());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torchpar train: cannot write the outputs: %s\n", e.what());
    return 1;
  }
  if (code == 0) {
    double secs = 0;
    for (const auto& e : s.run.epochs) secs += e.seconds;
    const auto& last = s.run.epochs.back();
    std::printf(
        "done: test accuracy %.2f%% after %d epoch(s); training %.1f s, %.0f samples/s; "
        "outputs in %s\n",
        last.test_accuracy, cfg.epochs, secs, static_cast<double>(s.per_epoch) * cfg.epochs / secs,
        cfg.out.c_str());
  }
  return code;
}

}  // namespace

int run_train(TrainConfig cfg) {
  if (int code = complete_config(cfg)) return code;
  // Before any ATen work: an OpenMP pool made wider now keeps spinning beside the training.
  at::set_num_threads(cfg.threads_per_worker);
  Session s;
  s.run.cfg = cfg;
  if (int code = load_data(s)) return code;
  if (int code = check_out_writable(cfg)) return code;
  print_plan(s);
  install_stop_handlers();

  torch::manual_seed(cfg.seed);
  s.net = Net();
  int code = 0;
  std::optional<Workers> workers;
  try {
    if (cfg.strategy == "single") {
      train_single(s);
    } else {
      train_with_workers(s, workers.emplace());
    }
  } catch (const Interrupted&) {
    std::printf(
        "\ntorchpar train: interrupted; stopping the workers, keeping %zu finished "
        "epoch(s) in %s\n",
        s.run.epochs.size(), cfg.out.c_str());
    kill_workers(workers);
    s.run.status = "interrupted";
    code = 130;
  } catch (const std::exception& e) {  // Failed (a worker's end) and every other error
    std::fprintf(stderr, "\ntorchpar train: failed: %s\n", e.what());
    kill_workers(workers);
    s.run.status = "failed";
    s.run.error = e.what();
    code = 1;
  }
  return finish_run(s, code);
}

}  // namespace torchpar::train
