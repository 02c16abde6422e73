#include "trainer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>

#include "fashion_mnist.h"
#include "mnist_workers.h"
#include "net.h"
#include "outputs.h"
#include "resume.h"
#include "torchpar/torchpar.h"
#include "workers.h"

namespace torchpar::train {
namespace {

// The parent: plans the run, starts the workers (mnist_workers.h) or trains itself, reports.

struct EpochMetrics {
  int epoch;
  double train_loss, test_loss, test_accuracy, seconds;
  int64_t samples;
  SyncTime sync{};  // ddp: the mean over ranks of their time in synchronize_gradients
};

struct Run {
  TrainConfig cfg;
  bool env_ranks = false;  // one rank of a job its launcher started (RANK / WORLD_SIZE)
  std::vector<EpochMetrics> epochs;
  std::string status = "completed";
  std::string error;
  nlohmann::json elastic;  // ranks of a job: Resumable::metrics()
};

nlohmann::json metrics_json(const Run& run) {
  const TrainConfig& cfg = run.cfg;
  nlohmann::json j;
  j["model"] = "mnist";
  j["strategy"] = cfg.strategy;
  j["workers"] = cfg.strategy == "single" ? 1 : cfg.workers;
  if (cfg.strategy == "ddp") j["backend"] = cfg.backend;
  if (cfg.strategy != "single") j["launch"] = run.env_ranks ? "environment" : "spawn";
  if (cfg.strategy == "pserver") {
    j["trainers"] = trainers(cfg);
    j["reduce_method"] = "mean";
    j["reduce_batch_size"] = cfg.reduce_batch_size;
    j["max_queue_size"] = cfg.max_queue_size;
  }
  j["batch_size"] = cfg.batch_size;
  j["lr"] = cfg.lr;
  j["lr_effective"] = effective_lr(cfg);
  if (cfg.strategy == "ddp") j["lr_scaling"] = cfg.lr_scaling;
  j["momentum"] = cfg.momentum;
  add_run_metrics(j, cfg, run.status, run.error);
  if (!run.elastic.is_null()) j["elastic"] = run.elastic;
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
    if (cfg.strategy == "ddp" && e.sync.steps > 0) {
      // What a step waited for its gradients' average after backward (the transfer and the
      // slower rank): DistributedDataParallel::stats(), the mean over ranks.
      epochs.back()["synchronize_seconds"] = e.sync.seconds;
      epochs.back()["synchronize_us_per_step"] = 1e6 * e.sync.seconds / e.sync.steps;
      epochs.back()["synchronize_fraction"] = e.seconds > 0 ? e.sync.seconds / e.seconds : 0.0;
    }
    secs += e.seconds;
    samples += e.samples;
  }
  j["epochs"] = epochs;
  j["total_seconds"] = secs;
  j["total_samples"] = samples;
  j["samples_per_s"] = secs > 0 ? samples / secs : 0.0;
  return j;
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
  if (!run.epochs.empty() && run.cfg.plot) draw_curves(dir);
}

// ---- run_train's steps ---------------------------------------------------------------------

/// What a run works on: its options (run.cfg) and results, the data, and the parent's model
/// (trained by single; for hogwild the workers' shared one, for ddp a copy of rank 0's, for
/// pserver a copy of the server's; as one rank of a job, this rank's).
struct Session {
  Run run;
  FashionMnist data;
  int64_t per_epoch = 0;  // training samples of an epoch: the same number for every trainer
  Net net{nullptr};
  std::optional<EnvRank> env;  // set: one rank of a job its launcher started
  const TrainConfig& cfg() const { return run.cfg; }
  /// The process that reports and writes the outputs: the parent, or rank 0 of a job.
  bool lead() const { return !env || env->rank == 0; }
};

/// The progress reports of one epoch, summed and drawn.
struct EpochProgress {
  EpochProgress(const Session& s, int epoch)
      : bar(fmt::format("epoch {}/{}", epoch, s.cfg().epochs), s.per_epoch, "samples",
            "samples/s") {}
  void add(int64_t samples, double loss, int64_t n_batches) {
    done += samples;
    loss_sum += loss;
    batches += n_batches;
    const double secs = Seconds(Clock::now() - start).count();
    bar.update(done, batches ? loss_sum / batches : 0,
               secs > 0 ? static_cast<double>(done - resumed_at) / secs : 0);
  }
  /// The job had consumed `position` samples of the epoch before this process resumed it.
  void resume_at(int64_t position) { done = resumed_at = position; }
  /// Samples trained in this epoch by this process's job (not before a resume).
  int64_t trained() const { return done - resumed_at; }
  ProgressBar bar;
  Clock::time_point start = Clock::now();
  int64_t done = 0, batches = 0, resumed_at = 0;
  double loss_sum = 0;
};

/// Fills in the defaults. Returns 2 (after a message) for a bad strategy, backend or worker
/// count, else 0.
int complete_config(TrainConfig& cfg) {
  if (int code = complete_common_config(cfg)) return code;
  if (cfg.reduce_batch_size < 1 || cfg.max_queue_size < cfg.reduce_batch_size) {
    std::fprintf(stderr,
                 "torchpar train: need 1 <= --reduce-batch-size (%lld) <= --max-queue-size "
                 "(%lld)\n",
                 static_cast<long long>(cfg.reduce_batch_size),
                 static_cast<long long>(cfg.max_queue_size));
    return 2;
  }
  if (cfg.data.empty()) cfg.data = kDefaultDataDir;
  return 0;
}

/// Loads the data set and keeps the first --limit training samples. Returns 2 (after a
/// message) for missing or corrupt data, else 0.
int load_data(Session& s) {
  const TrainConfig& cfg = s.cfg();
  try {
    s.data = load_fashion_mnist(cfg.data, cfg.limit);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torchpar train: %s\n", e.what());
    return 2;
  }
  auto& train = s.data.train;
  if (cfg.limit > 0 && cfg.limit < train.size()) {
    train.images = train.images.slice(0, 0, cfg.limit).contiguous();
    train.labels = train.labels.slice(0, 0, cfg.limit).contiguous();
  }
  // Each trainer takes an equal shard: fewer samples than trainers leaves some with none,
  // and the run would wait for their first report until --timeout.
  if (train.size() < trainers(cfg)) {
    std::fprintf(stderr,
                 "torchpar train: %lld training sample%s (--limit %lld) for %d trainer%s: every "
                 "trainer needs at least one; raise --limit or lower --workers\n",
                 static_cast<long long>(train.size()), train.size() == 1 ? "" : "s",
                 static_cast<long long>(cfg.limit), trainers(cfg), trainers(cfg) == 1 ? "" : "s");
    return 2;
  }
  s.per_epoch = train.size() / trainers(cfg) * trainers(cfg);
  return 0;
}

void print_plan(const Session& s) {
  const TrainConfig& cfg = s.cfg();
  const std::string roles = cfg.strategy == "pserver"
                                ? fmt::format(" (1 parameter server, {} trainer{})", trainers(cfg),
                                              trainers(cfg) == 1 ? "" : "s")
                                : "";
  const std::string who =
      s.env ? fmt::format("{} rank{} (RANK/WORLD_SIZE from the environment; this is rank 0)",
                          cfg.workers, cfg.workers == 1 ? "" : "s")
            : fmt::format("{} worker{}{}", cfg.workers, cfg.workers == 1 ? "" : "s", roles);
  std::printf(
      "torchpar train: %s, %s, %d epoch%s, %lld training samples, batch %d, "
      "lr %g, momentum %g -> %s\n",
      cfg.strategy.c_str(), who.c_str(), cfg.epochs, cfg.epochs == 1 ? "" : "s",
      static_cast<long long>(s.per_epoch), cfg.batch_size, effective_lr(cfg), cfg.momentum,
      cfg.out.c_str());
  std::fflush(stdout);
}

/// Evaluates the parent's model, records the epoch and prints its line.
void record_epoch(Session& s, int epoch, double secs, const EpochProgress& progress,
                  SyncTime sync = {}) {
  const Eval ev = evaluate(s.net, s.data.test);
  const double train_loss =
      progress.batches ? progress.loss_sum / static_cast<double>(progress.batches) : 0;
  const int64_t samples = progress.trained();
  s.run.epochs.push_back({epoch, train_loss, ev.loss, ev.accuracy, secs, samples, sync});
  const std::string resumed =
      progress.resumed_at > 0 ? fmt::format(" (resumed at sample {})", progress.resumed_at) : "";
  if (samples == 0 && progress.resumed_at > 0) {
    // Resumed at the epoch's end (the state was saved after its last step, before its
    // evaluation): nothing was trained here, only the evaluation is new.
    std::printf("epoch %d: trained before the resume; test loss %.4f, test accuracy %.2f%%%s\n",
                epoch, ev.loss, ev.accuracy, resumed.c_str());
    std::fflush(stdout);
    return;
  }
  std::printf(
      "epoch %d: train loss %.4f, test loss %.4f, test accuracy %.2f%%, %.1f s, %.0f "
      "samples/s%s\n",
      epoch, train_loss, ev.loss, ev.accuracy, secs, static_cast<double>(samples) / secs,
      resumed.c_str());
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
        s.net, s.data.train, idx, cfg.batch_size,
        [&](int64_t n, double l, int64_t b) {
          throw_if_stopped();
          progress.add(n, l, b);
        },
        [&] { opt.step(); });
    progress.bar.finish();
    record_epoch(s, epoch, Seconds(Clock::now() - t0).count(), progress);
  }
}

/// hogwild / ddp / pserver: shares the training data (hogwild: the model too) with cfg.workers
/// spawned workers (pserver: worker 0 is the server, the others train) and waits until every
/// one is ready.
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
  const int port = uses_world(cfg) ? find_free_port() : 0;
  // The run's job key reaches the workers as an argument (the launch record, never argv).
  const AuthKey key = uses_world(cfg) ? random_authkey() : AuthKey{};
  ProcessOptions po{.name = "",
                    .daemon = false,
                    .start_method = StartMethod::kSpawn,
                    .threads = cfg.threads_per_worker};
  for (int i = 0; i < cfg.workers; ++i) {
    po.name = fmt::format("train-worker-{}", i);
    if (cfg.strategy == "hogwild") {
      w.procs.emplace_back(po, &hogwild_worker, i, cfg, shared, train.images, train.labels, w.msgs,
                           w.go);
    } else if (cfg.strategy == "ddp") {
      w.procs.emplace_back(po, &ddp_worker, i, cfg, port, key, train.images, train.labels, w.msgs,
                           w.go, w.params);
    } else if (i == 0) {  // pserver
      w.procs.emplace_back(po, &pserver_server, cfg, port, key, w.msgs, w.requests, w.params);
    } else {
      w.procs.emplace_back(po, &pserver_trainer, i, cfg, port, key, train.images, train.labels,
                           w.msgs, w.go);
    }
    w.procs.back().start();
  }
  w.last_heard = Clock::now();
  for (int ready = 0; ready < cfg.workers;) {
    if (auto m = poll(w.msgs, w, cfg)) {
      if (std::get<0>(*m) == kReady) ++ready;
    }
  }
}

/// One epoch of hogwild / ddp / pserver: starts every trainer on it and draws their progress;
/// for ddp the parent's model then takes rank 0's parameters, for pserver the server's newest.
/// Evaluates the parent's model.
void train_workers_epoch(Session& s, Workers& w, int epoch) {
  const TrainConfig& cfg = s.cfg();
  const auto t0 = Clock::now();
  for (int i = 0; i < trainers(cfg); ++i) w.go.put(epoch);
  EpochProgress progress(s, epoch);
  SyncTime sync;  // summed over the trainers, then their mean
  for (int finished = 0; finished < trainers(cfg);) {
    auto m = poll(w.msgs, w, cfg);
    if (!m) continue;
    const auto [kind, who, ep, n, l, b] = *m;
    if (kind == kProgress) {
      progress.add(n, l, b);
    } else if (kind == kEpochDone) {
      ++finished;
      sync.seconds += l;
      sync.steps += b;
    }
  }
  sync.seconds /= trainers(cfg);
  sync.steps /= trainers(cfg);
  const double secs = Seconds(Clock::now() - t0).count();
  progress.bar.finish();
  if (uses_world(cfg)) {
    if (cfg.strategy == "pserver") w.requests.put(epoch);
    copy_parameters(*s.net, wait_for(w.params, w, cfg));
  }
  record_epoch(s, epoch, secs, progress, sync);
}

void train_with_workers(Session& s, Workers& w) {
  start_workers(s, w);
  for (int epoch = 1; epoch <= s.cfg().epochs; ++epoch) train_workers_epoch(s, w, epoch);
  stop_workers(w, s.cfg());
}

/// ddp as one rank of a job its launcher started (s.env): the World from the environment,
/// this process trains the shard spawned ddp worker `rank` would (same seeds, same
/// DistributedDataParallel), and only rank 0 draws progress and evaluates. The epoch's
/// training losses are summed over the ranks (one all_reduce), so rank 0 reports the job's
/// train loss as a spawned run's parent does.
/// Resumable (resume.h): the model, SGD, the epoch, the job's position in it and the step come
/// from memory or a checkpoint when there is one; the rest of the epoch's permutation is dealt
/// to the ranks there are now (shard's offset), so a job that lost or gained ranks goes on
/// with the same samples. The learning rate is this world size's (--lr-scaling), not the
/// saved one.
/// Returns 2 when --resume names a directory without a checkpoint (nothing trained), else 0.
int train_as_rank(Session& s) {
  const TrainConfig& cfg = s.cfg();
  const int rank = s.env->rank;
  World world = join_env_world(cfg);
  // kAuto: shared memory among the ranks of one host, and across hosts what the World's
  // host keys call for (Gloo between hosts), never decided here.
  CollectiveGroup group = world.create_collective_group({}, backend_from_string(cfg.backend));
  torch::manual_seed(cfg.seed + rank);
  s.net = Net();  // rank 0's is the parent's initial model of a spawned run (seed + 0)
  // Every rank starts from rank 0's parameters; buckets start during backward.
  DistributedDataParallel ddp(*s.net, group, {.overlap_with_backward = true});
  auto opt = make_sgd(s.net, cfg);
  Resumable res(cfg, s.lead());
  res.state().add("model", *s.net);
  res.state().add("optimizer", opt);
  if (!res.restore(group, world)) return 2;
  for (auto& g : opt.param_groups()) {
    static_cast<torch::optim::SGDOptions&>(g.options()).lr(effective_lr(cfg));
  }
  const int64_t ranks = cfg.workers;
  for (; res.epoch <= cfg.epochs; ++res.epoch, res.position = 0) {
    const int epoch = static_cast<int>(res.epoch);
    const auto t0 = Clock::now();
    std::optional<EpochProgress> progress;
    if (s.lead()) progress.emplace(s, epoch);
    if (progress) progress->resume_at(res.position);
    double loss_sum = 0;
    int64_t batches = 0;
    const int64_t offset = res.position;
    const auto idx = shard(s.data.train.size(), cfg.seed, epoch, rank, cfg.workers, offset);
    int64_t mine = 0;  // samples of idx this rank trained
    train_epoch(
        s.net, s.data.train, idx, cfg.batch_size,
        [&](int64_t n, double l, int64_t b) {
          throw_if_stopped();
          loss_sum += l;
          batches += b;
          // The ranks step in lockstep: the job trained world size times this rank's samples.
          if (progress) progress->add(n * ranks, l, b);
        },
        [&] {
          ddp.synchronize_gradients();
          opt.step();
          mine += std::min<int64_t>(cfg.batch_size, idx.numel() - mine);
          res.position = offset + mine * ranks;
          ++res.step;
          res.after_step();
        });
    at::Tensor sums = torch::tensor({loss_sum, static_cast<double>(batches)}, torch::kDouble);
    group.all_reduce(sums);
    if (!progress) continue;
    const double secs = Seconds(Clock::now() - t0).count();
    progress->bar.finish();
    progress->loss_sum = sums[0].item<double>();
    progress->batches = static_cast<int64_t>(sums[1].item<double>());
    record_epoch(s, epoch, secs, *progress);
  }
  s.run.elastic = res.metrics();
  return 0;
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
  if (code == 0 && !s.run.epochs.empty()) {
    double secs = 0, samples = 0;
    for (const auto& e : s.run.epochs) {
      secs += e.seconds;
      samples += static_cast<double>(e.samples);
    }
    const auto& last = s.run.epochs.back();
    std::printf(
        "done: test accuracy %.2f%% after %d epoch(s); training %.1f s, %.0f samples/s; "
        "outputs in %s\n",
        last.test_accuracy, cfg.epochs, secs, samples / secs, cfg.out.c_str());
  }
  return code;
}

}  // namespace

int run_train(TrainConfig cfg) {
  if (cfg.model == "gpt") return run_gpt_train(std::move(cfg));
  if (cfg.model != "mnist") {
    std::fprintf(stderr, "torchpar train: unknown model '%s' (mnist or gpt)\n", cfg.model.c_str());
    return 2;
  }
  Session s;
  // Started by a launcher as one rank of a job: no workers of its own (cfg.workers = ranks).
  if (int code = rank_from_env(cfg, s.env)) return code;
  if (int code = complete_config(cfg)) return code;
  if (int code = check_resume_options(cfg, s.env.has_value())) return code;
  // Before any ATen work: an OpenMP pool made wider now keeps spinning beside the training.
  at::set_num_threads(cfg.threads_per_worker);
  s.run.cfg = cfg;
  s.run.env_ranks = s.env.has_value();
  if (int code = load_data(s)) return code;
  // Only the lead writes: the other ranks of a job leave --out alone (it may be shared).
  if (s.lead()) {
    if (int code = check_out_writable(cfg)) return code;
    print_plan(s);
  }
  install_stop_handlers();

  torch::manual_seed(cfg.seed);
  s.net = Net();
  int code = 0;
  std::optional<Workers> workers;
  const std::string me =
      s.env ? fmt::format("rank {} of {} ", s.env->rank, s.env->world_size) : std::string();
  try {
    if (cfg.strategy == "single") {
      train_single(s);
    } else if (s.env) {
      code = train_as_rank(s);
    } else {
      train_with_workers(s, workers.emplace());
    }
  } catch (const Interrupted&) {
    code = 130;
  } catch (const std::exception& e) {  // Failed (a worker's end) and every other error
    // A rank of a job stopped by its launcher may first see a peer that stopped before it
    // as lost: that is the same interruption, not a failure.
    if (s.env && stop_signal() != 0) {
      code = 130;
    } else {
      std::fprintf(stderr, "\ntorchpar train: %sfailed: %s\n", me.c_str(), e.what());
      kill_workers(workers);
      s.run.status = "failed";
      s.run.error = me + e.what();
      code = 1;
    }
  }
  if (code == 2) {  // --resume found nothing (Resumable::restore said so)
    s.run.status = "failed";
    s.run.error = "--resume: no checkpoint in " + cfg.resume;
  }
  if (code == 130) {
    if (s.lead()) {
      std::printf("\ntorchpar train: interrupted; %skeeping %zu finished epoch(s) in %s\n",
                  s.env ? "" : "stopping the workers, ", s.run.epochs.size(), cfg.out.c_str());
    }
    kill_workers(workers);
    s.run.status = "interrupted";
  }
  if (!s.lead()) return code;
  return finish_run(s, code);
}

}  // namespace torchpar::train
