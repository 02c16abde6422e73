#pragma once
/// Picking the next token from a language model's logits: greedy, or sampled with a
/// temperature among the top k. The one sampler of torchpar: TensorParallel::generate and
/// `torchpar train --model gpt`'s sample both draw with it.

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace torchpar {

/// How sample_next_token picks (Hugging Face's generate arguments, by their names).
struct SamplingOptions {
  /// Divides the logits before the softmax: finite and >= 0; 0 means greedy.
  double temperature = 1.0;
  /// Sample among the top_k likeliest tokens only; 0 (or >= the vocabulary): among all.
  int64_t top_k = 0;
  /// true: the likeliest token (temperature and top_k unused).
  bool greedy = false;
};

/// The next token of every row, from the logits of each row's last position.
///
///   at::Tensor next = torchpar::sample_next_token(logits.select(1, -1),
///                                                 {.temperature = 0.8, .top_k = 10}, gen);
///
/// Greedy (options.greedy or temperature 0): the argmax of each row. Else the logits, in
/// float64, have their row's largest subtracted and are divided by the temperature (so any
/// positive temperature is safe: 1e-300 samples the likeliest token instead of overflowing to
/// NaN); with 0 < top_k < vocab the top_k largest are taken (descending) and one of them is
/// drawn from their softmax, else one token is drawn from the softmax over the whole row. Each
/// draw is at::multinomial(probabilities, 1) with `generator`, so a generator with the same
/// seed and state gives the same tokens.
///
/// Shapes:  logits [B, V], B >= 1, V >= 1, any floating dtype, CPU -> int64 [B, 1] token ids
///          in [0, V).
/// Errors:  ValueError when logits is not a 2-D floating tensor with B, V >= 1, the
///          temperature is negative, NaN or infinite, or top_k < 0.
/// Safety:  thread-safe for distinct generators; calls sharing one generator are serialized
///          by its mutex, in an unspecified order (their draws then depend on that order).
/// Source:  nanoGPT's GPT.generate sampling step (logits / temperature, top-k, softmax,
///          torch.multinomial(probs, num_samples=1)); Hugging Face's TopKLogitsWarper and
///          TemperatureLogitsWarper. The top-k tokens are drawn among directly rather than
///          masked to -inf over the vocabulary (the same distribution).
at::Tensor sample_next_token(const at::Tensor& logits, const SamplingOptions& options,
                             at::Generator& generator);

}  // namespace torchpar
