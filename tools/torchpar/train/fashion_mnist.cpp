#include "fashion_mnist.h"

#include <fmt/format.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <vector>

#include "torchpar/core/error.h"

namespace torchpar::train {
namespace {

constexpr const char* kInstallFashionMnist =
    "install the data set with scripts/install-deps.sh (Debian package dataset-fashion-mnist) "
    "or pass --data DIR";

struct GzCloser {
  void operator()(gzFile f) const { gzclose(f); }
};

/// Reads exactly n bytes or throws naming the file and what was short.
void read_exact(gzFile f, const std::string& path, void* dst, size_t n, const char* what) {
  size_t got = 0;
  while (got < n) {
    const unsigned ask = static_cast<unsigned>(std::min<size_t>(n - got, 1u << 30));
    const int r = gzread(f, static_cast<char*>(dst) + got, ask);
    if (r < 0) {
      int errnum = 0;
      const char* msg = gzerror(f, &errnum);
      throw Error(fmt::format("{}: corrupt gzip data while reading {}: {} ({})", path, what,
                              msg ? msg : "?", kInstallFashionMnist));
    }
    if (r == 0) {
      throw Error(fmt::format("{}: truncated: {} needs {} bytes, the file has {} ({})", path, what,
                              n, got, kInstallFashionMnist));
    }
    got += static_cast<size_t>(r);
  }
}

uint32_t big_endian(const unsigned char* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

}  // namespace

at::Tensor read_idx_gz(const std::string& path, int expected_dims, int64_t max_items,
                       int64_t* items_in_file) {
  std::unique_ptr<gzFile_s, GzCloser> f(gzopen(path.c_str(), "rb"));
  if (!f) {
    throw Error(fmt::format("{}: cannot open: {} ({})", path,
                            errno ? std::strerror(errno) : "not readable", kInstallFashionMnist));
  }
  unsigned char head[4];
  read_exact(f.get(), path, head, 4, "the idx header");
  const uint32_t magic = big_endian(head);
  const uint32_t want = 0x800u | static_cast<uint32_t>(expected_dims);
  if (magic != want) {
    throw Error(
        fmt::format("{}: not an idx file of {} ubyte dimensions (magic 0x{:08x}, expected "
                    "0x{:08x}) ({})",
                    path, expected_dims, magic, want, kInstallFashionMnist));
  }
  std::vector<int64_t> dims;
  uint64_t total = 1;
  for (int d = 0; d < expected_dims; ++d) {
    read_exact(f.get(), path, head, 4, "the idx dimensions");
    const uint32_t v = big_endian(head);
    if (v == 0 || v > (1u << 24)) {
      throw Error(fmt::format("{}: implausible dimension {} = {}", path, d, v));
    }
    dims.push_back(v);
    total *= v;
  }
  if (total > (1ull << 32)) throw Error(fmt::format("{}: {} bytes is too large", path, total));
  if (items_in_file != nullptr) *items_in_file = dims[0];
  if (max_items > 0 && max_items < dims[0]) {
    total = total / static_cast<uint64_t>(dims[0]) * static_cast<uint64_t>(max_items);
    dims[0] = max_items;
  }
  at::Tensor t = at::empty(dims, at::kByte);
  read_exact(f.get(), path, t.data_ptr(), total, expected_dims == 1 ? "the labels" : "the images");
  return t;
}

namespace {

Split read_split(const std::string& dir, const std::string& prefix, int64_t limit) {
  const std::string img = fmt::format("{}/{}-images-idx3-ubyte.gz", dir, prefix);
  const std::string lab = fmt::format("{}/{}-labels-idx1-ubyte.gz", dir, prefix);
  Split s;
  int64_t images_in_file = 0, labels_in_file = 0;
  s.images = read_idx_gz(img, 3, limit, &images_in_file);
  if (s.images.size(1) != 28 || s.images.size(2) != 28) {
    throw Error(fmt::format("{}: images are {}x{}, expected 28x28", img, s.images.size(1),
                            s.images.size(2)));
  }
  at::Tensor labels = read_idx_gz(lab, 1, limit, &labels_in_file);
  if (labels_in_file != images_in_file) {
    throw Error(
        fmt::format("{}: {} labels for {} images in {}", lab, labels_in_file, images_in_file, img));
  }
  if (labels.max().item<int64_t>() > 9) {
    throw Error(fmt::format("{}: a label is above 9", lab));
  }
  s.labels = labels.to(at::kLong);
  return s;
}

}  // namespace

FashionMnist load_fashion_mnist(const std::string& dir, int64_t train_limit) {
  FashionMnist d;
  d.train = read_split(dir, "train", train_limit);
  d.test = read_split(dir, "t10k", 0);
  return d;
}

at::Tensor normalize(const at::Tensor& images) {
  return images.to(at::kFloat).div_(255.0).sub_(0.2860).div_(0.3530).unsqueeze(1);
}

}  // namespace torchpar::train
