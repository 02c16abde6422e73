// `torchpar infer`: a GPT checkpoint (model.pt + model.json) -> TensorParallel -> generated text.
#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "text.h"
#include "torchpar/core/error.h"
#include "torchpar/parallel/gpt_checkpoint.h"
#include "torchpar/parallel/tensor_parallel.h"

namespace torchpar::cli {
namespace {

struct InferConfig {
  std::string model;
  std::string prompt;
  int tensor_parallel = 1;
  int64_t max_new_tokens = 64;
  double temperature = 0.8;
  int64_t top_k = 40;
  bool greedy = false;
  uint64_t seed = 0;
  bool has_seed = false;  // --seed given
  std::string dtype = "float32";
  std::string backend = "auto";
  int threads_per_worker = 0;
  double timeout = 300;
};

int run_infer(const InferConfig& c) {
  const GptCheckpointInfo info = load_gpt_checkpoint_info(c.model);
  if (info.tokenizer != "bytes")
    throw ValueError(fmt::format(
        "'{}' says tokenizer \"{}\"; torchpar infer knows \"bytes\" only (token = byte value)",
        gpt_checkpoint_info_path(c.model), info.tokenizer));
  if (c.prompt.empty()) throw ValueError("--prompt is empty: give at least one character");
  std::vector<int64_t> ids;
  for (const char ch : c.prompt) ids.push_back(static_cast<unsigned char>(ch));
  const auto prompt_len = static_cast<int64_t>(ids.size());
  if (prompt_len + c.max_new_tokens > info.config.n_positions)
    throw ValueError(fmt::format(
        "the prompt ({} bytes) and --max-new-tokens {} exceed the model's context of {} "
        "positions (n_positions): shorten one of them",
        prompt_len, c.max_new_tokens, info.config.n_positions));
  const at::Tensor prompt =
      at::tensor(ids, at::TensorOptions().dtype(at::kLong)).view({1, prompt_len});

  TensorParallelOptions options{
      .world_size = c.tensor_parallel,
      .dtype = dtype_from_string(c.dtype),
      .timeout = std::chrono::duration<double>(c.timeout),
      .backend = backend_from_string(c.backend),
      .threads_per_worker = c.threads_per_worker,
      .seed = c.has_seed ? std::optional<uint64_t>(c.seed) : std::nullopt};
  const auto t0 = std::chrono::steady_clock::now();
  TensorParallel engine(c.model, options);
  const auto t1 = std::chrono::steady_clock::now();
  const at::Tensor out = engine.generate(prompt, {.max_new_tokens = c.max_new_tokens,
                                                  .temperature = c.temperature,
                                                  .top_k = c.top_k,
                                                  .greedy = c.greedy});
  const auto t2 = std::chrono::steady_clock::now();
  engine.shutdown();

  std::string bytes;
  const auto* tokens = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < out.size(1); ++i) {
    // A vocabulary above 256 ids may produce tokens that are no byte: shown as U+FFFD.
    bytes.push_back(tokens[i] < 256 ? static_cast<char>(tokens[i]) : '\xFF');
  }
  fmt::print("{}\n", valid_utf8(bytes));
  std::fflush(stdout);
  const double start_s = std::chrono::duration<double>(t1 - t0).count();
  const double gen_s = std::chrono::duration<double>(t2 - t1).count();
  fmt::print(stderr,
             "torchpar infer: {} new tokens in {:.3f} s: {:.1f} tokens/s (tensor parallel {}, {}, "
             "{}; workers ready in {:.2f} s, seed {})\n",
             c.max_new_tokens, gen_s,
             gen_s > 0 ? static_cast<double>(c.max_new_tokens) / gen_s : 0.0, c.tensor_parallel,
             dtype_name(options.dtype),
             c.greedy ? std::string("greedy")
                      : fmt::format("temperature {}, top-k {}", c.temperature, c.top_k),
             start_s, engine.seed());
  return 0;
}

}  // namespace

Command add_infer(CLI::App& app) {
  auto c = std::make_shared<InferConfig>();
  auto* cmd = app.add_subcommand(
      "infer",
      "Continue a prompt with a GPT checkpoint (model.pt + model.json, as `torchpar train "
      "--model gpt` writes it) split over N worker processes (tensor parallelism). Prints the "
      "text on stdout and tokens/s on stderr.");
  cmd->add_option("--model", c->model, "model.pt of a GPT checkpoint; model.json beside it")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--prompt", c->prompt, "text to continue (byte-level tokens)")->required();
  cmd->add_option("--tensor-parallel", c->tensor_parallel,
                  "worker processes the model is split over (divides the heads and widths)")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  cmd->add_option("--max-new-tokens", c->max_new_tokens, "tokens (bytes) to generate")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20))
      ->capture_default_str();
  cmd->add_option("--temperature", c->temperature, "softmax temperature (finite); 0: greedy")
      ->check(finite_number(0, std::numeric_limits<double>::max()))
      ->capture_default_str();
  cmd->add_option("--top-k", c->top_k, "sample among the k likeliest tokens; 0: all")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_flag("--greedy", c->greedy, "always the likeliest token");
  auto* seed =
      cmd->add_option("--seed", c->seed, "sampling seed (default: random, printed on stderr)")
          ->check(decimal_integer<uint64_t>());
  add_worker_options(cmd, c->dtype, c->backend, c->threads_per_worker);
  cmd->add_option("--timeout", c->timeout, "seconds: starting, and the whole generation")
      ->check(finite_number(0, kMaxTimeoutSeconds, /*lo_open=*/true))
      ->capture_default_str();
  return [c, seed] {
    c->has_seed = seed->count() > 0;
    return run_infer(*c);
  };
}

}  // namespace torchpar::cli
