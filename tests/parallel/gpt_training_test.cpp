// Gpt at world size 1 is an ordinary trainable module (what `torchpar train --model gpt` relies
// on): every parameter gets a gradient, and a few AdamW steps learn a repeating byte pattern.
// The library's sampler (sample_next_token): greedy, seeded, top-k, errors.
#include <gtest/gtest.h>
#include <torch/types.h>  // before clip_grad.h, which uses torch::Tensor without including it

#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <string>
#include <vector>

#include "torchpar/parallel/gpt.h"
#include "torchpar/parallel/sampling.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;

namespace {

const tp::GptConfig kTiny{
    .vocab_size = 256, .n_positions = 32, .n_embd = 32, .n_layer = 2, .n_head = 2};

/// int64 [batch, 33]: "abcabc..." shifted differently in every row.
at::Tensor pattern(int64_t batch) {
  const std::string text = "the cat sat on the mat. ";
  at::Tensor t = at::empty({batch, 33}, at::kLong);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < 33; ++i) {
      t[b][i] = static_cast<unsigned char>(text[static_cast<size_t>(b + i) % text.size()]);
    }
  }
  return t;
}

double loss_of(tp::Gpt& gpt, const at::Tensor& w) {
  const at::Tensor logits = gpt->forward(w.slice(1, 0, 32));
  return at::cross_entropy_loss(logits.reshape({-1, 256}), w.slice(1, 1, 33).reshape({-1}))
      .item<double>();
}

TEST(GptTraining, EveryParameterGetsAGradient) {
  at::manual_seed(0);
  tp::Gpt gpt(kTiny);
  const at::Tensor w = pattern(4);
  const at::Tensor logits = gpt->forward(w.slice(1, 0, 32));
  ASSERT_TRUE(logits.requires_grad());
  at::cross_entropy_loss(logits.reshape({-1, 256}), w.slice(1, 1, 33).reshape({-1})).backward();
  for (const auto& p : gpt->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_GT(p.value().grad().abs().sum().item<double>(), 0) << p.key();
  }
}

TEST(GptTraining, AdamWLearnsARepeatingPattern) {
  at::manual_seed(0);
  tp::Gpt gpt(kTiny);
  torch::optim::AdamW opt(gpt->parameters(), torch::optim::AdamWOptions(3e-3));
  const at::Tensor w = pattern(8);
  double first = 0;
  {
    at::NoGradGuard no_grad;
    first = loss_of(gpt, w);
  }
  EXPECT_NEAR(first, std::log(256.0), 0.5);  // about uniform at initialisation
  for (int step = 0; step < 80; ++step) {
    opt.zero_grad();
    const at::Tensor logits = gpt->forward(w.slice(1, 0, 32));
    at::cross_entropy_loss(logits.reshape({-1, 256}), w.slice(1, 1, 33).reshape({-1})).backward();
    torch::nn::utils::clip_grad_norm_(gpt->parameters(), 1.0);
    opt.step();
  }
  at::NoGradGuard no_grad;
  EXPECT_LT(loss_of(gpt, w), 1.0) << "from " << first;  // the pattern is deterministic
}

// ---- sample_next_token (torchpar/parallel/sampling.h): the sampler of TensorParallel::generate
// and of `torchpar train --model gpt`'s sample.

at::Generator generator(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

TEST(SampleNextToken, GreedyTemperatureZeroAndTopOneTakeTheArgmax) {
  at::manual_seed(3);
  const at::Tensor logits = at::randn({4, 50});
  const at::Tensor want = logits.argmax(-1, true);
  auto gen = generator(1);
  EXPECT_TRUE(at::equal(tp::sample_next_token(logits, {.greedy = true}, gen), want));
  EXPECT_TRUE(at::equal(tp::sample_next_token(logits, {.temperature = 0}, gen), want));
  EXPECT_TRUE(at::equal(tp::sample_next_token(logits, {.top_k = 1}, gen), want));
  // The largest logit is subtracted first: a denormal temperature is greedy, not NaN.
  EXPECT_TRUE(at::equal(tp::sample_next_token(logits, {.temperature = 1e-300}, gen), want));
  EXPECT_TRUE(at::equal(tp::sample_next_token(logits.to(at::kBFloat16), {.greedy = true}, gen),
                        logits.to(at::kBFloat16).to(at::kFloat).argmax(-1, true)));
}

TEST(SampleNextToken, SameSeedSameTokensAndOnlyTheTopK) {
  at::manual_seed(4);
  const at::Tensor logits = at::randn({64, 100});
  const tp::SamplingOptions o{.temperature = 2.0, .top_k = 5};
  auto g1 = generator(7), g2 = generator(7);
  std::vector<at::Tensor> a, b;
  for (int i = 0; i < 20; ++i) {
    a.push_back(tp::sample_next_token(logits, o, g1));
    b.push_back(tp::sample_next_token(logits, o, g2));
  }
  const at::Tensor ta = at::cat(a, 1), tb = at::cat(b, 1);  // [64, 20]
  EXPECT_TRUE(at::equal(ta, tb));
  EXPECT_EQ(ta.scalar_type(), at::kLong);
  const at::Tensor top = std::get<1>(logits.topk(5, -1));  // [64, 5]
  EXPECT_TRUE(ta.unsqueeze(-1).eq(top.unsqueeze(1)).any(-1).all().item<bool>())
      << "a token outside the 5 likeliest";
  EXPECT_GT(std::get<0>(at::_unique(ta)).numel(), 5) << "rows draw different tokens";
}

// The draw is the one `torchpar train --model gpt` made before it used the library's sampler
// (its sample text for a seed is unchanged): softmax over the k largest of logits / T, one
// multinomial draw among those k, with the same generator.
TEST(SampleNextToken, DrawsAmongTheTopKAsTheTrainSampleDid) {
  at::manual_seed(5);
  for (uint64_t seed = 0; seed < 200; ++seed) {
    const at::Tensor logits = at::randn({1, 256}) * 3;
    auto g_old = generator(seed), g_new = generator(seed);
    const auto top = (logits[0].to(at::kDouble) / 0.8).topk(10);
    const at::Tensor pick = at::multinomial(std::get<0>(top).softmax(0), 1, false, g_old);
    const int64_t old = std::get<1>(top)[pick.item<int64_t>()].item<int64_t>();
    EXPECT_EQ(
        tp::sample_next_token(logits, {.temperature = 0.8, .top_k = 10}, g_new).item<int64_t>(),
        old)
        << "seed " << seed;
  }
}

TEST(SampleNextToken, BadArgumentsAreValueErrors) {
  auto gen = generator(1);
  const at::Tensor ok = at::zeros({2, 8});
  EXPECT_THROW(tp::sample_next_token(at::zeros({8}), {}, gen), tp::ValueError);
  EXPECT_THROW(tp::sample_next_token(at::zeros({2, 8}, at::kLong), {}, gen), tp::ValueError);
  EXPECT_THROW(tp::sample_next_token(at::zeros({2, 0}), {}, gen), tp::ValueError);
  EXPECT_THROW(tp::sample_next_token(at::Tensor(), {}, gen), tp::ValueError);
  EXPECT_THROW(tp::sample_next_token(ok, {.temperature = -1}, gen), tp::ValueError);
  EXPECT_THROW(tp::sample_next_token(ok, {.temperature = NAN}, gen), tp::ValueError);
  EXPECT_THROW(tp::sample_next_token(ok, {.temperature = INFINITY}, gen), tp::ValueError);
  EXPECT_THROW(tp::sample_next_token(ok, {.top_k = -1}, gen), tp::ValueError);
}

}  // namespace
