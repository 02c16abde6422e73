// The TensorParallel engine: worker processes (spawn; fork for a std::function factory) running a
// small seeded Gpt saved by this test as a checkpoint (save_gpt_checkpoint: model.pt +
// model.json). Logits at TP = 1 and TP = 2 against the model in this process; greedy and seeded
// sampled generation; bfloat16, float16; argument errors that leave the engine usable; a
// worker's private memory after wide requests, and after the last step of a wide batch, back
// near its idle figure. Faults:
// a worker that throws, a worker SIGKILLed mid-generate and one killed while idle (the call
// raises WorkerError naming the rank within the timeout, and no worker is left); a worker that
// cannot start; shutdown twice; the destructor.
#include <ATen/CPUGeneratorImpl.h>
#include <dirent.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "support/run_tests.h"
#include "torchpar/parallel/gpt.h"
#include "torchpar/parallel/gpt_checkpoint.h"
#include "torchpar/parallel/sampling.h"
#include "torchpar/parallel/state_dict.h"
#include "torchpar/parallel/tensor_parallel.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

using Shape = std::vector<int64_t>;

const tp::GptConfig kConfig{
    .vocab_size = 97, .n_positions = 96, .n_embd = 32, .n_layer = 2, .n_head = 4};
constexpr double kTolerance = 1e-5;  // float32 logits: TP = 2 sums in another order
constexpr auto kTimeout = 60s;       // every engine's limit; the faults must show well within it

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

bool pid_gone(int pid) { return ::kill(pid, 0) != 0 && errno == ESRCH; }

/// Descendants of this process now: its children, theirs (a forkserver's workers), ... (from
/// /proc/<pid>/stat's ppid field).
std::set<int> children() {
  std::map<int, std::vector<int>> kids;
  DIR* proc = ::opendir("/proc");
  if (proc == nullptr) return {};
  while (const dirent* e = ::readdir(proc)) {
    const std::string name = e->d_name;
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream f("/proc/" + name + "/stat");
    std::string line;
    if (!std::getline(f, line)) continue;  // gone meanwhile
    const auto close = line.rfind(')');
    if (close == std::string::npos) continue;
    char state = 0;
    int ppid = 0;
    if (std::sscanf(line.c_str() + close + 1, " %c %d", &state, &ppid) == 2)
      kids[ppid].push_back(std::stoi(name));
  }
  ::closedir(proc);
  std::set<int> out;
  std::vector<int> todo{::getpid()};
  while (!todo.empty()) {
    const int pid = todo.back();
    todo.pop_back();
    for (int kid : kids[pid])
      if (out.insert(kid).second) todo.push_back(kid);
  }
  return out;
}

void noop() {}

/// ids [batch, tokens] in [0, vocab), from a seed.
at::Tensor random_ids(int64_t batch, int64_t tokens, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(kConfig.vocab_size, {batch, tokens}, gen, at::TensorOptions(at::kLong));
}

/// Greedy decoding without a cache: one full forward per new token.
at::Tensor reference_greedy(tp::GptImpl& gpt, at::Tensor ids, int64_t n) {
  at::NoGradGuard no_grad;
  for (int64_t i = 0; i < n; ++i) {
    const auto next = gpt.forward(ids).select(1, -1).argmax(-1, /*keepdim=*/true);
    ids = at::cat({ids, next}, 1);
  }
  return ids;
}

// ---- the checkpoint every test uses -----------------------------------------------------------

/// A seeded Gpt of kConfig saved with save_gpt_checkpoint in a temporary directory, and the same
/// model in this process (the reference).
class Checkpoint {
 public:
  static Checkpoint& get() {
    static Checkpoint c;
    return c;
  }
  const std::string& path() const { return path_; }
  tp::Gpt& model() { return model_; }
  /// The model's logits in this process.
  at::Tensor logits(const at::Tensor& ids) {
    at::NoGradGuard no_grad;
    return model_->forward(ids);
  }
  ~Checkpoint() {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

 private:
  Checkpoint() : model_(nullptr) {
    std::string tmpl = (std::filesystem::temp_directory_path() / "torchpar_tp_XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    dir_ = tmpl;
    path_ = dir_ + "/model.pt";
    at::manual_seed(0);
    model_ = tp::Gpt(kConfig);
    model_->eval();
    tp::save_gpt_checkpoint(*model_, path_);
  }
  std::string dir_;
  std::string path_;
  tp::Gpt model_;
};

// ---- a registered model with faults, for every start method -----------------------------------

/// The checkpoint's Gpt with an injected fault. Argument: "<mode>:<path>"; mode "throw13": rank 1
/// raises ValueError when token 13 is in its input; "slow": every forward first sleeps 20 ms;
/// "plain": no fault.
class FaultyGpt final : public tp::TensorParallelModel {
 public:
  FaultyGpt(const tp::TensorParallelContext& ctx, std::string mode, const std::string& path)
      : rank_(ctx.comm.rank), mode_(std::move(mode)) {
    auto config = kConfig;
    config.dtype = ctx.dtype;
    gpt_ = tp::load_gpt(config, tp::load_state_dict_file(path), {.comm = ctx.comm});
  }
  at::Tensor forward(const at::Tensor& ids, tp::GptKvCache* cache) override {
    if (mode_ == "throw13" && rank_ == 1 && (ids == 13).any().item<bool>())
      throw tp::ValueError("FaultyGpt: rank 1 refuses token 13");
    if (mode_ == "slow") std::this_thread::sleep_for(20ms);
    return gpt_->forward(ids, cache);
  }

 private:
  int rank_;
  std::string mode_;
  tp::Gpt gpt_{nullptr};
};

const bool kFaultyRegistered = tp::register_tensor_parallel_model(
    "engine_test_faulty_gpt", [](const tp::TensorParallelContext& ctx) {
      const auto colon = ctx.argument.find(':');
      return std::make_shared<FaultyGpt>(ctx, ctx.argument.substr(0, colon),
                                         ctx.argument.substr(colon + 1));
    });

tp::TensorParallelModelName faulty(const std::string& mode) {
  return {.name = "engine_test_faulty_gpt", .argument = mode + ":" + Checkpoint::get().path()};
}

// Workers start from the forkserver: one LibTorch start per test binary, not one per worker.
// The default (spawn) is what Tp1AndTp2LogitsEqualTheModelInThisProcess keeps.
tp::TensorParallelOptions tp_options(int world) {
  return {.world_size = world, .start_method = tp::StartMethod::kForkserver, .timeout = kTimeout};
}

// ---- the checkpoint ---------------------------------------------------------------------------

TEST(GptCheckpoint, RoundTripsThroughTheFiles) {
  auto& c = Checkpoint::get();
  const auto info = tp::load_gpt_checkpoint_info(c.path());
  EXPECT_EQ(info.config.vocab_size, 97);
  EXPECT_EQ(info.config.n_positions, 96);
  EXPECT_EQ(info.config.n_embd, 32);
  EXPECT_EQ(info.config.n_layer, 2);
  EXPECT_EQ(info.config.n_head, 4);
  EXPECT_EQ(info.config.dtype, at::kFloat);
  EXPECT_EQ(info.tokenizer, "bytes");
  EXPECT_EQ(info.weight_layout, "conv1d");
  const auto sd = tp::load_state_dict_file(c.path());
  // GPT-2's Conv1D layout: c_attn [in, 3 * in].
  EXPECT_EQ(sd.at("h.0.attn.c_attn.weight").sizes().vec(), Shape({32, 96}));
  auto back = tp::load_gpt(info.config, sd, {.policy = info.policy()});
  at::NoGradGuard no_grad;
  const auto ids = random_ids(2, 9, 1);
  EXPECT_TRUE(at::equal(back->forward(ids), c.logits(ids)));

  // The linear layout loads with its policy.
  const std::string dir = std::filesystem::path(c.path()).parent_path().string();
  const std::string linear = dir + "/linear.pt";
  tp::save_state_dict_file(tp::gpt_checkpoint_state_dict(*c.model(), "linear"), linear);
  tp::save_gpt_checkpoint_info({.config = kConfig, .weight_layout = "linear"}, linear);
  const auto linear_info = tp::load_gpt_checkpoint_info(linear);
  EXPECT_EQ(linear_info.weight_layout, "linear");
  auto from_linear =
      tp::load_gpt(kConfig, tp::load_state_dict_file(linear), {.policy = linear_info.policy()});
  EXPECT_TRUE(at::equal(from_linear->forward(ids), c.logits(ids)));
}

TEST(GptCheckpoint, PythonTorchLoadReadsTheFile) {
  if (::access("/usr/bin/python3", X_OK) != 0 ||
      tp::run_program({"/usr/bin/python3", "-c", "import torch"}, {}, 120s) != 0)
    GTEST_SKIP() << "no /usr/bin/python3 with torch (Debian: python3-torch)";
  auto& c = Checkpoint::get();
  // The file save_state_dict_file wrote, read by Python's torch.load: the same tensors.
  const std::string dir = std::filesystem::path(c.path()).parent_path().string();
  const std::string script =
      "import sys, torch\n"
      "d = torch.load(sys.argv[1])\n"
      "assert isinstance(d, dict), type(d)\n"
      "assert tuple(d['h.0.attn.c_attn.weight'].shape) == (32, 96), "
      "d['h.0.attn.c_attn.weight'].shape\n"
      "torch.save({'wte': d['wte.weight'].clone(), 'n': torch.tensor(len(d))}, sys.argv[2])\n";
  ASSERT_EQ(
      tp::run_program({"/usr/bin/python3", "-c", script, c.path(), dir + "/echo.pt"}, {}, 120s), 0);
  const auto echo = tp::load_state_dict_file(dir + "/echo.pt");
  EXPECT_TRUE(at::equal(echo.at("wte"), c.model()->named_parameters()["wte.weight"]));
  EXPECT_EQ(echo.at("n").item<int64_t>(),
            static_cast<int64_t>(tp::load_state_dict_file(c.path()).size()));
}

TEST(GptCheckpoint, BadSidecarsAreRefusedNamingTheKey) {
  const std::string dir = std::filesystem::path(Checkpoint::get().path()).parent_path().string();
  const std::string model = dir + "/bad.pt";
  auto write = [&](const std::string& text) { std::ofstream(dir + "/bad.json") << text; };
  write("{\"vocab_size\": 97, \"n_positions\": 96, \"n_embd\": 32, \"n_layer\": 2}");
  try {
    tp::load_gpt_checkpoint_info(model);
    ADD_FAILURE() << "a sidecar without n_head was read";
  } catch (const tp::SerializationError& e) {
    EXPECT_TRUE(has(e.what(), "n_head") && has(e.what(), "bad.json")) << e.what();
  }
  write("{\"vocab_size\": \"many\"");
  EXPECT_THROW(tp::load_gpt_checkpoint_info(model), tp::SerializationError);
  write(
      "{\"vocab_size\": 97, \"n_positions\": 96, \"n_embd\": 32, \"n_layer\": 2, \"n_head\": 4, "
      "\"dtype\": \"int8\"}");
  EXPECT_THROW(tp::load_gpt_checkpoint_info(model), tp::SerializationError);
  // Integers that JSON states but an int64 does not hold (1e30 became INT64_MIN), fractions,
  // and sizes out of range are refused naming the key.
  const std::pair<std::string, std::string> bad_sizes[] = {{"n_embd", "1e30"},
                                                           {"n_embd", "32.5"},
                                                           {"n_layer", "0"},
                                                           {"n_head", "-4"},
                                                           {"vocab_size", "18446744073709551615"},
                                                           {"n_positions", "1e3"},
                                                           {"n_inner", "-1"},
                                                           {"n_embd", "4294967296"},
                                                           {"n_layer", "true"}};
  for (const auto& [key, value] : bad_sizes) {
    std::string text =
        "{\"vocab_size\": 97, \"n_positions\": 96, \"n_embd\": 32, \"n_layer\": 2, "
        "\"n_head\": 4, \"n_inner\": 0}";
    const auto at = text.find("\"" + key + "\": ") + key.size() + 4;
    text.replace(at, text.find_first_of(",}", at) - at, value);
    write(text);
    try {
      const auto info = tp::load_gpt_checkpoint_info(model);
      ADD_FAILURE() << key << " = " << value << " was read as " << info.config.n_embd << ", "
                    << info.config.vocab_size;
    } catch (const tp::SerializationError& e) {
      EXPECT_TRUE(has(e.what(), "\"" + key + "\"")) << e.what();
    }
  }
  write(
      "{\"vocab_size\": 97, \"n_positions\": 96, \"n_embd\": 32, \"n_layer\": 2, \"n_head\": 4, "
      "\"layer_norm_epsilon\": -1}");
  EXPECT_THROW(tp::load_gpt_checkpoint_info(model), tp::SerializationError);
  // Sidecars that are no regular file, or too large, are refused before they are read: a FIFO
  // (opening it blocked for a writer), /dev/zero (read until memory ran out), 2 MiB of spaces.
  std::filesystem::remove(dir + "/bad.json");
  ASSERT_EQ(::mkfifo((dir + "/bad.json").c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    tp::load_gpt_checkpoint_info(model);
    ADD_FAILURE() << "a FIFO sidecar was read";
  } catch (const tp::SerializationError& e) {
    EXPECT_TRUE(has(e.what(), "not a regular file") && has(e.what(), "bad.json")) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  std::filesystem::remove(dir + "/bad.json");
  std::filesystem::create_symlink("/dev/zero", dir + "/bad.json");
  EXPECT_THROW(tp::load_gpt_checkpoint_info(model), tp::SerializationError);
  std::filesystem::remove(dir + "/bad.json");
  write(std::string(2 << 20, ' ') + "{}");
  try {
    tp::load_gpt_checkpoint_info(model);
    ADD_FAILURE() << "a 2 MiB sidecar was read";
  } catch (const tp::SerializationError& e) {
    EXPECT_TRUE(has(e.what(), "more than the 1048576")) << e.what();
  }
  EXPECT_THROW(tp::load_gpt_checkpoint_info(dir + "/none.pt"), tp::Error);
  // No sidecar: the path constructor refuses before any worker starts.
  EXPECT_THROW(tp::TensorParallel(dir + "/none.pt", tp_options(2)), tp::Error);
}

// ---- results ----------------------------------------------------------------------------------

// Issue 37: an in-memory Gpt runs in TensorParallel without a wrapper or a file (parallelformers'
// parallelize(model) of a model object). Changing the model afterwards does not reach the workers.
TEST(TensorParallelEngine, AnInMemoryGptRunsWithoutAWrapper) {
  auto& c = Checkpoint::get();
  const auto ids = random_ids(2, 7, 5);
  const at::Tensor want = c.logits(ids);
  tp::Gpt gpt(kConfig);
  gpt->load_state_dict(tp::load_state_dict_file(c.path()));  // the checkpoint's weights
  tp::TensorParallel two(*gpt, {.world_size = 2, .timeout = kTimeout});
  {
    at::NoGradGuard no_grad;
    for (auto& p : gpt->parameters()) p.zero_();  // the workers took their shards already
  }
  const auto logits = two.forward(ids);
  ASSERT_EQ(logits.sizes().vec(), Shape({2, 7, 97}));
  EXPECT_LE(max_abs_diff(logits, want), kTolerance);
  const auto out = two.generate(ids, {.max_new_tokens = 3, .greedy = true});
  EXPECT_EQ(out.sizes().vec(), Shape({2, 10}));
  // GptTensorParallelModel is the wrapper a factory returns for a Gpt it built.
  tp::TensorParallel via_factory(
      [path = c.path()](const tp::TensorParallelContext& ctx) {
        return std::make_shared<tp::GptTensorParallelModel>(
            tp::load_gpt(kConfig, tp::load_state_dict_file(path), {.comm = ctx.comm}));
      },
      {.world_size = 2, .start_method = tp::StartMethod::kFork, .timeout = kTimeout});
  EXPECT_LE(max_abs_diff(via_factory.forward(ids), want), kTolerance);
  // Another start method cannot carry the model: the error says what to do instead.
  try {
    tp::TensorParallel spawned(*gpt, {.world_size = 2, .start_method = tp::StartMethod::kSpawn});
    ADD_FAILURE() << "spawn took an in-memory model";
  } catch (const tp::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("save_gpt_checkpoint"), std::string::npos) << e.what();
  }
}

TEST(TensorParallelEngine, Tp1AndTp2LogitsEqualTheModelInThisProcess) {
  auto& c = Checkpoint::get();
  const auto ids = random_ids(2, 11, 2);
  const at::Tensor want = c.logits(ids);
  tp::TensorParallel one(c.path(), tp_options(1));
  auto spawned = tp_options(2);
  spawned.start_method.reset();  // the default: spawn
  tp::TensorParallel two(c.path(), spawned);
  EXPECT_EQ(one.world_size(), 1);
  EXPECT_EQ(two.world_size(), 2);
  const auto l1 = one.forward(ids);
  const auto l2 = two.forward(ids);
  ASSERT_EQ(l1.sizes().vec(), Shape({2, 11, 97}));
  ASSERT_EQ(l2.sizes().vec(), Shape({2, 11, 97}));
  EXPECT_EQ(l2.scalar_type(), at::kFloat);
  std::printf("TP=1 vs model %.3g, TP=2 vs model %.3g, TP=1 vs TP=2 %.3g\n", max_abs_diff(l1, want),
              max_abs_diff(l2, want), max_abs_diff(l1, l2));
  EXPECT_LE(max_abs_diff(l1, want), kTolerance);
  EXPECT_LE(max_abs_diff(l2, want), kTolerance);
  EXPECT_LE(max_abs_diff(l1, l2), kTolerance);
  // Calls go on: a second forward of another shape.
  const auto ids2 = random_ids(1, 5, 3);
  EXPECT_LE(max_abs_diff(two.forward(ids2), one.forward(ids2)), kTolerance);
  EXPECT_TRUE(two.is_alive());
}

TEST(TensorParallelEngine, GreedyGenerateEqualsTheReferenceAtTp1AndTp2) {
  auto& c = Checkpoint::get();
  const auto prompt = random_ids(2, 7, 4);
  const int64_t n = 24;
  const auto want = reference_greedy(*c.model(), prompt, n);
  for (int world : {1, 2}) {
    tp::TensorParallel engine(c.path(), tp_options(world));
    const auto t0 = Clock::now();
    const auto got = engine.generate(prompt, {.max_new_tokens = n, .greedy = true});
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    std::printf("TP=%d: %lld new tokens x 2 rows in %.3f s, %.0f tokens/s\n", world,
                static_cast<long long>(n), s, 2.0 * static_cast<double>(n) / s);
    ASSERT_EQ(got.sizes().vec(), Shape({2, 7 + n}));
    EXPECT_EQ(got.scalar_type(), at::kLong);
    EXPECT_TRUE(at::equal(got, want)) << "TP=" << world << "\n" << got << "\n" << want;
    // temperature 0 is greedy too; no new tokens gives the prompt back
    EXPECT_TRUE(at::equal(engine.generate(prompt, {.max_new_tokens = n, .temperature = 0}), want));
    EXPECT_TRUE(at::equal(engine.generate(prompt, {.max_new_tokens = 0}), prompt));
  }
}

TEST(TensorParallelEngine, ATinyTemperatureSamplesTheLikeliestToken) {
  // logits / 1e-300 overflow to inf and the softmax to NaN, which multinomial refused in every
  // worker (the engine broke); the largest logit is now subtracted first: greedy in effect.
  auto& c = Checkpoint::get();
  tp::TensorParallel engine(c.path(), tp_options(2));
  const auto prompt = random_ids(2, 5, 9);
  const at::Tensor greedy = engine.generate(prompt, {.max_new_tokens = 12, .greedy = true});
  for (const double t : {1e-300, 1e-30, 4.9e-324}) {
    SCOPED_TRACE(t);
    EXPECT_TRUE(
        at::equal(engine.generate(prompt, {.max_new_tokens = 12, .temperature = t}), greedy));
  }
  EXPECT_TRUE(engine.is_alive());
}

TEST(TensorParallelEngine, SeededSamplingRepeatsAndAgreesAcrossWorldSizes) {
  auto& c = Checkpoint::get();
  const auto prompt = random_ids(3, 4, 5);
  const tp::GenerateOptions sampled{
      .max_new_tokens = 20, .temperature = 0.8, .top_k = 10, .seed = 7};
  auto o2 = tp_options(2);
  o2.seed = 1234;
  tp::TensorParallel two(c.path(), o2);
  EXPECT_EQ(two.seed(), 1234u);
  const auto a = two.generate(prompt, sampled);
  const auto b = two.generate(prompt, sampled);
  EXPECT_TRUE(at::equal(a, b)) << "the same seed gave other tokens";
  EXPECT_TRUE(at::equal(a.narrow(1, 0, 4), prompt));
  EXPECT_TRUE(((a >= 0) & (a < 97)).all().item<bool>());
  // Without a per-call seed the engine's generator goes on: the next draws differ (20 tokens x 3
  // rows among the top 10 agreeing by chance is not a worry).
  const auto c1 = two.generate(prompt, {.max_new_tokens = 20, .temperature = 0.8, .top_k = 10});
  const auto c2 = two.generate(prompt, {.max_new_tokens = 20, .temperature = 0.8, .top_k = 10});
  EXPECT_FALSE(at::equal(c1, c2));
  // top_k = 1 samples the likeliest token: greedy.
  EXPECT_TRUE(at::equal(two.generate(prompt, {.max_new_tokens = 12, .top_k = 1, .seed = 3}),
                        two.generate(prompt, {.max_new_tokens = 12, .greedy = true})));
  // Rank 0 samples from the same generator state at TP = 1 (logits equal to ~1e-7).
  tp::TensorParallel one(c.path(), tp_options(1));
  EXPECT_TRUE(at::equal(one.generate(prompt, sampled), a));
}

// Rank 0 draws with the library's sampler (sample_next_token): a seeded generate at TP = 1 is
// the loop over the model in this process with a generator of the same seed. (The worker's
// own copy masked the vocabulary instead and drew other tokens for the same seed.)
TEST(TensorParallelEngine, SeededSamplingDrawsWithSampleNextToken) {
  auto& c = Checkpoint::get();
  const auto prompt = random_ids(2, 4, 6);
  const tp::SamplingOptions how{.temperature = 0.8, .top_k = 10};
  at::Tensor want = prompt;
  {
    at::NoGradGuard no_grad;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
    tp::GptKvCache cache;
    at::Tensor logits = c.model()->forward(prompt, &cache);
    for (int i = 0; i < 16; ++i) {
      const at::Tensor next = tp::sample_next_token(logits.select(1, -1), how, gen);
      want = at::cat({want, next}, 1);
      logits = c.model()->forward(next, &cache);
    }
  }
  tp::TensorParallel one(c.path(), tp_options(1));
  const at::Tensor got = one.generate(
      prompt,
      {.max_new_tokens = 16, .temperature = how.temperature, .top_k = how.top_k, .seed = 7});
  EXPECT_TRUE(at::equal(got, want)) << got << "\n" << want;
}

TEST(TensorParallelEngine, Bfloat16WeightsAtTp2) {
  auto& c = Checkpoint::get();
  const auto ids = random_ids(2, 9, 6);
  const at::Tensor want = c.logits(ids);
  auto o = tp_options(2);
  o.dtype = at::kBFloat16;
  tp::TensorParallel engine(c.path(), o);
  const auto logits = engine.forward(ids);
  ASSERT_EQ(logits.scalar_type(), at::kBFloat16);
  const double err = max_abs_diff(logits, want);
  const double bound = 0.02 + 0.02 * want.abs().max().item<double>();
  std::printf("bfloat16 TP=2: max abs error vs float32 %.3g (bound %.3g)\n", err, bound);
  EXPECT_LE(err, bound);
  const auto out = engine.generate(ids, {.max_new_tokens = 5, .greedy = true});
  EXPECT_EQ(out.sizes().vec(), Shape({2, 14}));
}

TEST(TensorParallelEngine, Float16IsRefusedNamingTheOpWhereTheCpuLacksIt) {
  auto o = tp_options(2);
  o.dtype = at::kHalf;
  try {
    tp::TensorParallel engine(Checkpoint::get().path(), o);
    // A LibTorch with float16 CPU kernels: then it must work.
    EXPECT_EQ(engine.forward(random_ids(1, 3, 7)).scalar_type(), at::kHalf);
  } catch (const tp::ValueError& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(has(msg, "float16") && (has(msg, "linear") || has(msg, "layer_norm") ||
                                        has(msg, "softmax") || has(msg, "gelu")))
        << msg;
  }
}

TEST(TensorParallelEngine, ArgumentErrorsLeaveTheEngineUsable) {
  auto& c = Checkpoint::get();
  tp::TensorParallel engine(c.path(), tp_options(2));
  const auto ids = random_ids(1, 4, 8);
  auto value_error = [](auto fn) {
    try {
      fn();
    } catch (const tp::ValueError& e) {
      return std::string(e.what());
    }
    return std::string("(no ValueError)");
  };
  EXPECT_TRUE(has(value_error([&] {
                    engine.forward(at::full({1, 3}, 97, at::kLong));
                  }),
                  "outside the vocabulary"));
  EXPECT_TRUE(has(value_error([&] { engine.forward(at::zeros({1, 97}, at::kLong)); }), "96"));
  EXPECT_TRUE(has(value_error([&] { engine.generate(ids, {.max_new_tokens = 93}); }), "93 new"));
  EXPECT_THROW(engine.forward(ids.to(at::kInt)), tp::ValueError);
  EXPECT_THROW(engine.forward(at::zeros({4}, at::kLong)), tp::ValueError);
  EXPECT_THROW(engine.forward(at::Tensor()), tp::ValueError);
  EXPECT_THROW(engine.generate(ids, {.max_new_tokens = -1}), tp::ValueError);
  EXPECT_THROW(engine.generate(ids, {.temperature = -1}), tp::ValueError);
  EXPECT_THROW(engine.generate(ids, {.top_k = -2}), tp::ValueError);
  EXPECT_THROW(engine.forward(ids, {.timeout = 0s}), tp::ValueError);
  // Timeouts that are NaN, infinite or would overflow a deadline (now + 1e10 s wraps
  // steady_clock) are refused, not turned into an immediate TimeoutError that breaks the engine.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (const double s : {nan, inf, 1e10}) {
    SCOPED_TRACE(s);
    EXPECT_TRUE(has(
        value_error([&] { engine.forward(ids, {.timeout = std::chrono::duration<double>(s)}); }),
        "finite"));
    EXPECT_TRUE(has(
        value_error([&] { engine.generate(ids, {.timeout = std::chrono::duration<double>(s)}); }),
        "finite"));
    auto bad = tp_options(1);
    bad.timeout = std::chrono::duration<double>(s);
    EXPECT_TRUE(has(value_error([&] { tp::TensorParallel(c.path(), bad); }), "finite"));
  }
  EXPECT_THROW(engine.generate(ids, {.temperature = nan}), tp::ValueError);
  EXPECT_THROW(engine.generate(ids, {.temperature = inf}), tp::ValueError);
  EXPECT_TRUE(engine.is_alive());
  EXPECT_EQ(engine.forward(ids, {.timeout = 1e7s}).sizes().vec(), Shape({1, 4, 97}));
  EXPECT_EQ(engine.forward(ids).sizes().vec(), Shape({1, 4, 97}));
  // Sizes that do not split are refused before any worker starts (6 heads... here 4 heads, 3
  // ranks).
  EXPECT_THROW(tp::TensorParallel(c.path(), tp_options(3)), tp::ValueError);
  EXPECT_THROW(tp::TensorParallel(c.path(), tp_options(0)), tp::ValueError);
}

// ---- faults -----------------------------------------------------------------------------------

/// Every worker of `pids` is gone (killed and reaped by the engine).
void expect_no_worker(const std::vector<int>& pids) {
  for (size_t r = 0; r < pids.size(); ++r) {
    EXPECT_GT(pids[r], 0);
    EXPECT_TRUE(pid_gone(pids[r])) << "rank " << r << " (pid " << pids[r] << ") is still there";
  }
}

TEST(TensorParallelFaults, AWorkerThatThrowsFailsTheCallNamingItsRank) {
  tp::TensorParallel engine(faulty("throw13"), tp_options(2));
  const auto pids = engine.pids();
  const auto ok = random_ids(1, 6, 9).clamp_max(12);
  EXPECT_EQ(engine.forward(ok).sizes().vec(), Shape({1, 6, 97}));
  const auto t0 = Clock::now();
  std::string first;
  try {
    engine.forward(at::full({1, 3}, 13, at::kLong));
    ADD_FAILURE() << "no error";
  } catch (const tp::WorkerError& e) {
    first = e.what();
    EXPECT_EQ(e.rank(), 1) << first;
    EXPECT_EQ(e.pid(), pids[1]);
    EXPECT_TRUE(has(e.type(), "ValueError")) << e.type();
    EXPECT_TRUE(has(e.message(), "rank 1 refuses token 13")) << e.message();
    EXPECT_FALSE(e.exit_code().has_value());
    EXPECT_TRUE(has(first, "TensorParallel.forward") && has(first, "rank 1")) << first;
  }
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf("the worker's exception reached the caller in %.3f s\n", s);
  EXPECT_LT(s, 10.0);
  EXPECT_FALSE(engine.is_alive());
  expect_no_worker(pids);
  // Broken: every later call raises the first error at once.
  try {
    engine.generate(ok, {.max_new_tokens = 2});
    ADD_FAILURE() << "a broken engine answered";
  } catch (const tp::WorkerError& e) {
    EXPECT_EQ(std::string(e.what()), first);
  }
  engine.shutdown();
  engine.shutdown();
  EXPECT_THROW(engine.forward(ok), tp::ClosedError);
}

TEST(TensorParallelFaults, AWorkerKilledMidGenerateFailsTheCallNamingRankAndSignal) {
  tp::TensorParallel engine(faulty("slow"), tp_options(2));
  const auto pids = engine.pids();
  // 60 tokens at >= 20 ms a forward: over a second; rank 1 dies 0.5 s in.
  std::thread killer([pid = pids[1]] {
    std::this_thread::sleep_for(500ms);
    ::kill(pid, SIGKILL);
  });
  const auto t0 = Clock::now();
  try {
    engine.generate(random_ids(1, 4, 10), {.max_new_tokens = 60, .greedy = true});
    ADD_FAILURE() << "generate survived the death of rank 1";
  } catch (const tp::WorkerError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.rank(), 1) << msg;
    EXPECT_EQ(e.exit_code(), -SIGKILL) << msg;
    EXPECT_EQ(e.signal_name(), "SIGKILL");
    EXPECT_TRUE(has(msg, "rank 1") && has(msg, "SIGKILL") && has(msg, "generate")) << msg;
  }
  killer.join();
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf("SIGKILL of rank 1 mid-generate: the call failed after %.3f s (timeout %.0f s)\n", s,
              std::chrono::duration<double>(kTimeout).count());
  EXPECT_GE(s, 0.5);  // it was running when rank 1 died
  EXPECT_LT(s, 10.0);
  expect_no_worker(pids);
}

TEST(TensorParallelFaults, AWorkerKilledWhileIdleFailsTheNextCall) {
  tp::TensorParallel engine(Checkpoint::get().path(), tp_options(2));
  const auto pids = engine.pids();
  ASSERT_EQ(::kill(pids[0], SIGKILL), 0);
  try {
    engine.forward(random_ids(1, 3, 11));
    ADD_FAILURE() << "no error";
  } catch (const tp::WorkerError& e) {
    EXPECT_EQ(e.rank(), 0) << e.what();
    EXPECT_EQ(e.signal_name(), "SIGKILL") << e.what();
  }
  expect_no_worker(pids);
}

TEST(TensorParallelFaults, AWorkerThatCannotStartFailsTheConstructor) {
  // The forkserver (started on first use, it lives as long as this process) is no worker: it
  // runs before `before` is taken, also when this case runs alone.
  tp::Process warm(tp::ProcessOptions{.start_method = tp::StartMethod::kForkserver}, noop);
  warm.start();
  ASSERT_TRUE(warm.join(kTimeout));
  const auto before = children();
  auto config = kConfig;
  config.n_layer = 3;  // the file has 2 blocks: h.2.* is missing
  try {
    tp::TensorParallel engine(Checkpoint::get().path(), config, tp_options(2));
    ADD_FAILURE() << "a model the file does not hold was built";
  } catch (const tp::WorkerError& e) {
    EXPECT_TRUE(has(e.what(), "starting") && has(e.message(), "h.2.")) << e.what();
  }
  // The unregistered name is refused in this process already.
  EXPECT_THROW(tp::TensorParallel(tp::TensorParallelModelName{.name = "no such model"}),
               tp::ValueError);
  const auto after = children();
  for (int pid : after) {
    std::ifstream comm("/proc/" + std::to_string(pid) + "/cmdline");
    std::string name;
    std::getline(comm, name, '\0');
    EXPECT_TRUE(before.contains(pid)) << "a worker is left: pid " << pid << " (" << name << ")";
  }
}

// ---- memory -------------------------------------------------------------------------------------

/// A field of /proc/<pid>/status in MiB ("RssAnon", "VmHWM"); -1 when unreadable.
double status_mib(int pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);)
    if (line.starts_with(field + ":")) return std::stod(line.substr(field.size() + 1)) / 1024.0;
  return -1;
}

// A worker that answered holds its model, not its last request's peak: glibc kept freed
// activations in its arenas (its mmap threshold rises to the largest block freed), so each
// rank's private memory stayed at the largest request it had served. Wide generates (batch 256,
// 64 prompt tokens: the prompt's logits, the KV cache and the activations come to tens of MiB)
// peak 70-130 MiB above the idle figure; after each reply every worker's RssAnon is back within
// a few MiB of it (measured: TP = 2 +0.4 MiB, TP = 1 +8.3 MiB, the same after every request;
// without the trim +6 to +56 MiB, different after each).
TEST(TensorParallelMemory, AnsweredWorkersGiveBackTheirRequestsPeak) {
  auto& c = Checkpoint::get();
  for (int world : {1, 2}) {
    tp::TensorParallel engine(c.path(), tp_options(world));
    const auto pids = engine.pids();
    ASSERT_EQ(pids.size(), static_cast<size_t>(world));
    engine.generate(random_ids(1, 4, 16), {.max_new_tokens = 2, .greedy = true});
    std::vector<double> idle;
    for (int pid : pids) idle.push_back(status_mib(pid, "RssAnon"));
    const auto wide = random_ids(256, 64, 17);
    for (int round = 0; round < 2; ++round) {
      const auto out = engine.generate(wide, {.max_new_tokens = 16, .greedy = true});
      ASSERT_EQ(out.sizes().vec(), Shape({256, 80}));
      for (size_t r = 0; r < pids.size(); ++r) {
        const double anon = status_mib(pids[r], "RssAnon");
        std::printf(
            "TP=%d rank %zu round %d: RssAnon idle %.1f MiB, now %.1f MiB; VmHWM %.1f "
            "MiB, VmRSS %.1f MiB, threads %.0f\n",
            world, r, round, idle[r], anon, status_mib(pids[r], "VmHWM"),
            status_mib(pids[r], "VmRSS"), status_mib(pids[r], "Threads") * 1024);
        ASSERT_GT(idle[r], 0) << "no RssAnon for pid " << pids[r];
        EXPECT_LE(anon, idle[r] + 12)
            << "TP=" << world << " rank " << r << " kept its request's memory";
      }
    }
    // The requests did peak: the worker gave back what was there.
    EXPECT_GE(status_mib(pids[0], "VmHWM") - status_mib(pids[0], "VmRSS"), 20)
        << "TP=" << world << ": the wide generate did not peak";
  }
}

// Continuous batching (serve): the step that lets the last sequences leave gives the batch's
// memory back (its KV cache tensors, sized for the widest batch so far, and the freed
// activations); the steps in between keep theirs (they come too often to trim).
TEST(TensorParallelMemory, TheStepThatEmptiesTheBatchGivesItsMemoryBack) {
  auto& c = Checkpoint::get();
  tp::TensorParallel engine(c.path(), tp_options(2));
  const auto pids = engine.pids();
  engine.generate(random_ids(1, 4, 18), {.max_new_tokens = 2, .greedy = true});
  std::vector<double> idle;
  for (int pid : pids) idle.push_back(status_mib(pid, "RssAnon"));
  const auto prompts = random_ids(256, 64, 19);
  std::vector<tp::StepJoin> join;
  std::vector<int64_t> leave;
  for (int64_t i = 0; i < 256; ++i) {
    join.push_back({.id = i, .prompt_ids = prompts[i], .greedy = true});
    leave.push_back(i);
  }
  ASSERT_EQ(engine.step(join, {}).ids.size(), 256u);
  for (int i = 0; i < 4; ++i) ASSERT_EQ(engine.step({}, {}).ids.size(), 256u);
  double running = 0;
  for (int pid : pids) running = std::max(running, status_mib(pid, "RssAnon"));
  EXPECT_TRUE(engine.step({}, leave).ids.empty());
  for (size_t r = 0; r < pids.size(); ++r) {
    const double anon = status_mib(pids[r], "RssAnon");
    std::printf(
        "rank %zu: RssAnon idle %.1f MiB, running 256 (largest rank) %.1f MiB, after the "
        "last leave %.1f MiB\n",
        r, idle[r], running, anon);
    EXPECT_LE(anon, idle[r] + 4) << "rank " << r << " kept the batch's memory";
  }
  // Measured: +13 to +47 MiB while running, +0.1 after the last leave (without: +24 to +28).
  EXPECT_GE(running - idle[0], 8) << "the batch did not grow the workers";
  // The engine goes on: a new batch after the empty one.
  EXPECT_EQ(engine.step({join[0]}, {}).ids.size(), 1u);
}

// ---- lifetime -----------------------------------------------------------------------------------

TEST(TensorParallelLifetime, ShutdownTwiceThenClosed) {
  tp::TensorParallel engine(Checkpoint::get().path(), tp_options(2));
  const auto pids = engine.pids();
  const auto t0 = Clock::now();
  engine.shutdown();
  engine.shutdown(0s);
  std::printf("shutdown took %.3f s\n", std::chrono::duration<double>(Clock::now() - t0).count());
  expect_no_worker(pids);
  EXPECT_FALSE(engine.is_alive());
  EXPECT_THROW(engine.forward(random_ids(1, 2, 12)), tp::ClosedError);
}

TEST(TensorParallelLifetime, TheDestructorLeavesNoWorker) {
  std::vector<int> pids;
  {
    tp::TensorParallel engine(Checkpoint::get().path(), tp_options(2));
    pids = engine.pids();
    EXPECT_EQ(engine.forward(random_ids(1, 2, 13)).size(2), 97);
  }
  expect_no_worker(pids);
  // Moved-from engines are fine to destroy; the moved-to one owns the workers.
  {
    tp::TensorParallel a(Checkpoint::get().path(), tp_options(1));
    tp::TensorParallel b(std::move(a));
    pids = b.pids();
    EXPECT_EQ(b.forward(random_ids(1, 2, 14)).size(2), 97);
  }
  expect_no_worker(pids);
}

TEST(TensorParallelLifetime, AStdFunctionFactoryRunsWithFork) {
  auto& c = Checkpoint::get();
  const std::string path = c.path();
  tp::TensorParallelFactory factory = [path](const tp::TensorParallelContext& ctx) {
    return std::make_shared<FaultyGpt>(ctx, "plain", path);
  };
  auto o = tp_options(2);
  o.start_method = tp::StartMethod::kSpawn;
  EXPECT_THROW(tp::TensorParallel(factory, o), tp::ValueError);  // cannot cross exec
  o.start_method.reset();
  tp::TensorParallel engine(factory, o);  // fork by default
  const auto ids = random_ids(2, 5, 15);
  const at::Tensor want = c.logits(ids);
  EXPECT_LE(max_abs_diff(engine.forward(ids), want), kTolerance);
}

}  // namespace

int main(int argc, char** argv) {
  tp::init(argc, argv);
  return torchpar::testing::run_tests(argc, argv);
}
