#pragma once
// The text of Debian's `fortunes` package (/usr/share/games/fortunes) as bytes for a
// byte-level language model, with a fixed held-out split.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace torchpar::train {

/// Where the corpus lives when nothing else is said.
inline constexpr const char* kDefaultFortunesDir = "/usr/share/games/fortunes";
/// Every kHeldOutEvery-th fortune (the 20th, 40th, ...) is held out for validation: 5%.
inline constexpr int64_t kHeldOutEvery = 20;

/// The corpus, split by fortune. Each fortune is followed by the "%\n" line that separates
/// fortunes in the files, so a model learns where one ends.
struct FortuneCorpus {
  at::Tensor train;      ///< uint8 [bytes]: the fortunes that are not held out
  at::Tensor val;        ///< uint8 [bytes]: every kHeldOutEvery-th fortune
  int64_t files = 0;     ///< fortune files read
  int64_t fortunes = 0;  ///< fortunes in both splits
  int64_t bytes = 0;     ///< bytes of the files used (at most the limit)
};

/// Reads the fortune files of `dir`: the regular files directly in it, in name order, except
/// hidden files, strfile's `*.dat` indexes and `*.u8` names (symbolic links to the same files
/// in Debian; symbolic links are skipped altogether). Subdirectories are not read: the
/// offensive fortunes of the fortunes-off package live in `off/`. A file is a list of
/// fortunes separated by lines holding only `%`; fortunes of nothing but white space are
/// dropped. `limit_bytes` > 0 keeps only the first that many bytes of the files (in that
/// order) before they are split into fortunes.
///
/// The split is fixed: fortune i (counted over all files) is held out when i % kHeldOutEvery
/// == kHeldOutEvery - 1. The files are grouped by topic, so a held-out tail would be one
/// topic; every 20th fortune has the corpus' own mix.
/// Errors: torchpar::Error naming `dir` when it does not exist, is not a directory or holds no
/// fortune (with how to install the package), naming a file that cannot be read.
FortuneCorpus load_fortunes(const std::string& dir, int64_t limit_bytes = 0);

/// Entropy of the byte distribution of `bytes` (uint8), in nats: the loss per byte of the
/// best model that ignores context (a unigram model), on the text it was counted on.
double unigram_entropy(const at::Tensor& bytes);

/// Cross-entropy, in nats per byte, of `text` under the byte frequencies of `counted_on` with
/// add-one smoothing (a byte never seen still has a probability): what a unigram model fitted
/// on the training split scores on held-out text.
double unigram_cross_entropy(const at::Tensor& counted_on, const at::Tensor& text);

}  // namespace torchpar::train
