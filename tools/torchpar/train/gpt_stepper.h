#pragma once
// `torchpar train --model gpt`: the training recipe (AdamW, the learning-rate schedule), the
// window sampler and the Stepper that takes one optimizer step; gpt_trainer.cpp drives it.

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <tuple>
#include <utility>
#include <vector>

#include "torchpar/parallel/gpt.h"
#include "trainer.h"

namespace torchpar::train {

// The recipe (nanoGPT's for small models): AdamW with betas (0.9, 0.95), weight decay on the
// matrices and embeddings only, gradients clipped to norm 1, the learning rate warmed up
// linearly and then decayed along a cosine to a tenth of its peak at the last step.
constexpr double kBeta1 = 0.9;
constexpr double kBeta2 = 0.95;
constexpr double kWeightDecay = 0.1;
constexpr double kGradClip = 1.0;
constexpr double kFinalLrFraction = 0.1;
constexpr int64_t kReportEverySteps = 5;  // steps between progress messages

inline int64_t warmup_steps(const TrainConfig& c) {
  return std::clamp<int64_t>(c.steps / 10, 1, 100);
}

/// The learning rate of `step` (1-based): linear warmup, then a cosine down to
/// kFinalLrFraction x lr at the last step.
inline double lr_at(const TrainConfig& c, int64_t step) {
  const int64_t warm = warmup_steps(c);
  if (step <= warm) return c.lr * static_cast<double>(step) / static_cast<double>(warm);
  const double progress =
      static_cast<double>(step - warm) / static_cast<double>(std::max<int64_t>(1, c.steps - warm));
  const double cosine = 0.5 * (1 + std::cos(std::numbers::pi * std::min(1.0, progress)));
  return c.lr * (kFinalLrFraction + (1 - kFinalLrFraction) * cosine);
}

/// Random training windows of a worker: `context` + 1 consecutive bytes from a uniformly
/// drawn offset; the generator is seeded per worker and step, so a run draws the same windows
/// again, and a run resumed at a step (resume.h) draws what it would have drawn: the step is
/// the whole data position.
class WindowSampler {
 public:
  WindowSampler(at::Tensor bytes, int64_t context, uint64_t seed)
      : bytes_(std::move(bytes)),
        context_(context),
        offsets_(at::arange(context + 1, at::kLong)),
        seed_(seed),
        gen_(at::make_generator<at::CPUGeneratorImpl>(seed)) {}

  /// The windows of step `step`: x = the windows' first `context` bytes, y = the `context`
  /// bytes after each of those: int64 [batch, context] each.
  std::pair<at::Tensor, at::Tensor> next(int64_t batch, int64_t step) {
    gen_.set_current_seed(seed_ + static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull);
    const int64_t starts = bytes_.numel() - context_;  // offsets 0 .. starts - 1 fit
    const at::Tensor first = at::randint(starts, {batch, 1}, gen_, at::kLong);
    const at::Tensor w = bytes_.index_select(0, (first + offsets_).view(-1))
                             .view({batch, context_ + 1})
                             .to(at::kLong);
    return {w.slice(1, 0, context_), w.slice(1, 1, context_ + 1)};
  }

 private:
  at::Tensor bytes_;
  int64_t context_;
  at::Tensor offsets_;
  uint64_t seed_;
  at::Generator gen_;
};

inline torch::optim::AdamW make_adamw(GptImpl& gpt, const TrainConfig& cfg) {
  std::vector<at::Tensor> decay, no_decay;  // matrices and embeddings; biases and LayerNorms
  for (const auto& p : gpt.parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  auto options = [&](double weight_decay) {
    return std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(cfg.lr)
                                                            .betas(std::make_tuple(kBeta1, kBeta2))
                                                            .weight_decay(weight_decay));
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, options(kWeightDecay));
  groups.emplace_back(no_decay, options(0.0));
  return torch::optim::AdamW(std::move(groups), torch::optim::AdamWOptions(cfg.lr));
}

/// What one training process holds: the model, its AdamW and its window sampler.
/// step(n, sync) is one optimizer step; sync() runs between backward and the clipping (ddp
/// averages the gradients there, so every rank clips and steps alike).
class Stepper {
 public:
  Stepper(Gpt gpt, const TrainConfig& cfg, int rank, at::Tensor train_bytes)
      : gpt_(std::move(gpt)),
        cfg_(cfg),
        opt_(make_adamw(*gpt_, cfg)),
        windows_(std::move(train_bytes), cfg.context,
                 static_cast<uint64_t>(cfg.seed) * 1000003u + static_cast<uint64_t>(rank)) {}

  /// Returns the batch's mean loss per byte (nats).
  template <class Sync>
  double step(int64_t n, Sync&& sync) {
    gpt_->train();
    const auto [x, y] = windows_.next(cfg_.batch_size, n);
    gpt_->zero_grad();
    const at::Tensor logits = gpt_->forward(x);
    const at::Tensor loss =
        at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
    loss.backward();
    sync();
    torch::nn::utils::clip_grad_norm_(gpt_->parameters(), kGradClip);
    for (auto& group : opt_.param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr_at(cfg_, n));
    }
    opt_.step();
    return loss.item<double>();
  }

  /// Trains steps first .. last, calling report(tokens, loss_sum, steps) every kReportEverySteps
  /// steps and at the end with the increments since the last call, and after_step(s) after
  /// step s.
  template <class Sync, class Report, class AfterStep>
  void train(int64_t first, int64_t last, Sync&& sync, Report&& report, AfterStep&& after_step) {
    int64_t steps = 0;
    double loss_sum = 0;
    for (int64_t s = first; s <= last; ++s) {
      loss_sum += step(s, sync);
      after_step(s);
      if (++steps == kReportEverySteps || s == last) {
        report(steps * cfg_.batch_size * cfg_.context, loss_sum, steps);
        steps = 0;
        loss_sum = 0;
      }
    }
  }
  template <class Sync, class Report>
  void train(int64_t first, int64_t last, Sync&& sync, Report&& report) {
    train(first, last, sync, report, [](int64_t) {});
  }

  torch::optim::AdamW& optimizer() { return opt_; }

 private:
  Gpt gpt_;
  TrainConfig cfg_;
  torch::optim::AdamW opt_;
  WindowSampler windows_;
};

}  // namespace torchpar::train
