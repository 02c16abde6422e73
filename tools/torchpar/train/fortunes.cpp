#include "fortunes.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "torchpar/core/error.h"

namespace torchpar::train {
namespace {

namespace fs = std::filesystem;

constexpr const char* kInstallFortunes =
    "install the corpus with scripts/install-deps.sh (Debian package fortunes) or pass --data "
    "DIR";

bool ends_with(const std::string& s, std::string_view tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

/// The fortune files of `dir`, in name order (see load_fortunes).
std::vector<fs::path> fortune_files(const std::string& dir) {
  std::error_code ec;
  const auto status = fs::status(dir, ec);
  if (ec || !fs::exists(status))
    throw Error(fmt::format("no fortunes: {} does not exist ({})", dir, kInstallFortunes));
  if (!fs::is_directory(status))
    throw Error(fmt::format("no fortunes: {} is not a directory ({})", dir, kInstallFortunes));
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || name[0] == '.' || ends_with(name, ".dat") || ends_with(name, ".u8"))
      continue;
    if (!entry.is_regular_file() || entry.is_symlink()) continue;
    files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::string read_file(const fs::path& path, size_t most) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error(fmt::format("cannot open {}: {}", path.string(), std::strerror(errno)));
  std::string text;
  text.resize(most);
  f.read(text.data(), static_cast<std::streamsize>(most));
  if (f.bad()) throw Error(fmt::format("cannot read {}: {}", path.string(), std::strerror(errno)));
  text.resize(static_cast<size_t>(f.gcount()));
  return text;
}

bool blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return std::isspace(uint8_t(c)) != 0; });
}

/// Calls add(fortune) for every fortune of `text`: the lines between lines holding only "%".
/// A fortune keeps its lines' newlines; one that ends without one gets one.
template <class Add>
void split_fortunes(std::string_view text, Add&& add) {
  size_t start = 0;  // first byte of the current fortune
  size_t line = 0;   // first byte of the current line
  auto flush = [&](size_t end) {
    std::string_view f = text.substr(start, end - start);
    if (!blank(f)) add(f);
  };
  while (line < text.size()) {
    size_t eol = text.find('\n', line);
    const size_t next = eol == std::string_view::npos ? text.size() : eol + 1;
    if (eol == std::string_view::npos) eol = text.size();
    std::string_view l = text.substr(line, eol - line);
    if (!l.empty() && l.back() == '\r') l.remove_suffix(1);
    if (l == "%") {
      flush(line);
      start = next;
    }
    line = next;
  }
  flush(text.size());
}

at::Tensor to_tensor(const std::string& bytes) {
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) std::memcpy(t.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  return t;
}

/// Occurrences of each byte value: double [256].
at::Tensor byte_counts(const at::Tensor& bytes) {
  return at::bincount(bytes.to(at::kLong), {}, 256).to(at::kDouble);
}

}  // namespace

FortuneCorpus load_fortunes(const std::string& dir, int64_t limit_bytes) {
  const auto files = fortune_files(dir);
  FortuneCorpus c;
  std::string train, val;
  for (const auto& path : files) {
    size_t most = static_cast<size_t>(fs::file_size(path));
    if (limit_bytes > 0) most = std::min(most, static_cast<size_t>(limit_bytes - c.bytes));
    const std::string text = read_file(path, most);
    c.bytes += static_cast<int64_t>(text.size());
    ++c.files;
    split_fortunes(text, [&](std::string_view fortune) {
      std::string& split = c.fortunes % kHeldOutEvery == kHeldOutEvery - 1 ? val : train;
      split.append(fortune);
      if (split.back() != '\n') split.push_back('\n');
      split.append("%\n");
      ++c.fortunes;
    });
    if (limit_bytes > 0 && c.bytes >= limit_bytes) break;
  }
  if (c.fortunes == 0)
    throw Error(fmt::format(
        "no fortunes in {}: it holds no fortune files (text files of fortunes separated by '%' "
        "lines; *.dat, *.u8, hidden files, symbolic links and subdirectories are skipped) ({})",
        dir, kInstallFortunes));
  c.train = to_tensor(train);
  c.val = to_tensor(val);
  return c;
}

double unigram_entropy(const at::Tensor& bytes) {
  const at::Tensor n = byte_counts(bytes);
  const at::Tensor p = n.masked_select(n > 0) / n.sum();
  return -(p * p.log()).sum().item<double>();
}

double unigram_cross_entropy(const at::Tensor& counted_on, const at::Tensor& text) {
  const at::Tensor n = byte_counts(counted_on);
  const at::Tensor log_p = ((n + 1) / (n.sum() + 256)).log();
  const at::Tensor m = byte_counts(text);
  return -(m * log_p).sum().item<double>() / std::max(1.0, m.sum().item<double>());
}

}  // namespace torchpar::train
