#include "torchpar/parallel/sampling.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cmath>
#include <tuple>

#include "shape_text.h"
#include "torchpar/core/error.h"

namespace torchpar {

at::Tensor sample_next_token(const at::Tensor& logits, const SamplingOptions& options,
                             at::Generator& generator) {
  if (!logits.defined() || logits.dim() != 2 || !at::isFloatingType(logits.scalar_type()) ||
      logits.size(0) < 1 || logits.size(1) < 1) {
    throw ValueError(fmt::format(
        "sample_next_token: logits must be a floating tensor [batch, vocab] with batch and "
        "vocab >= 1, got {}",
        logits.defined() ? fmt::format("{} {}", detail::shape_of(logits.sizes()),
                                       c10::toString(logits.scalar_type()))
                         : std::string("an undefined tensor")));
  }
  if (!(options.temperature >= 0) || !std::isfinite(options.temperature) || options.top_k < 0) {
    throw ValueError(
        fmt::format("sample_next_token: temperature {} must be finite and >= 0, top_k {} >= 0",
                    options.temperature, options.top_k));
  }
  at::Tensor l = logits.to(at::kFloat);
  if (options.greedy || options.temperature == 0) return l.argmax(-1, /*keepdim=*/true);
  // In float64, as a float32 division would round a temperature below 1e-45 to 0 (and 0 / 0 is
  // NaN); and the largest logit becomes 0 first, so that no positive temperature (1e-300, the
  // smallest denormal) makes a NaN: the others become -inf at worst, greedy in effect.
  l = l.to(at::kDouble);
  l = (l - std::get<0>(l.max(-1, /*keepdim=*/true))) / options.temperature;
  const int64_t k = options.top_k;
  if (k > 0 && k < l.size(-1)) {
    // Draws among the k candidates alone: k exponentials per row, not one per vocabulary entry.
    const auto [values, indices] = l.topk(k, -1);  // [B, k] each, descending
    const at::Tensor pick =
        at::multinomial(values.softmax(-1), 1, /*replacement=*/false, generator);
    return indices.gather(-1, pick);
  }
  return at::multinomial(l.softmax(-1), 1, /*replacement=*/false, generator);
}

}  // namespace torchpar
