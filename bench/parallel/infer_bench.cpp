// infer_bench: tokens/s of TensorParallel::generate on a seeded GPT-2-shaped model, and the
// resident memory of every worker (issue 17's benchmark; `torchpar bench` section inference).
//
// One engine of --tp worker processes (spawn), --threads LibTorch intra-op threads each, runs
// greedy generate for each batch size of --batches: one untimed warm-up generate of 4 new
// tokens, then --reps timed generates of --new-tokens tokens after a --prompt token prompt
// (ids drawn with seed 0; the prompt's forward is timed too). The model is GPT-2 small by
// default (--layers 12 --width 768 --heads 12 --vocab 50257 --positions 1024), built in each
// worker with GPT-2's initialisation from seed 1234 (every rank alike) and only its shard
// (vocabulary split too unless --vocab-parallel 0), float32 unless --dtype bfloat16.
//
// Prints one JSON object per line, {"name", "value", "unit"}, the same names as its peer
// bench/peers/python_tp_infer.py:
//   batch<B>/tokens_per_s   B * new tokens / the median wall time of a generate
//   batch<B>/ms_per_token   the median wall time / new tokens (milliseconds)
//   rank<r>/rss_mib, rank<r>/hwm_mib, rank<r>/anon_mib
//                           the worker's VmRSS, VmHWM (peak) and RssAnon after the timed runs
//   startup_s               the engine's constructor: workers started, shards built, ready
//   parameters_per_rank     rank 0's parameter elements
// Exit status 1 with the error on stderr when anything fails.

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "torchpar/core/error.h"
#include "torchpar/parallel/gpt.h"
#include "torchpar/parallel/tensor_parallel.h"
#include "torchpar/process/start_method.h"

namespace tp = torchpar;

namespace {

/// The model's shape and layout, passed to the workers as the registered model's argument:
/// "layers width heads vocab positions inner vocab_parallel".
struct Shape {
  int64_t layers = 12, width = 768, heads = 12, vocab = 50257, positions = 1024, inner = 0;
  int vocab_parallel = 1;

  std::string encode() const {
    return fmt::format("{} {} {} {} {} {} {}", layers, width, heads, vocab, positions, inner,
                       vocab_parallel);
  }
  static Shape decode(const std::string& s) {
    Shape sh;
    std::istringstream in(s);
    in >> sh.layers >> sh.width >> sh.heads >> sh.vocab >> sh.positions >> sh.inner >>
        sh.vocab_parallel;
    if (!in) throw tp::ValueError(fmt::format("infer_bench: bad model argument '{}'", s));
    return sh;
  }
  tp::GptConfig config(at::ScalarType dtype) const {
    return tp::GptConfig{.vocab_size = vocab,
                         .n_positions = positions,
                         .n_embd = width,
                         .n_layer = layers,
                         .n_head = heads,
                         .n_inner = inner,
                         .dtype = dtype};
  }
};

class SeededGpt final : public tp::TensorParallelModel {
 public:
  explicit SeededGpt(tp::Gpt gpt) : gpt_(std::move(gpt)) { gpt_->eval(); }
  at::Tensor forward(const at::Tensor& input_ids, tp::GptKvCache* cache) override {
    return gpt_->forward(input_ids, cache);
  }
  int64_t parameters() const { return gpt_->num_parameters(); }

 private:
  tp::Gpt gpt_;
};

// Registered at namespace scope: spawned workers run this program's statics too.
const bool kRegistered =
    tp::register_tensor_parallel_model("infer_bench_gpt", [](const tp::TensorParallelContext& ctx) {
      const Shape sh = Shape::decode(ctx.argument);
      at::manual_seed(1234);
      return std::make_shared<SeededGpt>(tp::Gpt(
          sh.config(ctx.dtype),
          tp::GptOptions{
              .comm = ctx.comm, .initialize = true, .vocab_parallel = sh.vocab_parallel != 0}));
    });

/// VmRSS, VmHWM and RssAnon of process `pid` in MiB (-1 when unreadable).
std::map<std::string, double> memory_mib(int pid) {
  std::map<std::string, double> m{{"VmRSS", -1}, {"VmHWM", -1}, {"RssAnon", -1}};
  std::ifstream in(fmt::format("/proc/{}/status", pid));
  std::string line;
  while (std::getline(in, line)) {
    for (auto& [key, value] : m) {
      if (line.rfind(key + ":", 0) == 0) value = std::stod(line.substr(key.size() + 1)) / 1024.0;
    }
  }
  return m;
}

void emit(const std::string& name, double value, const std::string& unit) {
  std::printf("{\"name\": \"%s\", \"value\": %.6g, \"unit\": \"%s\"}\n", name.c_str(), value,
              unit.c_str());
  std::fflush(stdout);
}

std::vector<int64_t> parse_batches(const std::string& s) {
  std::vector<int64_t> out;
  std::istringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    const int64_t b = std::stoll(item);
    if (b < 1) throw tp::ValueError(fmt::format("--batches: {} is not a batch size >= 1", b));
    out.push_back(b);
  }
  if (out.empty()) throw tp::ValueError("--batches: empty");
  return out;
}

int run(int argc, char** argv) {
  CLI::App app{"tokens/s of TensorParallel::generate on a seeded GPT-2-shaped model"};
  Shape shape;
  int world = 2, threads = 1, reps = 3;
  int64_t new_tokens = 64, prompt_len = 16;
  std::string batches_arg = "1,8", dtype_name = "float32", backend_name = "auto";
  double timeout_s = 600;
  app.add_option("--tp", world, "tensor-parallel world size (worker processes)")
      ->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "LibTorch intra-op threads per worker")
      ->check(CLI::PositiveNumber);
  app.add_option("--batches", batches_arg, "comma-separated batch sizes");
  app.add_option("--new-tokens", new_tokens, "tokens generated per row")
      ->check(CLI::PositiveNumber);
  app.add_option("--prompt", prompt_len, "prompt tokens per row")->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "timed generates per batch size (median)")
      ->check(CLI::PositiveNumber);
  app.add_option("--layers", shape.layers)->check(CLI::PositiveNumber);
  app.add_option("--width", shape.width)->check(CLI::PositiveNumber);
  app.add_option("--heads", shape.heads)->check(CLI::PositiveNumber);
  app.add_option("--vocab", shape.vocab)->check(CLI::PositiveNumber);
  app.add_option("--positions", shape.positions)->check(CLI::PositiveNumber);
  app.add_option("--inner", shape.inner, "MLP width; 0: 4 * width")->check(CLI::NonNegativeNumber);
  app.add_option("--vocab-parallel", shape.vocab_parallel,
                 "1: split the embedding and head by vocabulary rows; 0: replicate them")
      ->check(CLI::Range(0, 1));
  app.add_option("--dtype", dtype_name)->check(CLI::IsMember({"float32", "bfloat16"}));
  app.add_option("--backend", backend_name)->check(CLI::IsMember({"auto", "shm", "gloo"}));
  app.add_option("--timeout", timeout_s, "seconds: start-up and each call")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  const auto batches = parse_batches(batches_arg);

  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  tp::TensorParallel engine(
      tp::TensorParallelModelName{"infer_bench_gpt", shape.encode()},
      tp::TensorParallelOptions{.world_size = world,
                                .dtype = dtype_name == "bfloat16" ? at::kBFloat16 : at::kFloat,
                                .start_method = tp::StartMethod::kSpawn,
                                .timeout = std::chrono::duration<double>(timeout_s),
                                .backend = tp::backend_from_string(backend_name),
                                .threads_per_worker = threads,
                                .seed = 0});
  emit("startup_s", std::chrono::duration<double>(Clock::now() - t0).count(), "s");

  at::manual_seed(0);
  for (const int64_t b : batches) {
    const auto prompt =
        at::randint(shape.vocab, {b, prompt_len}, at::TensorOptions().dtype(at::kLong));
    engine.generate(prompt, {.max_new_tokens = std::min<int64_t>(4, new_tokens), .greedy = true});
    std::vector<double> secs;
    for (int r = 0; r < reps; ++r) {
      const auto start = Clock::now();
      const auto out = engine.generate(prompt, {.max_new_tokens = new_tokens, .greedy = true});
      secs.push_back(std::chrono::duration<double>(Clock::now() - start).count());
      if (out.size(0) != b || out.size(1) != prompt_len + new_tokens)
        throw tp::ValueError(fmt::format("generate returned [{}, {}]", out.size(0), out.size(1)));
    }
    std::sort(secs.begin(), secs.end());
    const double median = secs.size() % 2 == 1
                              ? secs[secs.size() / 2]
                              : (secs[secs.size() / 2 - 1] + secs[secs.size() / 2]) / 2;
    emit(fmt::format("batch{}/tokens_per_s", b), static_cast<double>(b * new_tokens) / median,
         "tokens/s");
    emit(fmt::format("batch{}/ms_per_token", b), median * 1e3 / static_cast<double>(new_tokens),
         "ms");
  }
  const auto pids = engine.pids();
  for (size_t r = 0; r < pids.size(); ++r) {
    const auto m = memory_mib(pids[r]);
    emit(fmt::format("rank{}/rss_mib", r), m.at("VmRSS"), "MiB");
    emit(fmt::format("rank{}/hwm_mib", r), m.at("VmHWM"), "MiB");
    emit(fmt::format("rank{}/anon_mib", r), m.at("RssAnon"), "MiB");
  }
  // Rank 0's shard, counted here from the same construction (no weights: at::empty).
  const auto noop = [](at::Tensor&) {};
  const auto gather = [world](const at::Tensor& t, int64_t dim) {
    return at::cat(std::vector<at::Tensor>(static_cast<size_t>(world), t), dim);
  };
  tp::Gpt counted(
      shape.config(at::kFloat),
      tp::GptOptions{
          .comm = {.rank = 0, .world_size = world, .all_reduce_sum = noop, .all_gather = gather},
          .initialize = false,
          .vocab_parallel = shape.vocab_parallel != 0});
  emit("parameters_per_rank", static_cast<double>(counted->num_parameters()), "elements");
  engine.shutdown();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  tp::init(argc, argv);
  (void)kRegistered;
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "infer_bench: %s\n", e.what());
    return 1;
  }
}
