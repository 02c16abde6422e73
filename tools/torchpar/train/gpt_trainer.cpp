#include "gpt_trainer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <numbers>
#include <optional>
#include <string_view>
#include <tuple>
#include <utility>

#include "fortunes.h"
#include "gpt_stepper.h"
#include "outputs.h"
#include "resume.h"
#include "torchpar/parallel/sampling.h"
#include "torchpar/torchpar.h"
#include "workers.h"

namespace torchpar::train {
namespace {

constexpr int64_t kEvalWindows = 64;  // held-out windows per evaluation (8 KiB at context 128)
constexpr int64_t kEvalBatch = 16;
constexpr const char* kSamplePrompt = "The meaning of life is";

/// Rounds: the steps between two evaluations. Round r (1-based) ends at step last_step(r).
int64_t rounds(const TrainConfig& c) { return (c.steps + c.eval_every - 1) / c.eval_every; }
int64_t last_step(const TrainConfig& c, int64_t round) {
  return std::min(c.steps, round * c.eval_every);
}

/// Token ids int64 [1, n] of `bytes`.
at::Tensor ids_of(std::string_view bytes) {
  at::Tensor t = at::empty({1, static_cast<int64_t>(bytes.size())}, at::kLong);
  auto* p = t.data_ptr<int64_t>();
  for (size_t i = 0; i < bytes.size(); ++i) p[i] = static_cast<unsigned char>(bytes[i]);
  return t;
}

// ---- ddp workers (spawned) ------------------------------------------------------------------

/// Rank `rank` of the ddp run: rank 0's initial parameters everywhere (DistributedDataParallel),
/// then one round of steps per `go` message until kStop, gradients averaged every step;
/// rank 0 sends its parameters after each round, for the parent to evaluate.
void gpt_ddp_worker(int rank, TrainConfig cfg, int port, AuthKey key, at::Tensor train_bytes,
                    Queue<Msg> msgs, Queue<int> go, Queue<std::vector<at::Tensor>> params_out) {
  World world = join_world(rank, cfg, port, std::move(key));
  torch::manual_seed(cfg.seed);
  Gpt gpt(gpt_config(cfg));
  DistributedDataParallel ddp(*gpt,
                              world.create_collective_group({}, backend_from_string(cfg.backend)),
                              {.overlap_with_backward = true});
  Stepper stepper(gpt, cfg, rank, std::move(train_bytes));
  msgs.put({kReady, rank, 0, 0, 0.0, 0});
  for (;;) {
    const int round = go.get(Seconds(24 * 3600));
    if (round == kStop) return;
    stepper.train(
        last_step(cfg, round - 1) + 1, last_step(cfg, round), [&] { ddp.synchronize_gradients(); },
        [&](int64_t tokens, double loss_sum, int64_t steps) {
          msgs.put({kProgress, rank, round, tokens, loss_sum, steps});
        });
    if (rank == 0) params_out.put(clone_parameters(*gpt));
    msgs.put({kEpochDone, rank, round, 0, 0.0, 0});
  }
}

// ---- the parent -----------------------------------------------------------------------------

struct EvalPoint {
  int64_t step;
  double train_loss, val_loss, seconds;
  int64_t tokens;
};

/// A run: its options and results, the corpus, the held-out windows and the parent's model
/// (trained by single; a copy of rank 0's after every round for ddp; as one rank of a job,
/// this rank's).
struct GptSession {
  TrainConfig cfg;
  std::optional<EnvRank> env;  // set: one rank of a job its launcher started
  /// The process that reports and writes the outputs: the parent, or rank 0 of a job.
  bool lead() const { return !env || env->rank == 0; }
  FortuneCorpus corpus;
  at::Tensor eval_x, eval_y;  // int64 [windows, context]
  double unigram_train = 0;   // entropy of the training split's bytes (nats)
  double unigram_val = 0;     // the held-out split under the training split's frequencies
  Gpt gpt{nullptr};
  std::vector<EvalPoint> evals;
  std::string status = "completed";
  std::string error;
  std::optional<std::string> sample;
  nlohmann::json elastic;  // ranks of a job: Resumable::metrics()
};

/// The steps, tokens and losses reported in one round, summed and drawn.
struct RoundProgress {
  RoundProgress(ProgressBar& progress_bar, const TrainConfig& cfg, int64_t round)
      : bar(progress_bar), base(last_step(cfg, round - 1)), n_trainers(trainers(cfg)) {}

  void add(int64_t n_tokens, double loss, int64_t n_steps) {
    tokens += n_tokens;
    loss_sum += loss;
    steps += n_steps;  // summed over the ranks, which all take the same steps
    const double secs = Seconds(Clock::now() - start).count();
    bar.update(base + steps / n_trainers, steps ? loss_sum / static_cast<double>(steps) : 0,
               secs > 0 ? static_cast<double>(tokens) / secs : 0);
  }
  double train_loss() const { return steps ? loss_sum / static_cast<double>(steps) : 0; }

  ProgressBar& bar;
  int64_t base;
  int n_trainers;
  Clock::time_point start = Clock::now();
  int64_t tokens = 0, steps = 0;
  double loss_sum = 0;
};

/// Fills in gpt's defaults and checks its options. Returns 2 (after a message) for a bad one.
int complete_gpt_config(TrainConfig& cfg) {
  if (cfg.strategy != "single" && cfg.strategy != "ddp") {
    std::fprintf(stderr,
                 "torchpar train: --model gpt trains with --strategy single or ddp, not '%s' "
                 "(hogwild and pserver train the mnist model only)\n",
                 cfg.strategy.c_str());
    return 2;
  }
  if (int code = complete_common_config(cfg)) return code;
  if (cfg.data.empty()) cfg.data = kDefaultFortunesDir;
  if (cfg.steps <= 0) cfg.steps = kGptDefaultSteps;
  if (cfg.eval_every <= 0) cfg.eval_every = std::max<int64_t>(1, cfg.steps / 10);
  cfg.eval_every = std::min(cfg.eval_every, cfg.steps);
  return 0;
}

/// Fixed held-out windows: up to kEvalWindows of `context` + 1 bytes, evenly spaced over the
/// held-out split (without overlap when it is long enough).
void make_eval_windows(GptSession& s) {
  const int64_t c = s.cfg.context;
  const int64_t n_val = s.corpus.val.numel();
  const int64_t n = std::min(kEvalWindows, std::max<int64_t>(1, (n_val - 1) / c));
  const at::Tensor first =
      at::linspace(0, static_cast<double>(n_val - c - 1), n, at::kDouble).floor().to(at::kLong);
  const at::Tensor w =
      s.corpus.val.index_select(0, (first.unsqueeze(1) + at::arange(c + 1, at::kLong)).view(-1))
          .view({n, c + 1})
          .to(at::kLong);
  s.eval_x = w.slice(1, 0, c).contiguous();
  s.eval_y = w.slice(1, 1, c + 1).contiguous();
}

/// Loads the corpus, checks it is long enough for the context and builds the parent's model.
/// Returns 2 (after a message) for missing data or a bad model shape, else 0.
int prepare(GptSession& s) {
  const TrainConfig& cfg = s.cfg;
  try {
    s.corpus = load_fortunes(cfg.data, cfg.limit);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torchpar train: %s\n", e.what());
    return 2;
  }
  if (s.corpus.train.numel() < 2 * (cfg.context + 1) || s.corpus.val.numel() < cfg.context + 1) {
    std::fprintf(stderr,
                 "torchpar train: too little text in %s: %lld training and %lld held-out bytes "
                 "(--limit %lld); a context of %lld needs at least %lld and %lld\n",
                 cfg.data.c_str(), static_cast<long long>(s.corpus.train.numel()),
                 static_cast<long long>(s.corpus.val.numel()), static_cast<long long>(cfg.limit),
                 static_cast<long long>(cfg.context), static_cast<long long>(2 * (cfg.context + 1)),
                 static_cast<long long>(cfg.context + 1));
    return 2;
  }
  try {
    torch::manual_seed(cfg.seed);  // as every worker: the same initial parameters
    s.gpt = Gpt(gpt_config(cfg));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torchpar train: --model gpt: %s\n", e.what());
    return 2;
  }
  make_eval_windows(s);
  s.unigram_train = unigram_entropy(s.corpus.train);
  s.unigram_val = unigram_cross_entropy(s.corpus.train, s.corpus.val);
  return 0;
}

void print_plan(const GptSession& s) {
  const TrainConfig& cfg = s.cfg;
  const std::string who =
      s.env ? fmt::format("{} rank{} (RANK/WORLD_SIZE from the environment; this is rank 0)",
                          cfg.workers, cfg.workers == 1 ? "" : "s")
            : fmt::format("{} worker{}", cfg.workers, cfg.workers == 1 ? "" : "s");
  std::printf(
      "torchpar train: gpt, %s, %s, %lld steps, batch %d x %lld bytes per worker, "
      "AdamW lr %g -> %s\n"
      "model: %lld layers, width %lld, %lld heads, context %lld, %lld parameters; data: %lld "
      "files, %lld fortunes, %lld training bytes, %lld held out; unigram baseline %.4f nats/byte\n",
      cfg.strategy.c_str(), who.c_str(), static_cast<long long>(cfg.steps), cfg.batch_size,
      static_cast<long long>(cfg.context), cfg.lr, cfg.out.c_str(),
      static_cast<long long>(cfg.layers), static_cast<long long>(cfg.width),
      static_cast<long long>(cfg.heads), static_cast<long long>(cfg.context),
      static_cast<long long>(s.gpt->num_parameters()), static_cast<long long>(s.corpus.files),
      static_cast<long long>(s.corpus.fortunes), static_cast<long long>(s.corpus.train.numel()),
      static_cast<long long>(s.corpus.val.numel()), s.unigram_train);
  std::fflush(stdout);
}

/// Mean loss per byte (nats) of the parent's model on the held-out windows.
double evaluate(GptSession& s) {
  at::NoGradGuard no_grad;
  s.gpt->eval();
  double sum = 0;
  const int64_t n = s.eval_x.size(0);
  for (int64_t first = 0; first < n; first += kEvalBatch) {
    const int64_t last = std::min(n, first + kEvalBatch);
    const at::Tensor logits = s.gpt->forward(s.eval_x.slice(0, first, last));
    sum +=
        at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}),
                               s.eval_y.slice(0, first, last).reshape({-1}), {}, at::Reduction::Sum)
            .item<double>();
  }
  return sum / static_cast<double>(s.eval_x.numel());
}

/// Evaluates the parent's model after `round`, records it and prints its line.
void record_round(GptSession& s, int64_t round, double secs, const RoundProgress& progress) {
  const double val = evaluate(s);
  const int64_t step = last_step(s.cfg, round);
  s.evals.push_back({step, progress.train_loss(), val, secs, progress.tokens});
  progress.bar.finish();
  std::printf(
      "step %lld/%lld: train loss %.4f, val loss %.4f (perplexity %.2f; unigram baseline "
      "%.4f), %.1f s, %.0f tokens/s\n",
      static_cast<long long>(step), static_cast<long long>(s.cfg.steps), progress.train_loss(), val,
      std::exp(val), s.unigram_train, secs, static_cast<double>(progress.tokens) / secs);
  std::fflush(stdout);
}

void train_single(GptSession& s, ProgressBar& bar) {
  const TrainConfig& cfg = s.cfg;
  Stepper stepper(s.gpt, cfg, 0, s.corpus.train);
  for (int64_t round = 1; round <= rounds(cfg); ++round) {
    RoundProgress progress(bar, cfg, round);
    stepper.train(
        last_step(cfg, round - 1) + 1, last_step(cfg, round), [] {},
        [&](int64_t tokens, double loss_sum, int64_t steps) {
          throw_if_stopped();
          progress.add(tokens, loss_sum, steps);
        });
    record_round(s, round, Seconds(Clock::now() - progress.start).count(), progress);
  }
}

void start_ddp_workers(GptSession& s, Workers& w) {
  const TrainConfig& cfg = s.cfg;
  share_memory_(s.corpus.train);
  const int port = find_free_port();
  // The run's job key reaches the workers as an argument (the launch record, never argv).
  const AuthKey key = random_authkey();
  ProcessOptions po{.name = "",
                    .daemon = false,
                    .start_method = StartMethod::kSpawn,
                    .threads = cfg.threads_per_worker};
  for (int i = 0; i < cfg.workers; ++i) {
    po.name = fmt::format("train-worker-{}", i);
    w.procs.emplace_back(po, &gpt_ddp_worker, i, cfg, port, key, s.corpus.train, w.msgs, w.go,
                         w.params);
    w.procs.back().start();
  }
  w.last_heard = Clock::now();
  for (int ready = 0; ready < cfg.workers;) {
    if (auto m = poll(w.msgs, w, cfg)) {
      if (std::get<0>(*m) == kReady) ++ready;
    }
  }
}

void train_ddp(GptSession& s, Workers& w, ProgressBar& bar) {
  const TrainConfig& cfg = s.cfg;
  start_ddp_workers(s, w);
  for (int64_t round = 1; round <= rounds(cfg); ++round) {
    for (int i = 0; i < cfg.workers; ++i) w.go.put(static_cast<int>(round));
    RoundProgress progress(bar, cfg, round);
    for (int finished = 0; finished < cfg.workers;) {
      const auto m = poll(w.msgs, w, cfg);
      if (!m) continue;
      const auto [kind, who, r, tokens, loss_sum, steps] = *m;
      if (kind == kProgress) {
        progress.add(tokens, loss_sum, steps);
      } else if (kind == kEpochDone) {
        ++finished;
      }
    }
    const double secs = Seconds(Clock::now() - progress.start).count();
    copy_parameters(*s.gpt, wait_for(w.params, w, cfg));
    record_round(s, round, secs, progress);
  }
  stop_workers(w, cfg);
}

/// ddp as one rank of a job its launcher started (s.env): the World from the environment,
/// this process takes the steps spawned ddp worker `rank` would (same seeds, same
/// DistributedDataParallel), and only rank 0 draws progress and evaluates. A round's training
/// losses are summed over the ranks (one all_reduce), so rank 0 reports the job's train loss
/// as a spawned run's parent does.
/// Resumable (resume.h): the model, AdamW and the step come from memory or a checkpoint when
/// there is one, and training goes on from the round holding the next step.
/// Returns 2 when --resume names a directory without a checkpoint (nothing trained), else 0.
int train_ddp_as_rank(GptSession& s, ProgressBar& bar) {
  const TrainConfig& cfg = s.cfg;
  const int rank = s.env->rank;
  World world = join_env_world(cfg);
  // kAuto: shared memory among the ranks of one host, and across hosts what the World's
  // host keys call for (Gloo between hosts), never decided here.
  CollectiveGroup group = world.create_collective_group({}, backend_from_string(cfg.backend));
  // s.gpt: seed cfg.seed, as every worker's; buckets start during backward.
  DistributedDataParallel ddp(*s.gpt, group, {.overlap_with_backward = true});
  Stepper stepper(s.gpt, cfg, rank, s.corpus.train);
  Resumable res(cfg, s.lead());
  res.state().add("model", *s.gpt);
  res.state().add("optimizer", stepper.optimizer());
  if (!res.restore(group, world)) return 2;
  const int64_t ranks = cfg.workers;
  const int64_t resumed = std::min(res.step, cfg.steps);
  for (int64_t round = std::min(rounds(cfg), resumed / cfg.eval_every + 1); round <= rounds(cfg);
       ++round) {
    const int64_t first = std::max(last_step(cfg, round - 1), resumed) + 1;
    std::optional<RoundProgress> progress;
    if (s.lead()) {
      progress.emplace(bar, cfg, round);
      progress->base = first - 1;
    }
    double loss_sum = 0;
    int64_t steps = 0;
    stepper.train(
        first, last_step(cfg, round), [&] { ddp.synchronize_gradients(); },
        [&](int64_t tokens, double l, int64_t n) {
          throw_if_stopped();
          loss_sum += l;
          steps += n;
          // The ranks step in lockstep: as if every rank had reported this rank's numbers.
          if (progress) progress->add(tokens * ranks, l * static_cast<double>(ranks), n * ranks);
        },
        [&](int64_t step) {
          res.step = step;
          res.after_step();
        });
    at::Tensor sums = torch::tensor({loss_sum, static_cast<double>(steps)}, torch::kDouble);
    group.all_reduce(sums);
    if (!progress) continue;
    progress->loss_sum = sums[0].item<double>();
    progress->steps = static_cast<int64_t>(sums[1].item<double>());
    record_round(s, round, Seconds(Clock::now() - progress->start).count(), *progress);
  }
  s.elastic = res.metrics();
  return 0;
}

nlohmann::json metrics_json(const GptSession& s) {
  const TrainConfig& cfg = s.cfg;
  const GptConfig mc = gpt_config(cfg);
  nlohmann::json j;
  j["model"] = "gpt";
  j["strategy"] = cfg.strategy;
  j["workers"] = cfg.workers;
  if (cfg.strategy == "ddp") j["backend"] = cfg.backend;
  if (cfg.strategy == "ddp") j["launch"] = s.env ? "environment" : "spawn";
  j["config"] = {{"vocab_size", mc.vocab_size}, {"n_positions", mc.n_positions},
                 {"n_embd", mc.n_embd},         {"n_layer", mc.n_layer},
                 {"n_head", mc.n_head},         {"n_inner", mc.inner_size()}};
  j["parameters"] = s.gpt.is_empty() ? 0 : s.gpt->num_parameters();
  j["tokenizer"] = "bytes";
  j["batch_size"] = cfg.batch_size;
  j["context"] = cfg.context;
  j["tokens_per_step"] = int64_t{cfg.batch_size} * cfg.context * cfg.workers;
  j["steps"] = cfg.steps;
  j["eval_every"] = cfg.eval_every;
  j["eval_windows"] = s.eval_x.defined() ? s.eval_x.size(0) : 0;
  j["optimizer"] = {{"name", "AdamW"},
                    {"lr", cfg.lr},
                    {"betas", {kBeta1, kBeta2}},
                    {"weight_decay", kWeightDecay},
                    {"grad_clip", kGradClip},
                    {"warmup_steps", warmup_steps(cfg)},
                    {"final_lr", cfg.lr * kFinalLrFraction}};
  j["lr"] = cfg.lr;
  add_run_metrics(j, cfg, s.status, s.error);
  if (!s.elastic.is_null()) j["elastic"] = s.elastic;
  j["corpus"] = {{"files", s.corpus.files},
                 {"fortunes", s.corpus.fortunes},
                 {"bytes", s.corpus.bytes},
                 {"train_bytes", s.corpus.train.defined() ? s.corpus.train.numel() : 0},
                 {"val_bytes", s.corpus.val.defined() ? s.corpus.val.numel() : 0},
                 {"held_out", fmt::format("every {}th fortune", kHeldOutEvery)}};
  j["unigram_baseline_loss"] = s.unigram_train;
  j["unigram_val_loss"] = s.unigram_val;
  double secs = 0;
  int64_t tokens = 0;
  nlohmann::json evals = nlohmann::json::array();
  for (const auto& e : s.evals) {
    evals.push_back({{"step", e.step},
                     {"train_loss", e.train_loss},
                     {"val_loss", e.val_loss},
                     {"val_perplexity", std::exp(e.val_loss)},
                     {"seconds", e.seconds},
                     {"tokens", e.tokens},
                     {"tokens_per_s", e.seconds > 0 ? e.tokens / e.seconds : 0.0}});
    secs += e.seconds;
    tokens += e.tokens;
  }
  j["evals"] = evals;
  if (!s.evals.empty()) {
    j["val_loss"] = s.evals.back().val_loss;
    j["val_perplexity"] = std::exp(s.evals.back().val_loss);
  }
  j["total_seconds"] = secs;
  j["total_tokens"] = tokens;
  j["tokens_per_s"] = secs > 0 ? tokens / secs : 0.0;
  j["samples_per_s"] = secs > 0 ? static_cast<double>(tokens) / cfg.context / secs : 0.0;
  if (s.sample) {
    j["sample"] = {{"prompt", kSamplePrompt},
                   {"text", *s.sample},
                   {"bytes", s.sample->size()},
                   {"top_k", SampleOptions{}.top_k},
                   {"temperature", SampleOptions{}.temperature},
                   {"seed", cfg.seed}};
  }
  return j;
}

/// Samples from the trained model, prints the text and keeps it for metrics.json.
void sample(GptSession& s) {
  SampleOptions o;
  o.prompt = kSamplePrompt;
  o.seed = static_cast<uint64_t>(s.cfg.seed);
  s.sample = generate_bytes(*s.gpt, o);
  std::printf("sample (top-%lld, temperature %.1f):\n%s%s\n", static_cast<long long>(o.top_k),
              o.temperature, o.prompt.c_str(), s.sample->c_str());
  std::fflush(stdout);
}

/// Writes the outputs (with the model when the run completed or finished a round) and, for a
/// completed run, the closing line. Returns the exit code.
int finish_run(GptSession& s, int code) {
  const TrainConfig& cfg = s.cfg;
  try {
    const std::filesystem::path dir = cfg.out;
    std::filesystem::create_directories(dir);
    // Sampled bytes need not be UTF-8: invalid sequences become U+FFFD in the JSON.
    write_atomic(
        dir, "metrics.json",
        metrics_json(s).dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
    if (!s.evals.empty()) {
      save_gpt_checkpoint(*s.gpt, (dir / "model.pt").string());  // + model.json
      if (cfg.plot) draw_curves(dir);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torchpar train: cannot write the outputs: %s\n", e.what());
    return 1;
  }
  if (code == 0 && !s.evals.empty()) {
    double secs = 0;
    int64_t tokens = 0;
    for (const auto& e : s.evals) {
      secs += e.seconds;
      tokens += e.tokens;
    }
    const double val = s.evals.back().val_loss;
    std::printf(
        "done: val loss %.4f (perplexity %.2f; unigram baseline %.4f) after %lld steps; "
        "training %.1f s, %.0f tokens/s; outputs in %s\n",
        val, std::exp(val), s.unigram_train, static_cast<long long>(cfg.steps), secs,
        static_cast<double>(tokens) / secs, cfg.out.c_str());
  }
  return code;
}

}  // namespace

GptConfig gpt_config(const TrainConfig& cfg) {
  GptConfig c;
  c.vocab_size = 256;
  c.n_positions = cfg.context;
  c.n_embd = cfg.width;
  c.n_layer = cfg.layers;
  c.n_head = cfg.heads;
  c.n_inner = 4 * cfg.width;
  c.dtype = at::kFloat;
  return c;
}

std::string generate_bytes(GptImpl& gpt, const SampleOptions& o) {
  if (o.prompt.empty() || o.top_k < 1 || !(o.temperature > 0))
    throw ValueError(fmt::format(
        "generate_bytes: needs a non-empty prompt (got {} bytes), top_k >= 1 (got {}) and a "
        "temperature > 0 (got {})",
        o.prompt.size(), o.top_k, o.temperature));
  at::NoGradGuard no_grad;
  gpt.eval();
  const int64_t context = gpt.config().n_positions;
  const SamplingOptions sampling{.temperature = o.temperature, .top_k = o.top_k};
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  std::string text = o.prompt;
  GptKvCache cache;
  // Starts over from the last `keep` bytes of the text: the logits of the byte after them.
  auto restart = [&](int64_t keep) {
    cache.clear();
    const size_t n = std::min(text.size(), static_cast<size_t>(keep));
    return gpt.forward(ids_of(std::string_view(text).substr(text.size() - n)), &cache)
        .select(1, -1);
  };
  at::Tensor logits = restart(context);  // [1, vocab]
  for (int64_t i = 0; i < o.bytes; ++i) {
    const int64_t byte = sample_next_token(logits, sampling, gen).item<int64_t>();
    text.push_back(static_cast<char>(static_cast<unsigned char>(byte)));
    if (cache.length() >= context) {
      logits = restart(context / 2);
    } else {
      logits =
          gpt.forward(ids_of(std::string_view(text).substr(text.size() - 1)), &cache).select(1, -1);
    }
  }
  return text.substr(o.prompt.size());
}

int run_gpt_train(TrainConfig cfg) {
  GptSession s;
  // Started by a launcher as one rank of a job: no workers of its own (cfg.workers = ranks).
  if (int code = rank_from_env(cfg, s.env)) return code;
  if (int code = complete_gpt_config(cfg)) return code;
  if (int code = check_resume_options(cfg, s.env.has_value())) return code;
  // Before any ATen work: an OpenMP pool made wider now keeps spinning beside the training.
  at::set_num_threads(cfg.threads_per_worker);
  s.cfg = cfg;
  if (int code = prepare(s)) return code;
  // Only the lead writes: the other ranks of a job leave --out alone (it may be shared).
  if (s.lead()) {
    if (int code = check_out_writable(cfg)) return code;
    print_plan(s);
  }
  install_stop_handlers();

  int code = 0;
  std::optional<Workers> workers;
  ProgressBar bar("train", cfg.steps, "steps", "tokens/s");
  const std::string me =
      s.env ? fmt::format("rank {} of {} ", s.env->rank, s.env->world_size) : std::string();
  try {
    if (cfg.strategy == "single") {
      train_single(s, bar);
    } else if (s.env) {
      code = train_ddp_as_rank(s, bar);
    } else {
      train_ddp(s, workers.emplace(), bar);
    }
    if (s.lead() && code == 0) sample(s);
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
      s.status = "failed";
      s.error = me + e.what();
      code = 1;
    }
  }
  if (code == 2) {  // --resume found nothing (Resumable::restore said so)
    s.status = "failed";
    s.error = "--resume: no checkpoint in " + cfg.resume;
  }
  if (code == 130) {
    if (s.lead()) {
      std::printf("\ntorchpar train: interrupted; %skeeping %zu finished evaluation(s) in %s\n",
                  s.env ? "" : "stopping the workers, ", s.evals.size(), cfg.out.c_str());
    }
    kill_workers(workers);
    s.status = "interrupted";
  }
  if (!s.lead()) return code;
  return finish_run(s, code);
}

}  // namespace torchpar::train
