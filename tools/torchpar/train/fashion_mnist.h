#pragma once
// Fashion-MNIST from its four idx .gz files (Debian's dataset-fashion-mnist), read with zlib.

#include <ATen/ATen.h>

#include <string>

namespace torchpar::train {

/// One split: images uint8 [N, 28, 28], labels int64 [N].
struct Split {
  at::Tensor images;
  at::Tensor labels;
  int64_t size() const { return labels.numel(); }
};

struct FashionMnist {
  Split train;
  Split test;
};

/// Where the data set lives when nothing else is said.
inline constexpr const char* kDefaultDataDir = "/usr/share/datasets/fashion-mnist";

/// Reads train-{images-idx3,labels-idx1}-ubyte.gz and t10k-... from `dir`.
/// Throws torchpar::Error naming the file for a missing, unreadable, truncated or non-idx
/// file (wrong magic, bad dimensions, label count different from image count, labels > 9),
/// and how to install the data set. `train_limit` > 0: only the first train_limit training
/// samples are decompressed and kept (--limit; the test split stays whole).
FashionMnist load_fashion_mnist(const std::string& dir, int64_t train_limit = 0);

/// Reads one idx file: uint8 images [N, rows, cols] (magic 0x803) or labels [N] (0x801),
/// only the first `max_items` items when max_items > 0 (the rest is not decompressed).
/// `items_in_file`, when given, receives the N the header announces.
at::Tensor read_idx_gz(const std::string& path, int expected_dims, int64_t max_items = 0,
                       int64_t* items_in_file = nullptr);

/// uint8 images [B, 28, 28] -> float [B, 1, 28, 28], (x/255 - 0.2860) / 0.3530.
at::Tensor normalize(const at::Tensor& images);

}  // namespace torchpar::train
