// Tensor parallelism. Slicing (column, row, fused q|k|v, Conv1D-transposed) against unsliced
// matmuls for worlds of 2 and 4 simulated in one process; ColumnParallelLinear and
// RowParallelLinear with ranks as threads; policies, custom ones and their errors. Then torchpar's
// Gpt against an outside reference, a plain torch.nn GPT-2 in Python (gpt_reference.py, run here by
// /usr/bin/python3 into a temporary directory): logits at TP = 1 and at TP = 2 across 2 processes
// (shm and gloo groups), KV-cache decoding, bfloat16 weights, an nn.Linear-layout checkpoint
// under a custom policy, refused state dicts; and a GPT-2-small-shaped model.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "support/ranks.h"
#include "support/run_tests.h"
#include "torchpar/parallel/gpt.h"
#include "torchpar/parallel/state_dict.h"
#include "torchpar/parallel/tensor_parallel_layers.h"
#include "torchpar/parallel/tensor_parallel_policy.h"
#include "torchpar/torchpar.h"

// tests/CMakeLists.txt defines it as the script's absolute path; the fallback (relative to the
// source tree) only serves syntax checks of this file outside CMake.
#ifndef TORCHPAR_GPT_REFERENCE_PY
#define TORCHPAR_GPT_REFERENCE_PY "tests/parallel/gpt_reference.py"
#endif

namespace tp = torchpar;
using tp::testing::free_port;
using tp::testing::run_ranks;
using namespace std::chrono_literals;

namespace {

using Shape = std::vector<int64_t>;

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

template <class Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const tp::ValueError& e) {
    return e.what();
  }
  return "(no ValueError)";
}

bool has_all(const std::string& msg, std::initializer_list<const char*> parts) {
  for (const char* p : parts) {
    if (msg.find(p) == std::string::npos) return false;
  }
  return true;
}

// ---- slicing, every rank simulated in one process ---------------------------------------------

TEST(Slicing, ColumnSliceMatchesUnslicedMatmul) {
  at::manual_seed(1);
  for (int world : {2, 4}) {
    for (bool transposed : {false, true}) {
      for (int64_t in : {3, 16}) {
        for (int64_t per_rank : {1, 5}) {
          const int64_t out = world * per_rank;
          const auto w = at::randn({out, in}, at::kDouble);
          const auto b = at::randn({out}, at::kDouble);
          const auto x = at::randn({7, in}, at::kDouble);
          const at::Tensor stored = transposed ? w.t().contiguous() : w;
          std::vector<at::Tensor> outputs;
          for (int r = 0; r < world; ++r) {
            const auto wr = tp::column_slice(stored, r, world, {.transposed = transposed});
            const auto br = tp::column_slice(b, r, world);
            EXPECT_TRUE(wr.is_contiguous() && br.is_contiguous());
            EXPECT_FALSE(wr.is_alias_of(stored) || br.is_alias_of(b)) << "a view, not a clone";
            EXPECT_EQ(wr.sizes().vec(), transposed ? Shape({in, per_rank}) : Shape({per_rank, in}));
            outputs.push_back(at::matmul(x, transposed ? wr : wr.t()) + br);
          }
          EXPECT_LT(max_abs_diff(at::cat(outputs, 1), at::matmul(x, w.t()) + b), 1e-12)
              << "world " << world << " transposed " << transposed << " in " << in;
        }
      }
    }
  }
}

TEST(Slicing, RowSliceMatchesUnslicedMatmul) {
  at::manual_seed(2);
  for (int world : {2, 4}) {
    for (bool transposed : {false, true}) {
      for (int64_t per_rank : {1, 6}) {
        const int64_t in = world * per_rank;
        const int64_t out = 9;
        const auto w = at::randn({out, in}, at::kDouble);
        const auto b = at::randn({out}, at::kDouble);
        const auto x = at::randn({2, 5, in}, at::kDouble);
        const at::Tensor stored = transposed ? w.t().contiguous() : w;
        at::Tensor sum = at::zeros({2, 5, out}, at::kDouble);
        for (int r = 0; r < world; ++r) {
          const auto wr = tp::row_slice(stored, r, world, {.transposed = transposed});
          EXPECT_TRUE(wr.is_contiguous());
          EXPECT_FALSE(wr.is_alias_of(stored));
          EXPECT_EQ(wr.sizes().vec(), transposed ? Shape({per_rank, out}) : Shape({out, per_rank}));
          const auto xr = x.narrow(-1, r * per_rank, per_rank);
          sum += at::matmul(xr, transposed ? wr : wr.t());
        }
        // The bias once, after the sum (what RowParallelLinear does after its all_reduce).
        EXPECT_LT(max_abs_diff(sum + b, at::matmul(x, w.t()) + b), 1e-12)
            << "world " << world << " transposed " << transposed;
      }
    }
  }
}

TEST(Slicing, FusedQkvGivesEachRankItsOwnPartOfEach) {
  at::manual_seed(3);
  for (int world : {2, 4}) {
    for (bool transposed : {false, true}) {
      const int64_t c = 8;  // width of each of q, k, v; c / world per rank
      const int64_t piece = c / world;
      const int64_t in = 5;
      const auto w = at::randn({3 * c, in}, at::kDouble);  // [q; k; v] rows
      const auto b = at::randn({3 * c}, at::kDouble);
      const auto x = at::randn({4, in}, at::kDouble);
      const auto full = at::matmul(x, w.t()) + b;  // [4, 3c]: q | k | v
      std::vector<std::vector<at::Tensor>> outs(3);
      for (int r = 0; r < world; ++r) {
        const at::Tensor stored = transposed ? w.t().contiguous() : w;
        const auto wr =
            tp::column_slice(stored, r, world, {.n_fused = 3, .transposed = transposed});
        const auto br = tp::column_slice(b, r, world, {.n_fused = 3});
        std::vector<at::Tensor> want_rows, want_bias;
        for (int64_t f = 0; f < 3; ++f) {
          want_rows.push_back(w.narrow(0, f * c + r * piece, piece));
          want_bias.push_back(b.narrow(0, f * c + r * piece, piece));
        }
        const auto want = at::cat(want_rows, 0);
        EXPECT_TRUE(at::equal(transposed ? wr.t() : wr, want))
            << "world " << world << " rank " << r;
        EXPECT_TRUE(at::equal(br, at::cat(want_bias, 0)));
        const auto yr = at::matmul(x, transposed ? wr : wr.t()) + br;
        const auto parts = yr.split(piece, 1);  // this rank's q, k, v
        for (int f = 0; f < 3; ++f) outs[f].push_back(parts[f]);
      }
      for (int64_t f = 0; f < 3; ++f) {
        EXPECT_LT(max_abs_diff(at::cat(outs[f], 1), full.narrow(1, f * c, c)), 1e-12)
            << "part " << f << " world " << world << " transposed " << transposed;
      }
    }
  }
}

TEST(Slicing, RefusesWhatDoesNotSplit) {
  const auto msg = error_of([] {
    tp::column_slice(at::zeros({10, 3}), 0, 4, {.name = "fc.weight"});
  });
  EXPECT_TRUE(has_all(msg, {"'fc.weight'", "10", "4 ranks"})) << msg;
  const auto fused = error_of([] {
    tp::column_slice(at::zeros({3, 18}), 1, 4, {.n_fused = 3, .transposed = true});
  });
  EXPECT_TRUE(has_all(fused, {"18", "3 fused", "4 ranks"})) << fused;
  EXPECT_THROW(tp::row_slice(at::zeros({4, 6}), 0, 4), tp::ValueError);     // 6 columns, 4 ranks
  EXPECT_THROW(tp::column_slice(at::zeros({4, 4}), 2, 2), tp::ValueError);  // no rank 2
  EXPECT_THROW(tp::column_slice(at::zeros({4, 4}), 0, 0), tp::ValueError);
  EXPECT_THROW(tp::column_slice(at::zeros({4, 4}), 0, 2, {.n_fused = 0}), tp::ValueError);
  EXPECT_THROW(tp::column_slice(at::zeros({2, 4, 4}), 0, 2), tp::ValueError);
  EXPECT_THROW(tp::row_slice(at::zeros({4}), 0, 2), tp::ValueError);  // a bias is never row-sliced
  EXPECT_THROW(tp::column_slice(at::Tensor(), 0, 2), tp::ValueError);
}

// ---- the layers, ranks as threads ---------------------------------------------------------------

/// `n` ranks as threads of this process, meeting in a std::barrier: TensorParallelComm without a
/// group, so these tests look at the layers' arithmetic (the group's transport has its own
/// suite). Every rank sums the slots in rank order, so all get bit-identical results.
class ThreadWorld {
 public:
  explicit ThreadWorld(int n) : n_(n), slots_(static_cast<size_t>(n)), barrier_(n) {}

  tp::TensorParallelComm comm(int rank) {
    tp::TensorParallelComm c{.rank = rank, .world_size = n_};
    c.all_reduce_sum = [this, rank](at::Tensor& t) {
      slots_[static_cast<size_t>(rank)] = t.clone();
      barrier_.arrive_and_wait();
      at::Tensor sum = slots_[0].clone();
      for (size_t r = 1; r < slots_.size(); ++r) sum += slots_[r];
      barrier_.arrive_and_wait();  // nobody refills a slot before every rank has read them all
      t.copy_(sum);
    };
    c.all_gather = [this, rank](const at::Tensor& t, int64_t dim) {
      slots_[static_cast<size_t>(rank)] = t.clone();
      barrier_.arrive_and_wait();
      at::Tensor out = at::cat(slots_, dim);
      barrier_.arrive_and_wait();
      return out;
    };
    return c;
  }

  /// Runs fn(rank) on n threads; a rank that throws leaves the barrier (so the others do not
  /// wait for it) and its message is returned.
  std::vector<std::string> run(const std::function<void(int)>& fn) {
    std::vector<std::string> errors(static_cast<size_t>(n_));
    std::vector<std::thread> threads;
    for (int r = 0; r < n_; ++r) {
      threads.emplace_back([&, r] {
        try {
          fn(r);
        } catch (const std::exception& e) {
          errors[static_cast<size_t>(r)] = e.what();
          barrier_.arrive_and_drop();
        }
      });
    }
    for (auto& t : threads) t.join();
    return errors;
  }

 private:
  int n_;
  std::vector<at::Tensor> slots_;
  std::barrier<> barrier_;
};

TEST(ParallelLinear, MlpAcrossThreadRanksEqualsTheFullMlp) {
  at::manual_seed(4);
  const int64_t in = 6, hidden = 8, out = 5;
  const auto w1 = at::randn({hidden, in}), b1 = at::randn({hidden});
  const auto w2 = at::randn({out, hidden}), b2 = at::randn({out});
  const auto x = at::randn({3, 4, in});
  const auto hid = at::gelu(at::linear(x, w1, b1), "tanh");
  const auto want = at::linear(hid, w2, b2);
  for (int world : {2, 4}) {
    for (bool transposed : {false, true}) {
      ThreadWorld tw(world);
      std::vector<at::Tensor> got(world), gathered(world), from_full(world);
      const auto errors = tw.run([&](int r) {
        at::NoGradGuard no_grad;
        const auto comm = tw.comm(r);
        tp::ColumnParallelLinear up(
            tp::ColumnParallelLinearOptions{.in_features = in, .out_features = hidden}, comm);
        up->load_full(transposed ? w1.t() : w1, b1, {.transposed = transposed});
        tp::RowParallelLinear down(
            tp::RowParallelLinearOptions{.in_features = hidden, .out_features = out}, comm);
        down->load_full(transposed ? w2.t() : w2, b2, {.transposed = transposed});
        TORCHPAR_RCHECK(up->weight.sizes().vec() == Shape({hidden / world, in}), "up shard");
        TORCHPAR_RCHECK(down->weight.sizes().vec() == Shape({out, hidden / world}), "down shard");
        got[r] = down->forward(at::gelu(up->forward(x), "tanh"));

        tp::ColumnParallelLinear all(
            tp::ColumnParallelLinearOptions{
                .in_features = in, .out_features = hidden, .gather_output = true},
            comm);
        all->load_full(w1, b1);
        gathered[r] = all->forward(x);

        tp::RowParallelLinear whole_input(
            tp::RowParallelLinearOptions{
                .in_features = hidden, .out_features = out, .input_is_parallel = false},
            comm);
        whole_input->load_full(w2, b2);
        from_full[r] = whole_input->forward(hid);
      });
      for (int r = 0; r < world; ++r) {
        ASSERT_EQ(errors[r], "") << "rank " << r;
        EXPECT_LT(max_abs_diff(got[r], want), 1e-5) << "world " << world << " rank " << r;
        EXPECT_LT(max_abs_diff(gathered[r], at::linear(x, w1, b1)), 1e-5);
        EXPECT_LT(max_abs_diff(from_full[r], want), 1e-5);
        EXPECT_TRUE(at::equal(got[r], got[0])) << "ranks disagree";
      }
    }
  }
}

TEST(ParallelLinear, ErrorsNameTheNumbers) {
  const auto noop = [](at::Tensor&) {};
  const auto msg = error_of([&] {
    tp::ColumnParallelLinear(
        tp::ColumnParallelLinearOptions{.in_features = 3, .out_features = 10},
        tp::TensorParallelComm{.rank = 0, .world_size = 4, .all_reduce_sum = noop});
  });
  EXPECT_TRUE(has_all(msg, {"out_features = 10", "world size 4"})) << msg;
  // world size 2 without collectives; a rank outside the world
  const tp::RowParallelLinearOptions four_in{.in_features = 4, .out_features = 2};
  EXPECT_THROW(tp::RowParallelLinear(four_in, tp::TensorParallelComm{.rank = 0, .world_size = 2}),
               tp::ValueError);
  EXPECT_THROW(
      tp::RowParallelLinear(
          four_in, tp::TensorParallelComm{.rank = 2, .world_size = 2, .all_reduce_sum = noop}),
      tp::ValueError);
  tp::ColumnParallelLinear one(
      tp::ColumnParallelLinearOptions{.in_features = 3, .out_features = 4});
  EXPECT_THROW(one->load_shard(at::zeros({4, 2}), at::zeros({4})), tp::ValueError);  // shape
  EXPECT_THROW(one->load_shard(at::zeros({4, 3}), at::Tensor()), tp::ValueError);    // no bias
  EXPECT_THROW(one->forward(at::zeros({2, 5})), tp::ValueError);                     // features
  // With world size > 1 the layers are inference-only: autograd on refuses before any collective.
  ThreadWorld tw(2);
  const auto errors = tw.run([&](int r) {
    tp::RowParallelLinear row(tp::RowParallelLinearOptions{.in_features = 4, .out_features = 2},
                              tw.comm(r));
    row->forward(at::ones({1, 2}));
  });
  for (const auto& e : errors) EXPECT_TRUE(has_all(e, {"inference-only", "NoGradGuard"})) << e;
}

// ---- policies -----------------------------------------------------------------------------------

TEST(Policy, HeadsAndWidthMustDivideByTheWorldSize) {
  const auto noop = [](at::Tensor&) {};
  const tp::GptConfig six_heads{
      .vocab_size = 11, .n_positions = 8, .n_embd = 48, .n_layer = 1, .n_head = 6};
  auto msg = error_of([&] { tp::arguments_per_rank(tp::gpt2_policy(six_heads), 4); });
  EXPECT_TRUE(has_all(msg, {"GPT2Block", "attn.num_heads = 6", "world size 4"})) << msg;
  msg = error_of([&] {
    tp::Gpt(six_heads,
            tp::GptOptions{.comm = {.rank = 1, .world_size = 4, .all_reduce_sum = noop}});
  });
  EXPECT_TRUE(has_all(msg, {"GPT2Block", "attn.num_heads = 6", "world size 4"})) << msg;
  const tp::GptConfig odd_inner{
      .vocab_size = 11, .n_positions = 8, .n_embd = 64, .n_layer = 1, .n_head = 4, .n_inner = 90};
  msg = error_of([&] {
    tp::Gpt(odd_inner,
            tp::GptOptions{.comm = {.rank = 0, .world_size = 4, .all_reduce_sum = noop}});
  });
  EXPECT_TRUE(has_all(msg, {"GPT2Block", "mlp.inner_dim = 90", "world size 4"})) << msg;
  const auto per_rank = tp::arguments_per_rank(tp::gpt2_policy(six_heads), 3);
  EXPECT_EQ(per_rank.at("attn.num_heads"), 2);
  EXPECT_EQ(per_rank.at("attn.embed_dim"), 16);
  EXPECT_EQ(per_rank.at("mlp.inner_dim"), 64);
}

/// A user's own block type, nn.Linear layout: separate q/k/v, an output projection, an MLP.
tp::TensorParallelPolicy encoder_policy() {
  return {.block_type = "EncoderLayer",
          .block_pattern = "enc.layers.{}.",
          .attn_qkv = {{.weight = "q.weight", .bias = "q.bias"},
                       {.weight = "kv.weight", .bias = "kv.bias", .n_fused = 2}},
          .attn_out = {{.weight = "o.weight", .bias = "o.bias"}},
          .mlp_in = {{.weight = "fc1.weight", .bias = "fc1.bias"},
                     {.weight = "gate.weight", .ignore_checker = true}},
          .mlp_out = {{.weight = "fc2.weight", .bias = "fc2.bias"}},
          .replace_arguments = {{"num_heads", 4}, {"embed_dim", 8}}};
}

tp::StateDict encoder_state(int layers) {
  at::manual_seed(5);
  tp::StateDict sd{{"enc.embed.weight", at::randn({10, 8})}, {"head.weight", at::randn({3, 8})}};
  for (int i = 0; i < layers; ++i) {
    const std::string p = fmt::format("enc.layers.{}.", i);
    sd[p + "q.weight"] = at::randn({8, 8});
    sd[p + "q.bias"] = at::randn({8});
    sd[p + "kv.weight"] = at::randn({16, 8});
    sd[p + "kv.bias"] = at::randn({16});
    sd[p + "o.weight"] = at::randn({8, 8});
    sd[p + "o.bias"] = at::randn({8});
    sd[p + "fc1.weight"] = at::randn({12, 8});
    sd[p + "fc1.bias"] = at::randn({12});
    sd[p + "fc2.weight"] = at::randn({8, 12});
    sd[p + "fc2.bias"] = at::randn({8});
    sd[p + "norm.weight"] = at::randn({8});
  }
  return sd;
}

TEST(Policy, CustomPolicySlicesByName) {
  const auto full = encoder_state(12);  // "enc.layers.1." must not claim "enc.layers.10."
  const auto shard = tp::shard_state_dict(full, {encoder_policy()}, 1, 2);
  ASSERT_EQ(shard.size(), full.size());
  for (int i : {0, 1, 10}) {
    const std::string p = fmt::format("enc.layers.{}.", i);
    EXPECT_TRUE(at::equal(shard.at(p + "q.weight"), full.at(p + "q.weight").narrow(0, 4, 4)));
    EXPECT_TRUE(at::equal(shard.at(p + "q.bias"), full.at(p + "q.bias").narrow(0, 4, 4)));
    const auto& kv = full.at(p + "kv.weight");  // k rows 0..7, v rows 8..15; rank 1: 4..7, 12..15
    EXPECT_TRUE(at::equal(shard.at(p + "kv.weight"),
                          at::cat({kv.narrow(0, 4, 4), kv.narrow(0, 12, 4)}, 0)));
    EXPECT_TRUE(at::equal(shard.at(p + "o.weight"), full.at(p + "o.weight").narrow(1, 4, 4)));
    EXPECT_TRUE(shard.at(p + "o.bias").is_same(full.at(p + "o.bias"))) << "row bias: whole";
    EXPECT_TRUE(at::equal(shard.at(p + "fc1.weight"), full.at(p + "fc1.weight").narrow(0, 6, 6)));
    EXPECT_TRUE(at::equal(shard.at(p + "fc2.weight"), full.at(p + "fc2.weight").narrow(1, 6, 6)));
    EXPECT_TRUE(shard.at(p + "norm.weight").is_same(full.at(p + "norm.weight")));
  }
  EXPECT_TRUE(shard.at("enc.embed.weight").is_same(full.at("enc.embed.weight"))) << "replicated";
  EXPECT_TRUE(shard.at("head.weight").is_same(full.at("head.weight")));

  auto missing = encoder_state(2);
  missing.erase("enc.layers.1.o.weight");
  const auto msg = error_of([&] { tp::shard_state_dict(missing, {encoder_policy()}, 0, 2); });
  EXPECT_TRUE(has_all(msg, {"EncoderLayer", "'enc.layers.1.'", "'o.weight'"})) << msg;
  auto bad_heads = encoder_policy();
  bad_heads.replace_arguments[0].value = 3;
  const auto heads = error_of([&] { tp::shard_state_dict(encoder_state(1), {bad_heads}, 0, 2); });
  EXPECT_TRUE(has_all(heads, {"EncoderLayer", "num_heads = 3", "world size 2"})) << heads;
  EXPECT_THROW(tp::shard_state_dict(encoder_state(1), {encoder_policy()}, 2, 2), tp::ValueError);
}

// ---- Gpt against the Python reference -----------------------------------------------------------

/// The model gpt_reference.py builds with the arguments below.
const tp::GptConfig kConfig{
    .vocab_size = 101, .n_positions = 32, .n_embd = 64, .n_layer = 2, .n_head = 4};
constexpr double kTolerance = 1e-4;  // float32, max abs error of the logits

std::vector<std::string> reference_args(const std::string& out) {
  return {"/usr/bin/python3",
          TORCHPAR_GPT_REFERENCE_PY,
          "--out",
          out,
          "--layers",
          "2",
          "--width",
          "64",
          "--heads",
          "4",
          "--vocab",
          "101",
          "--context",
          "32",
          "--batch",
          "2",
          "--tokens",
          "11",
          "--seed",
          "0"};
}

struct Reference {
  at::Tensor input_ids;  // int64 [2, 11]
  at::Tensor logits;     // float32 [2, 11, 101]
};

Reference read_reference(const std::string& dir) {
  const auto r = tp::load_state_dict_file(dir + "/reference.pt");
  return {r.at("input_ids"), r.at("logits")};
}

/// Runs the Python reference once for the suite (argv, no shell) into a temporary directory.
/// Skips when /usr/bin/python3 or its torch is missing; a failing script fails the tests.
class GptReference : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (::access("/usr/bin/python3", X_OK) != 0) {
      skip_ = "no /usr/bin/python3";
      return;
    }
    if (tp::run_program({"/usr/bin/python3", "-c", "import torch"}, {}, 120s) != 0) {
      skip_ = "/usr/bin/python3 has no torch (Debian: python3-torch)";
      return;
    }
    std::string tmpl = (std::filesystem::temp_directory_path() / "torchpar_gpt_XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) {
      failure_ = "mkdtemp failed";
      return;
    }
    dir_ = tmpl;
    const int code = tp::run_program(reference_args(dir_), {}, 300s);
    if (code != 0) failure_ = fmt::format("gpt_reference.py exited with {}", code);
  }
  static void TearDownTestSuite() {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  void SetUp() override {
    if (!skip_.empty()) GTEST_SKIP() << skip_;
    ASSERT_EQ(failure_, "");
    ref_ = read_reference(dir_);
  }
  static std::string state_path() { return dir_ + "/state_dict.pt"; }

  static inline std::string dir_;
  static inline std::string skip_;
  static inline std::string failure_;
  Reference ref_;
};

TEST_F(GptReference, Tp1LogitsMatchPython) {
  for (bool mmap : {true, false}) {
    auto gpt = tp::load_gpt(kConfig, tp::load_state_dict_file(state_path(), {.mmap = mmap}));
    EXPECT_EQ(gpt->heads_per_rank(), 4);
    at::NoGradGuard no_grad;
    const auto logits = gpt->forward(ref_.input_ids);
    ASSERT_EQ(logits.sizes().vec(), Shape({2, 11, 101}));
    const double err = max_abs_diff(logits, ref_.logits);
    std::printf("TP=1 (mmap %d): max abs error vs Python %.3g\n", mmap, err);
    EXPECT_LE(err, kTolerance);
  }
}

/// One rank of a TP = 2 Gpt over a `backend` group: its shard's shapes (the vocabulary split
/// in two: 51 rows each, rank 1's last one padding), the logits, KV-cache decoding; the same
/// logits with the vocabulary replicated; bfloat16 too on shm (Gloo reduces no bfloat16).
void tp2_rank(int rank, int port, std::string backend, std::string dir) {
  tp::World world(tp::WorldOptions{.rank = rank,
                                   .world_size = 2,
                                   .master_addr = "127.0.0.1",
                                   .master_port = port,
                                   .timeout = std::chrono::seconds(60)});
  auto group = world.create_collective_group({}, tp::backend_from_string(backend));
  const auto comm = tp::TensorParallelComm::from_group(group);
  const Reference ref = read_reference(dir);
  auto gpt =
      tp::load_gpt(kConfig, tp::load_state_dict_file(dir + "/state_dict.pt"), {.comm = comm});
  TORCHPAR_RCHECK(gpt->heads_per_rank() == 2, "heads per rank {}", gpt->heads_per_rank());
  const auto params = gpt->named_parameters();
  TORCHPAR_RCHECK(params["h.0.attn.c_attn.weight"].sizes().vec() == Shape({96, 64}) &&
                      params["h.1.mlp.c_proj.weight"].sizes().vec() == Shape({64, 128}) &&
                      params["wte.weight"].sizes().vec() == Shape({51, 64}) &&
                      gpt->vocab_parallel(),
                  "rank {}: shard shapes", rank);
  if (rank == 1)  // ids 51..100, then one zero row of padding
    TORCHPAR_RCHECK(params["wte.weight"][50].abs().max().item<double>() == 0,
                    "rank 1: the padding row is not zero");

  const auto logits = gpt->forward(ref.input_ids);
  const double err = max_abs_diff(logits, ref.logits);
  std::printf("TP=2 %s rank %d: max abs error vs Python %.3g\n", backend.c_str(), rank, err);
  TORCHPAR_RCHECK(err <= kTolerance, "rank {}: TP=2 logits differ from Python by {}", rank, err);

  tp::GptKvCache cache;
  std::vector<at::Tensor> steps{gpt->forward(ref.input_ids.narrow(1, 0, 5), &cache)};
  for (int64_t t = 5; t < ref.input_ids.size(1); ++t)
    steps.push_back(gpt->forward(ref.input_ids.narrow(1, t, 1), &cache));
  const double inc = max_abs_diff(at::cat(steps, 1), ref.logits);
  TORCHPAR_RCHECK(inc <= kTolerance, "rank {}: TP=2 cached decoding differs by {}", rank, inc);
  TORCHPAR_RCHECK(cache.keys.at(0).sizes().vec() == Shape({2, 2, 11, 16}), "cache shape");

  auto replicated = tp::load_gpt(kConfig, tp::load_state_dict_file(dir + "/state_dict.pt"),
                                 {.comm = comm, .vocab_parallel = false});
  TORCHPAR_RCHECK(
      !replicated->vocab_parallel() &&
          replicated->named_parameters()["wte.weight"].sizes().vec() == Shape({101, 64}),
      "rank {}: replicated vocabulary", rank);
  const double rep = max_abs_diff(replicated->forward(ref.input_ids), ref.logits);
  TORCHPAR_RCHECK(rep <= kTolerance, "rank {}: TP=2 replicated-vocabulary logits differ by {}",
                  rank, rep);

  if (backend == "shm") {
    auto config = kConfig;
    config.dtype = at::kBFloat16;
    auto half =
        tp::load_gpt(config, tp::load_state_dict_file(dir + "/state_dict.pt"), {.comm = comm});
    const auto l16 = half->forward(ref.input_ids);
    const double e16 = max_abs_diff(l16, ref.logits);
    const double bound = 0.02 + 0.02 * ref.logits.abs().max().item<double>();
    TORCHPAR_RCHECK(l16.scalar_type() == at::kBFloat16 && e16 <= bound,
                    "rank {}: bfloat16 TP=2 logits differ by {} (bound {})", rank, e16, bound);
  }
}

TEST_F(GptReference, Tp2AcrossProcessesMatchesPython) {
  for (std::string backend : {"shm", "gloo"}) {
    const auto res = run_ranks(2, 180, &tp2_rank, free_port(), backend, dir_);
    for (size_t r = 0; r < res.size(); ++r)
      EXPECT_EQ(res[r].exitcode, 0) << backend << " rank " << r << ": " << res[r].error;
  }
}

TEST_F(GptReference, KvCacheDecodingEqualsFullForward) {
  auto gpt = tp::load_gpt(kConfig, tp::load_state_dict_file(state_path()));
  at::NoGradGuard no_grad;
  const auto full = gpt->forward(ref_.input_ids);
  tp::GptKvCache cache;
  std::vector<at::Tensor> steps{gpt->forward(ref_.input_ids.narrow(1, 0, 4), &cache)};
  EXPECT_EQ(cache.length(), 4);
  for (int64_t t = 4; t < 11; ++t)
    steps.push_back(gpt->forward(ref_.input_ids.narrow(1, t, 1), &cache));
  const auto decoded = at::cat(steps, 1);
  EXPECT_LE(max_abs_diff(decoded, full), 1e-5);
  EXPECT_LE(max_abs_diff(decoded, ref_.logits), kTolerance);
  EXPECT_EQ(cache.length(), 11);
  ASSERT_EQ(cache.keys.size(), 2u);
  EXPECT_EQ(cache.keys[1].sizes().vec(), Shape({2, 4, 11, 16}));

  // 11 cached + 22 new > 32 positions: refused, and the cache is as it was.
  const auto msg = error_of([&] { gpt->forward(at::zeros({2, 22}, at::kLong), &cache); });
  EXPECT_TRUE(has_all(msg, {"11 cached", "22 new", "32"})) << msg;
  EXPECT_EQ(cache.length(), 11);
  EXPECT_THROW(gpt->forward(at::zeros({1, 1}, at::kLong), &cache), tp::ValueError);  // batch 1 != 2
  cache.clear();
  EXPECT_EQ(cache.length(), 0);
  EXPECT_LE(max_abs_diff(gpt->forward(ref_.input_ids, &cache), full), 1e-6);

  EXPECT_THROW(gpt->forward(ref_.input_ids.to(at::kInt)), tp::ValueError);
  EXPECT_THROW(gpt->forward(at::full({1, 2}, 101, at::kLong)), tp::ValueError);  // id >= vocab
  EXPECT_THROW(gpt->forward(at::zeros({11}, at::kLong)), tp::ValueError);        // not [B, T]
}

TEST_F(GptReference, Bfloat16WeightsRun) {
  auto config = kConfig;
  config.dtype = at::kBFloat16;
  auto gpt = tp::load_gpt(config, tp::load_state_dict_file(state_path()));
  for (const auto& p : gpt->parameters()) ASSERT_EQ(p.scalar_type(), at::kBFloat16);
  at::NoGradGuard no_grad;
  tp::GptKvCache cache;
  const auto logits = gpt->forward(ref_.input_ids, &cache);
  ASSERT_EQ(logits.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::isfinite(logits).all().item<bool>());
  const double err = max_abs_diff(logits, ref_.logits);
  const double bound = 0.02 + 0.02 * ref_.logits.abs().max().item<double>();
  std::printf("bfloat16: max abs error vs Python (float32) %.3g, bound %.3g\n", err, bound);
  EXPECT_LE(err, bound);
  const auto next = gpt->forward(logits.select(1, -1).argmax(-1, true), &cache);
  EXPECT_EQ(next.sizes().vec(), Shape({2, 1, 101}));
  EXPECT_EQ(cache.length(), 12);
}

TEST_F(GptReference, LinearLayoutCheckpointLoadsWithACustomPolicy) {
  // nanoGPT's layout: nn.Linear [out, in] weights. Same numbers, transposed flags off.
  auto sd = tp::load_state_dict_file(state_path());
  auto policy = tp::gpt2_policy(kConfig);
  for (auto* layers : {&policy.attn_qkv, &policy.attn_out, &policy.mlp_in, &policy.mlp_out}) {
    for (auto& l : *layers) {
      l.transposed = false;
      for (int i = 0; i < kConfig.n_layer; ++i) {
        const std::string name = fmt::format("h.{}.{}", i, l.weight);
        sd[name] = sd.at(name).t().contiguous();
      }
    }
  }
  auto gpt = tp::load_gpt(kConfig, sd, {.policy = policy});
  at::NoGradGuard no_grad;
  EXPECT_LE(max_abs_diff(gpt->forward(ref_.input_ids), ref_.logits), kTolerance);
  // The default (Conv1D) policy on this layout: c_attn [192, 64] is read as [in, out] and
  // refused with a hint.
  const auto msg = error_of([&] { tp::load_gpt(kConfig, sd); });
  EXPECT_TRUE(has_all(msg, {"h.0.attn.c_attn.weight", "transposed"})) << msg;
  // A policy that changes more than the layout does not fit the model.
  auto other = tp::gpt2_policy(kConfig);
  other.attn_qkv[0].n_fused = 1;
  EXPECT_THROW(tp::Gpt(kConfig, tp::GptOptions{.policy = other}), tp::ValueError);
}

TEST_F(GptReference, RefusedStateDicts) {
  const auto sd = tp::load_state_dict_file(state_path());
  auto without = sd;
  without.erase("h.1.mlp.c_fc.bias");
  auto msg = error_of([&] { tp::load_gpt(kConfig, without); });
  EXPECT_TRUE(has_all(msg, {"'h.1.'", "mlp.c_fc.bias"})) << msg;
  without = sd;
  without.erase("ln_f.weight");
  msg = error_of([&] { tp::load_gpt(kConfig, without); });
  EXPECT_TRUE(has_all(msg, {"missing", "ln_f.weight"})) << msg;

  auto extra = sd;
  extra["lm_head.weight"] = sd.at("wte.weight");  // Hugging Face keeps the tied head too
  msg = error_of([&] { tp::load_gpt(kConfig, extra); });
  EXPECT_TRUE(has_all(msg, {"lm_head.weight", "strict = false"})) << msg;
  tp::Gpt lenient(kConfig);
  lenient->load_state_dict(extra, /*strict=*/false);
  at::NoGradGuard no_grad;
  EXPECT_LE(max_abs_diff(lenient->forward(ref_.input_ids), ref_.logits), kTolerance);

  auto wrong = sd;
  wrong["wpe.weight"] = at::zeros({16, 64});
  msg = error_of([&] { tp::load_gpt(kConfig, wrong); });
  EXPECT_TRUE(has_all(msg, {"wpe.weight", "[16, 64]", "[32, 64]"})) << msg;
}

TEST_F(GptReference, FilesLibTorchCannotReadAreRefused) {
  // What LibTorch 1.13's unpickler does not read (an OrderedDict; SETITEM, which Python writes
  // for a one-entry dict), and a dict with a value that is not a tensor.
  const std::string script =
      "import collections, sys, torch\n"
      "torch.save(collections.OrderedDict(a=torch.ones(2), b=torch.ones(3)), sys.argv[1])\n"
      "torch.save({'a': torch.ones(2)}, sys.argv[2])\n"
      "torch.save({'a': torch.ones(2), 'n': 3}, sys.argv[3])\n";
  const std::vector<std::string> files = {dir_ + "/ordered.pt", dir_ + "/one.pt", dir_ + "/int.pt"};
  ASSERT_EQ(
      tp::run_program({"/usr/bin/python3", "-c", script, files[0], files[1], files[2]}, {}, 120s),
      0);
  for (const auto& f : files) {
    for (bool mmap : {true, false}) {
      try {
        tp::load_state_dict_file(f, {.mmap = mmap});
        ADD_FAILURE() << f << " was read";
      } catch (const tp::SerializationError& e) {
        EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
      }
    }
  }
}

// ---- files, and a full-size model -------------------------------------------------------------

TEST(StateDictFile, UnreadableFilesRaise) {
  const auto dir = std::filesystem::temp_directory_path();
  const auto missing = (dir / "torchpar_no_such_state_dict.pt").string();
  try {
    tp::load_state_dict_file(missing);
    ADD_FAILURE() << "no error for a missing file";
  } catch (const tp::Error& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
  const auto junk = (dir / fmt::format("torchpar_junk_{}.pt", ::getpid())).string();
  std::ofstream(junk) << "not a zip archive";
  EXPECT_THROW(tp::load_state_dict_file(junk), tp::SerializationError);
  std::ofstream(junk, std::ios::trunc).close();
  EXPECT_THROW(tp::load_state_dict_file(junk), tp::SerializationError);  // empty
  std::filesystem::remove(junk);
}

TEST(Gpt, Gpt2SmallShapeConstructsAndRuns) {
  at::manual_seed(0);
  tp::Gpt gpt(tp::GptConfig{});  // 12 layers, 768 wide, 12 heads, 1024 positions, 50257 tokens
  EXPECT_EQ(gpt->num_parameters(), 124439808);
  std::printf("GPT-2 small: %.1fM parameters\n", static_cast<double>(gpt->num_parameters()) / 1e6);
  at::NoGradGuard no_grad;
  const auto ids = at::randint(50257, {1, 8}, at::TensorOptions().dtype(at::kLong));
  const auto logits = gpt->forward(ids);
  EXPECT_EQ(logits.sizes().vec(), Shape({1, 8, 50257}));
  EXPECT_TRUE(at::isfinite(logits).all().item<bool>());

  // Rank 0 of 2 holds half of every attention and MLP and all of the embeddings: 81.9M.
  // Uninitialised parameters are never touched, so this costs no memory.
  const auto noop = [](at::Tensor&) {};
  const auto gather = [](const at::Tensor& t, int64_t dim) { return at::cat({t, t}, dim); };
  tp::Gpt half(tp::GptConfig{},
               tp::GptOptions{.comm = {.rank = 0, .world_size = 2, .all_reduce_sum = noop},
                              .initialize = false,
                              .vocab_parallel = false});
  EXPECT_EQ(half->num_parameters(), 81940224);
  EXPECT_EQ(half->heads_per_rank(), 6);
  // With the vocabulary split too (the default), half of the token embedding: 62.6M, 50.3%.
  tp::Gpt split(
      tp::GptConfig{},
      tp::GptOptions{
          .comm = {.rank = 1, .world_size = 2, .all_reduce_sum = noop, .all_gather = gather},
          .initialize = false});
  EXPECT_EQ(split->num_parameters(), 62641920);
  EXPECT_TRUE(split->vocab_parallel());
  // vocab_parallel needs all_gather: a clear error, not a crash at the first forward.
  const auto msg = error_of([&] {
    tp::Gpt(tp::GptConfig{},
            tp::GptOptions{.comm = {.rank = 0, .world_size = 2, .all_reduce_sum = noop},
                           .initialize = false});
  });
  EXPECT_TRUE(has_all(msg, {"vocab_parallel", "all_gather"})) << msg;
}

}  // namespace

int main(int argc, char** argv) {
  tp::init(argc, argv);
  return torchpar::testing::run_tests(argc, argv);
}
