// Gpt at world size 1 is an ordinary trainable module (what `torchpar train --model gpt` relies
// on): every parameter gets a gradient, and a few AdamW steps learn a repeating byte pattern.
#include <gtest/gtest.h>
#include <torch/types.h>  // before clip_grad.h, which uses torch::Tensor without including it

#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <string>
#include <vector>

#include "torchpar/parallel/gpt.h"
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

}  // namespace
