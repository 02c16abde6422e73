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

void hogwild_worker(int index, TrainConfig cfg, std::vector<at::Tensor> shared, at::Tensor images,
                    at::Tensor labels, Queue<Msg> msgs, Queue<int> go) {
  torch::manual_seed(cfg.seed + index);
  Net net;
  auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].set_data(shared[i]);  // alias shm
  auto opt = make_sgd(net, cfg);
  const Split data{images, labels};
  msgs.put({kReady, index, 0, 0, 0.0, 0});
  for (int epoch = 1;; ++epoch) {
    if (go.get(Seconds(24 * 3600)) == kStop) return;
    const auto idx = shard(data.size(), cfg.seed, epoch, index, cfg.workers);
    train_epoch(
        net, opt, data, idx, cfg.batch_size,
        [&](int64_t s, double l, int64_t b) {
          msgs.put({kProgress, index, epoch, s, l, b});
        },
        [] {});
    msgs.put({kEpochDone, index, epoch, 0, 0.0, 0});
  }
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
  auto group = world.create_collective_group({}, backend_from_string(cfg.backend));
  torch::manual_seed(cfg.seed + rank);
  Net net;
  auto params = net->parameters();
  int64_t total = 0;
  for (auto& p : params) total += p.numel();
  at::Tensor bucket = at::empty({total});  // one flat bucket for every gradient
  auto pack = [&](bool grads) {
    int64_t off = 0;
    for (auto& p : params) {
      auto src = grads ? p.grad() : p.detach();
      bucket.narrow(0, off, p.numel()).copy_(src.reshape({-1}));
      off += p.numel();
    }
  };
  auto unpack = [&](bool grads) {
    torch::NoGradGuard no_grad;
    int64_t off = 0;
    for (auto& p : params) {
      auto dst = grads ? p.mutable_grad() : p;
      dst.view({-1}).copy_(bucket.narrow(0, off, p.numel()));
      off += p.numel();
    }
  };
  pack(false);
  group.broadcast(bucket, 0);  // every rank starts from rank 0's parameters
  unpack(false);
  auto opt = make_sgd(net, cfg);
  const Split data{images, labels};
  msgs.put({kReady, rank, 0, 0, 0.0, 0});
  for (int epoch = 1;; ++epoch) {
    if (go.get(Seconds(24 * 3600)) == kStop) return;
    const auto idx = shard(data.size(), cfg.seed, epoch, rank, cfg.workers);
    train_epoch(
        net, opt, data, idx, cfg.batch_size,
        [&](int64_t s, double l, int64_t b) {
          msgs.put({kProgress, rank, epoch, s, l, b});
        },
        [&] {
          pack(true);
          group.all_reduce(bucket, {.op = ReduceOp::kAvg});
          unpack(true);
        });
    if (rank == 0) {
      std::vector<at::Tensor> copy;
      for (auto& p : params) copy.push_back(p.detach().clone());
      params_out.put(copy);
    }
    msgs.put({kEpochDone, rank, epoch, 0, 0.0, 0});
  }
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

void write_outputs(const Run& run, Net& net, bool with_model) {
  const std::filesystem::path dir = run.cfg.out;
  std::filesystem::create_directories(dir);
  nlohmann::json j;
  j["strategy"] = run.cfg.strategy;
  j["workers"] = run.cfg.strategy == "single" ? 1 : run.cfg.workers;
  if (run.cfg.strategy == "ddp") j["backend"] = run.cfg.backend;
  j["batch_size"] = run.cfg.batch_size;
  j["lr"] = run.cfg.lr;
  j["lr_effective"] = effective_lr(run.cfg);
  if (run.cfg.strategy == "ddp") j["lr_scaling"] = run.cfg.lr_scaling;
  j["momentum"] = run.cfg.momentum;
  j["seed"] = run.cfg.seed;
  j["threads_per_worker"] = run.cfg.threads_per_worker;
  j["limit"] = run.cfg.limit;
  j["data"] = run.cfg.data;
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
  write_atomic(dir, "metrics.json", j.dump(2) + "\n");
  if (with_model && !run.epochs.empty()) {
    const auto tmp = dir / ".model.pt.tmp";
    torch::save(net, tmp.string());
    std::filesystem::rename(tmp, dir / "model.pt");
  }
  if (!run.epochs.empty()) {
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

/// Waits for worker messages, checking signals and that workers live. Returns nullopt
/// after 100 ms without a message.
std::optional<Msg> next_msg(Queue<Msg>& msgs, std::vector<Process>& procs,
                            Clock::time_point& last_heard, double timeout) {
  if (g_stop_signal != 0) throw Interrupted(fmt::format("signal {}", int(g_stop_signal)));
  try {
    auto m = msgs.get(Seconds(0.1));
    last_heard = Clock::now();
    return m;
  } catch (const Empty&) {
  }
  // Killed workers first: the others usually fail *because* of them.
  std::string first, killed;
  for (size_t i = 0; i < procs.size(); ++i) {
    const std::string f = worker_failure(procs[i], static_cast<int>(i), false);
    if (f.empty()) continue;
    if (first.empty()) first = f;
    if (killed.empty() && procs[i].exitcode().value_or(0) < 0) killed = f;
  }
  if (!first.empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // let the rest settle
    for (size_t i = 0; i < procs.size() && killed.empty(); ++i) {
      if (procs[i].exitcode().value_or(0) < 0) {
        killed = worker_failure(procs[i], static_cast<int>(i), false);
      }
    }
    throw Failed(killed.empty() ? first : killed);
  }
  if (Seconds(Clock::now() - last_heard).count() > timeout) {
    throw Failed(fmt::format("no word from any worker for {:.0f} s", timeout));
  }
  return std::nullopt;
}

void stop_workers(std::vector<Process>& procs, Queue<int>& go) {
  for (size_t i = 0; i < procs.size(); ++i) {
    try {
      go.put(kStop, Seconds(1));
    } catch (const std::exception&) {
    }
  }
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  for (auto& p : procs) {
    const double left = std::max(0.01, Seconds(deadline - Clock::now()).count());
    if (!p.join(Seconds(left))) {
      p.kill();
      p.join();
    }
  }
}

void kill_workers(std::vector<Process>& procs) {
  for (auto& p : procs) p.kill();
  for (auto& p : procs) p.join(Seconds(10));
}

}  // namespace

int run_train(TrainConfig cfg) {
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

  // Before any ATen work: an OpenMP pool made wider now keeps spinning beside the training.
  at::set_num_threads(cfg.threads_per_worker);
  FashionMnist data;
  try {
    data = load_fashion_mnist(cfg.data);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torchpar train: %s\n", e.what());
    return 2;
  }
  // Outputs are checked before training: an unwritable --out must not cost a whole run.
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
  if (cfg.limit > 0 && cfg.limit < data.train.size()) {
    data.train.images = data.train.images.slice(0, 0, cfg.limit).contiguous();
    data.train.labels = data.train.labels.slice(0, 0, cfg.limit).contiguous();
  }
  const int64_t per_epoch = data.train.size() / cfg.workers * cfg.workers;
  std::printf(
      "torchpar train: %s, %d worker%s, %d epoch%s, %lld training samples, batch %d, "
      "lr %g, momentum %g -> %s\n",
      cfg.strategy.c_str(), cfg.workers, cfg.workers == 1 ? "" : "s", cfg.epochs,
      cfg.epochs == 1 ? "" : "s", static_cast<long long>(per_epoch), cfg.batch_size,
      effective_lr(cfg), cfg.momentum, cfg.out.c_str());
  std::fflush(stdout);

  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);

  torch::manual_seed(cfg.seed);
  Net net;
  Run run;
  run.cfg = cfg;
  auto finish_epoch = [&](int epoch, double secs, double loss_sum, int64_t batches) {
    const Eval ev = evaluate(net, data.test);
    const double train_loss = batches ? loss_sum / static_cast<double>(batches) : 0;
    run.epochs.push_back({epoch, train_loss, ev.loss, ev.accuracy, secs, per_epoch});
    std::printf(
        "epoch %d: train loss %.4f, test loss %.4f, test accuracy %.2f%%, %.1f s, %.0f "
        "samples/s\n",
        epoch, train_loss, ev.loss, ev.accuracy, secs, static_cast<double>(per_epoch) / secs);
    std::fflush(stdout);
  };

  int code = 0;
  std::vector<Process> procs;
  std::optional<Queue<int>> go;
  try {
    if (cfg.strategy == "single") {
      auto opt = make_sgd(net, cfg);
      for (int epoch = 1; epoch <= cfg.epochs; ++epoch) {
        const auto t0 = Clock::now();
        ProgressBar bar(epoch, cfg.epochs, per_epoch);
        int64_t done = 0, batches = 0;
        double loss_sum = 0;
        const auto idx = shard(data.train.size(), cfg.seed, epoch, 0, 1);
        train_epoch(
            net, opt, data.train, idx, cfg.batch_size,
            [&](int64_t s, double l, int64_t b) {
              if (g_stop_signal != 0) throw Interrupted("signal");
              done += s;
              loss_sum += l;
              batches += b;
              bar.update(done, batches ? loss_sum / batches : 0);
            },
            [] {});
        bar.finish();
        finish_epoch(epoch, Seconds(Clock::now() - t0).count(), loss_sum, batches);
      }
    } else {
      Queue<Msg> msgs;
      go.emplace();
      Queue<std::vector<at::Tensor>> params_q;
      std::vector<at::Tensor> shared;
      share_memory_(data.train.images);
      share_memory_(data.train.labels);
      if (cfg.strategy == "hogwild") {
        share_memory(*net);  // the parameters every worker updates in place
        for (auto& p : net->parameters()) shared.push_back(p.detach());
      }
      const int port = cfg.strategy == "ddp" ? find_free_port() : 0;
      ProcessOptions po{.name = "",
                        .daemon = false,
                        .start_method = StartMethod::kSpawn,
                        .threads = cfg.threads_per_worker};
      for (int i = 0; i < cfg.workers; ++i) {
        po.name = fmt::format("train-worker-{}", i);
        if (cfg.strategy == "hogwild") {
          procs.emplace_back(po, &hogwild_worker, i, cfg, shared, data.train.images,
                             data.train.labels, msgs, *go);
        } else {
          procs.emplace_back(po, &ddp_worker, i, cfg, port, data.train.images, data.train.labels,
                             msgs, *go, params_q);
        }
        procs.back().start();
      }
      auto last_heard = Clock::now();
      for (int ready = 0; ready < cfg.workers;) {
        if (auto m = next_msg(msgs, procs, last_heard, cfg.timeout)) {
          if (std::get<0>(*m) == kReady) ++ready;
        }
      }
      for (int epoch = 1; epoch <= cfg.epochs; ++epoch) {
        const auto t0 = Clock::now();
        for (int i = 0; i < cfg.workers; ++i) go->put(epoch);
        ProgressBar bar(epoch, cfg.epochs, per_epoch);
        int64_t done = 0, batches = 0;
        double loss_sum = 0;
        for (int finished = 0; finished < cfg.workers;) {
          auto m = next_msg(msgs, procs, last_heard, cfg.timeout);
          if (!m) continue;
          const auto [kind, who, ep, s, l, b] = *m;
          if (kind == kProgress) {
            done += s;
            loss_sum += l;
            batches += b;
            bar.update(done, batches ? loss_sum / batches : 0);
          } else if (kind == kEpochDone) {
            ++finished;
          }
        }
        const double secs = Seconds(Clock::now() - t0).count();
        bar.finish();
        if (cfg.strategy == "ddp") {
          auto p = params_q.get(Seconds(cfg.timeout));
          torch::NoGradGuard no_grad;
          auto mine = net->parameters();
          for (size_t i = 0; i < mine.size(); ++i) mine[i].copy_(p[i]);
        }
        finish_epoch(epoch, secs, loss_sum, batches);
      }
      stop_workers(procs, *go);
    }
  } catch (const Interrupted&) {
    std::printf(
        "\ntorchpar train: interrupted; stopping the workers, keeping %zu finished "
        "epoch(s) in %s\n",
        run.epochs.size(), cfg.out.c_str());
    kill_workers(procs);
    run.status = "interrupted";
    code = 130;
  } catch (const Failed& e) {
    std::fprintf(stderr, "\ntorchpar train: failed: %s\n", e.what());
    kill_workers(procs);
    run.status = "failed";
    run.error = e.what();
    code = 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\ntorchpar train: failed: %s\n", e.what());
    kill_workers(procs);
    run.status = "failed";
    run.error = e.what();
    code = 1;
  }
  try {
    write_outputs(run, net, code == 0 || !run.epochs.empty());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torchpar train: cannot write the outputs: %s\n", e.what());
    return 1;
  }
  if (code == 0) {
    double secs = 0;
    for (auto& e : run.epochs) secs += e.seconds;
    const auto& last = run.epochs.back();
    std::printf(
        "done: test accuracy %.2f%% after %d epoch(s); training %.1f s, %.0f samples/s; "
        "outputs in %s\n",
        last.test_accuracy, cfg.epochs, secs, static_cast<double>(per_epoch) * cfg.epochs / secs,
        cfg.out.c_str());
  }
  return code;
}

}  // namespace torchpar::train
