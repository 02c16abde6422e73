// Continuous batching: GptBatchCache (Gpt::prefill_rows / decode_rows against a whole forward per
// sequence) and TensorParallel::step (sequences joining and leaving between steps give the
// tokens generate gives each alone, at TP = 1 and 2, for a Gpt and for a custom model with and
// without a cache; argument errors leave the batch as it was; a worker killed between steps
// fails the next one naming its rank).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "support/run_tests.h"
#include "torchpar/parallel/gpt.h"
#include "torchpar/parallel/gpt_checkpoint.h"
#include "torchpar/parallel/state_dict.h"
#include "torchpar/parallel/tensor_parallel.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using namespace std::chrono_literals;

namespace {

const tp::GptConfig kConfig{
    .vocab_size = 97, .n_positions = 40, .n_embd = 32, .n_layer = 2, .n_head = 4};

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

at::Tensor random_ids(int64_t tokens, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(kConfig.vocab_size, {1, tokens}, gen, at::TensorOptions(at::kLong));
}

/// A seeded Gpt of kConfig, saved once in a temporary directory.
class Checkpoint {
 public:
  static Checkpoint& get() {
    static Checkpoint c;
    return c;
  }
  const std::string& path() const { return path_; }
  tp::Gpt& model() { return model_; }
  ~Checkpoint() {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

 private:
  Checkpoint() : model_(nullptr) {
    std::string tmpl = (std::filesystem::temp_directory_path() / "torchpar_cb_XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    dir_ = tmpl;
    path_ = dir_ + "/model.pt";
    at::manual_seed(3);
    model_ = tp::Gpt(kConfig);
    model_->eval();
    tp::save_gpt_checkpoint(*model_, path_);
  }
  std::string dir_;
  std::string path_;
  tp::Gpt model_;
};

/// The checkpoint's Gpt behind the generic TensorParallelModel interface (not a
/// GptTensorParallelModel: step then keeps one cache per sequence, or none).
class Wrapped final : public tp::TensorParallelModel {
 public:
  Wrapped(const tp::TensorParallelContext& ctx, bool cached)
      : gpt_(tp::load_gpt(kConfig, tp::load_state_dict_file(Checkpoint::get().path()),
                          {.comm = ctx.comm})),
        cached_(cached) {}
  at::Tensor forward(const at::Tensor& ids, tp::GptKvCache* cache) override {
    return gpt_->forward(ids, cached_ ? cache : nullptr);
  }
  bool uses_cache() const override { return cached_; }

 private:
  tp::Gpt gpt_;
  bool cached_;
};

tp::TensorParallelOptions options(int world) {
  return {.world_size = world, .start_method = tp::StartMethod::kFork, .timeout = 60s};
}

/// What generate gives `prompt` alone: its new tokens.
std::vector<int64_t> alone(tp::TensorParallel& engine, const at::Tensor& prompt, int64_t n,
                           const tp::StepJoin& how) {
  const at::Tensor out = engine.generate(prompt, {.max_new_tokens = n,
                                                  .temperature = how.temperature,
                                                  .top_k = how.top_k,
                                                  .greedy = how.greedy,
                                                  .seed = how.seed});
  const at::Tensor fresh = out.narrow(1, prompt.size(1), n).contiguous();
  return {fresh.data_ptr<int64_t>(), fresh.data_ptr<int64_t>() + n};
}

/// Runs a schedule of joins and leaves: sequence i joins at step start[i] and leaves after
/// want[i] tokens. Returns every sequence's tokens.
std::map<int64_t, std::vector<int64_t>> run_schedule(tp::TensorParallel& engine,
                                                     const std::vector<tp::StepJoin>& seqs,
                                                     const std::vector<int>& start,
                                                     const std::vector<int64_t>& want) {
  std::map<int64_t, std::vector<int64_t>> got;
  std::vector<int64_t> leave;
  size_t done = 0;
  for (int step = 0; done < seqs.size(); ++step) {
    std::vector<tp::StepJoin> join;
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (start[i] == step) join.push_back(seqs[i]);
    }
    const tp::StepResult r = engine.step(join, leave);
    leave.clear();
    EXPECT_EQ(r.ids.size(), r.tokens.size());
    for (size_t k = 0; k < r.ids.size(); ++k) {
      auto& tokens = got[r.ids[k]];
      tokens.push_back(r.tokens[k]);
      const auto i = static_cast<size_t>(r.ids[k]);
      if (static_cast<int64_t>(tokens.size()) == want[i]) {
        leave.push_back(r.ids[k]);
        ++done;
      }
    }
    if (step > 200) {
      ADD_FAILURE() << "the schedule did not end";
      break;
    }
  }
  engine.step({}, leave);  // the last ones leave
  EXPECT_TRUE(engine.running().empty());
  return got;
}

// ---- GptBatchCache ------------------------------------------------------------------------------

TEST(GptBatchCache, DecodeRowsEqualsAWholeForwardPerSequence) {
  auto& gpt = *Checkpoint::get().model();
  at::NoGradGuard no_grad;
  tp::GptBatchCache cache;
  std::vector<at::Tensor> seqs = {random_ids(5, 1), random_ids(9, 2), random_ids(2, 3)};
  for (const auto& s : seqs) {
    const at::Tensor last = gpt.prefill_rows(s, cache);
    EXPECT_LE(max_abs_diff(last, gpt.forward(s).select(1, -1)), 1e-5);
  }
  {  // two prompts of one length in one forward: two rows, each its own sequence's
    tp::GptBatchCache two;
    const at::Tensor both = at::cat({seqs[0], random_ids(5, 9)}, 0);
    const at::Tensor last = gpt.prefill_rows(both, two);
    EXPECT_EQ(two.lengths, (std::vector<int64_t>{5, 5}));
    EXPECT_LE(max_abs_diff(last, gpt.forward(both).select(1, -1)), 1e-5);
    const at::Tensor next = gpt.decode_rows(at::tensor({3L, 4L}, at::kLong), two);
    EXPECT_LE(max_abs_diff(
                  next[1],
                  gpt.forward(at::cat({both.narrow(0, 1, 1), at::full({1, 1}, 4L, at::kLong)}, 1))
                      .select(1, -1)[0]),
              1e-5);
  }
  ASSERT_EQ(cache.rows(), 3);
  EXPECT_EQ(cache.lengths, (std::vector<int64_t>{5, 9, 2}));
  for (int step = 0; step < 12; ++step) {
    if (step == 4) {  // the middle sequence leaves, a new one joins: the rest go on as they were
      cache.remove_row(1);
      seqs.erase(seqs.begin() + 1);
      seqs.push_back(random_ids(3, 4));
      (void)gpt.prefill_rows(seqs.back(), cache);
    }
    std::vector<int64_t> next;
    for (const auto& s : seqs) next.push_back((s.select(1, -1).item<int64_t>() * 7 + step) % 97);
    const at::Tensor logits = gpt.decode_rows(at::tensor(next, at::kLong), cache);
    ASSERT_EQ(logits.sizes().vec(), (std::vector<int64_t>{3, kConfig.vocab_size}));
    for (size_t i = 0; i < seqs.size(); ++i) {
      seqs[i] = at::cat({seqs[i], at::full({1, 1}, next[i], at::kLong)}, 1);
      const double diff =
          max_abs_diff(logits[static_cast<int64_t>(i)], gpt.forward(seqs[i]).select(1, -1)[0]);
      EXPECT_LE(diff, 1e-5) << "step " << step << " row " << i;
      EXPECT_EQ(cache.lengths[i], seqs[i].size(1));
    }
  }
  // Full context: the row that holds n_positions cannot take another position.
  tp::GptBatchCache full;
  (void)gpt.prefill_rows(random_ids(kConfig.n_positions, 5), full);
  try {
    (void)gpt.decode_rows(at::tensor({1L}, at::kLong), full);
    ADD_FAILURE() << "decode_rows went past n_positions";
  } catch (const tp::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("n_positions"), std::string::npos) << e.what();
  }
  EXPECT_THROW(full.remove_row(1), tp::ValueError);
  EXPECT_THROW((void)gpt.decode_rows(at::tensor({1L, 2L}, at::kLong), full), tp::ValueError);
}

// ---- TensorParallel::step -----------------------------------------------------------------------

TEST(TensorParallelStep, JoinsAndLeavesGiveWhatGenerateGivesEachAlone) {
  std::vector<tp::StepJoin> seqs;
  for (int64_t i = 0; i < 5; ++i) {
    // Sequences 3 and 4 (joining together) have prompts of one length: one batched prefill.
    seqs.push_back(
        {.id = i, .prompt_ids = random_ids(3 + 2 * std::min<int64_t>(i, 3), 10 + i).view({-1})});
  }
  seqs[0].greedy = true;
  seqs[1].temperature = 0;  // greedy too
  seqs[2] = {.id = 2, .prompt_ids = seqs[2].prompt_ids, .temperature = 0.9, .top_k = 8, .seed = 11};
  seqs[3] = {.id = 3, .prompt_ids = seqs[3].prompt_ids, .temperature = 1.3, .seed = 12};
  seqs[4].greedy = true;
  const std::vector<int> start = {0, 0, 2, 5, 5};
  const std::vector<int64_t> want = {12, 4, 9, 7, 1};
  for (const int world : {1, 2}) {
    SCOPED_TRACE(world);
    tp::TensorParallel engine(Checkpoint::get().path(), options(world));
    const auto got = run_schedule(engine, seqs, start, want);
    ASSERT_EQ(got.size(), seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) {
      const auto expected = alone(engine, seqs[i].prompt_ids.view({1, -1}), want[i], seqs[i]);
      EXPECT_EQ(got.at(static_cast<int64_t>(i)), expected) << "sequence " << i;
    }
    // The engine goes on after a schedule: a second one on the same batch state.
    EXPECT_EQ(run_schedule(engine, {seqs[0]}, {0}, {3}).at(0),
              alone(engine, seqs[0].prompt_ids.view({1, -1}), 3, seqs[0]));
  }
}

TEST(TensorParallelStep, ACustomModelWithAndWithoutACacheGivesTheSameTokens) {
  static const bool registered = [] {
    tp::register_tensor_parallel_model("cb_cached", [](const tp::TensorParallelContext& ctx) {
      return std::make_shared<Wrapped>(ctx, true);
    });
    tp::register_tensor_parallel_model("cb_uncached", [](const tp::TensorParallelContext& ctx) {
      return std::make_shared<Wrapped>(ctx, false);
    });
    return true;
  }();
  ASSERT_TRUE(registered);
  std::vector<tp::StepJoin> seqs;
  for (int64_t i = 0; i < 3; ++i) {
    seqs.push_back({.id = i, .prompt_ids = random_ids(4 + i, 20 + i), .greedy = true});
  }
  const std::vector<int> start = {0, 1, 1};
  const std::vector<int64_t> want = {6, 3, 5};
  tp::TensorParallel gpt_engine(Checkpoint::get().path(), options(2));
  const auto reference = run_schedule(gpt_engine, seqs, start, want);
  for (const char* name : {"cb_cached", "cb_uncached"}) {
    SCOPED_TRACE(name);
    tp::TensorParallel engine(tp::TensorParallelModelName{.name = name}, options(2));
    EXPECT_EQ(run_schedule(engine, seqs, start, want), reference);
  }
}

TEST(TensorParallelStep, ArgumentErrorsLeaveTheBatchAsItWas) {
  tp::TensorParallel engine(Checkpoint::get().path(), options(2));
  const auto prompt = random_ids(kConfig.n_positions - 2, 30);
  const auto first = engine.step({{.id = 1, .prompt_ids = prompt, .greedy = true}}, {});
  ASSERT_EQ(first.ids, (std::vector<int64_t>{1}));
  const auto expect_refused = [&](const std::vector<tp::StepJoin>& join,
                                  const std::vector<int64_t>& leave, const std::string& says) {
    try {
      (void)engine.step(join, leave);
      ADD_FAILURE() << "accepted; expected an error saying " << says;
    } catch (const tp::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  expect_refused({}, {7}, "not running");
  expect_refused({}, {1, 1}, "named twice");
  expect_refused({{.id = 1, .prompt_ids = prompt}}, {}, "already running");
  expect_refused({{.id = 2, .prompt_ids = prompt}, {.id = 2, .prompt_ids = prompt}}, {}, "joining");
  expect_refused({{.id = 3, .prompt_ids = random_ids(kConfig.n_positions + 1, 1)}}, {},
                 "n_positions");
  expect_refused({{.id = 3, .prompt_ids = at::full({1, 2}, 500L, at::kLong)}}, {}, "vocabulary");
  expect_refused({{.id = 3, .prompt_ids = prompt, .temperature = -1}}, {}, "temperature");
  // Nothing above reached the workers: the sequence goes on to the end of the context.
  EXPECT_EQ(engine.step({}, {}).ids, (std::vector<int64_t>{1}));  // position n_positions - 2
  EXPECT_EQ(engine.step({}, {}).ids, (std::vector<int64_t>{1}));  // n_positions - 1: full
  expect_refused({}, {}, "n_positions");
  EXPECT_EQ(engine.running(), (std::vector<std::pair<int64_t, int64_t>>{{1, kConfig.n_positions}}));
  EXPECT_TRUE(engine.step({}, {1}).ids.empty());
  EXPECT_TRUE(engine.running().empty());
  EXPECT_TRUE(engine.step({}, {}).ids.empty());  // nothing to do: no call
  EXPECT_TRUE(engine.is_alive());
}

TEST(TensorParallelStep, AWorkerKilledBetweenStepsFailsTheNextNamingItsRank) {
  tp::TensorParallel engine(Checkpoint::get().path(), options(2));
  (void)engine.step({{.id = 1, .prompt_ids = random_ids(4, 40), .greedy = true}}, {});
  const int victim = engine.pids().at(1);
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    (void)engine.step({}, {});
    ADD_FAILURE() << "a step with a dead worker returned";
  } catch (const tp::WorkerError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  EXPECT_FALSE(engine.is_alive());
  EXPECT_THROW((void)engine.step({}, {}), tp::WorkerError);
}

}  // namespace

int main(int argc, char** argv) {
  tp::init(argc, argv);
  return torchpar::testing::run_tests(argc, argv);
}
