// save_state_dict_file: what it writes load_state_dict_file reads back (mmap and not), and so does
// Python's torch.load (/usr/bin/python3 with python3-torch; skipped without it); dtypes, views and
// slices, a one-entry dict; refused entries and unwritable paths leave no file behind; hostile
// views (sizes, strides, offset that do not fit the storage) are refused naming the key.
#include <caffe2/serialize/inline_container.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "torchpar/parallel/state_dict.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

class SaveStateDict : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "torchpar_state_dict_XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (fs::path(dir_) / name).string(); }

  /// Entries of several dtypes, and tensors that are views of larger storages.
  static tp::StateDict sample() {
    at::manual_seed(0);
    const at::Tensor base = at::randn({64, 32});
    return {{"h.0.attn.c_attn.weight", at::randn({8, 24})},
            {"h.0.ln_1.bias", at::zeros({8})},
            {"wte.weight", at::randn({16, 8}).to(at::kBFloat16)},
            {"steps", at::arange(5, at::kLong)},
            {"transposed", base.t()},          // non-contiguous view
            {"slice", base.slice(0, 10, 12)},  // 2 of 64 rows of a storage
            {"scalar", at::scalar_tensor(3.5)},
            {"empty", at::empty({0, 4})}};
  }

  std::string dir_;
};

void expect_same(const tp::StateDict& want, const tp::StateDict& got) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, t] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    const at::Tensor& g = got.at(name);
    EXPECT_EQ(g.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(g.sizes(), t.sizes()) << name;
    EXPECT_TRUE(at::equal(g, t)) << name;
  }
}

TEST_F(SaveStateDict, LoadStateDictFileReadsItBack) {
  const auto sd = sample();
  tp::save_state_dict_file(sd, path("model.pt"));
  for (bool mmap : {true, false}) {
    SCOPED_TRACE(mmap ? "mmap" : "read");
    expect_same(sd, tp::load_state_dict_file(path("model.pt"), {.mmap = mmap}));
  }
  // The slice is stored alone, not with the 64 x 32 floats of its base (written twice else).
  EXPECT_LT(fs::file_size(path("model.pt")), 64 * 32 * sizeof(float) + 8 * 1024);
  EXPECT_FALSE(fs::exists(path(".model.pt.tmp")));
}

TEST_F(SaveStateDict, OneEntryAndOverwrite) {
  // Python writes a one-entry dict with SETITEM, which LibTorch 1.13 cannot read; this writer
  // uses SETITEMS for every dict.
  const tp::StateDict one{{"a", at::ones({3})}};
  tp::save_state_dict_file(one, path("one.pt"));
  expect_same(one, tp::load_state_dict_file(path("one.pt")));
  const tp::StateDict two{{"a", at::zeros({2})}, {"b", at::ones({1})}};
  tp::save_state_dict_file(two, path("one.pt"));  // replaces the file
  expect_same(two, tp::load_state_dict_file(path("one.pt")));
  tp::save_state_dict_file({}, path("none.pt"));
  EXPECT_TRUE(tp::load_state_dict_file(path("none.pt")).empty());
}

TEST_F(SaveStateDict, PythonTorchLoadReadsIt) {
  if (::access("/usr/bin/python3", X_OK) != 0 ||
      tp::run_program({"/usr/bin/python3", "-c", "import torch"}, {}, 120s) != 0)
    GTEST_SKIP() << "no /usr/bin/python3 with torch (Debian: python3-torch)";
  auto sd = sample();
  sd.erase("wte.weight");  // compared below in float64; bfloat16 is checked by its dtype only
  tp::save_state_dict_file(sd, path("model.pt"));
  tp::save_state_dict_file({{"w", at::ones({2, 2}, at::kBFloat16)}}, path("bf16.pt"));
  // Exit 0 when torch.load gives a plain dict equal to what the C++ side saved.
  const std::string script = fmt::format(
      "import sys, torch\n"
      "d = torch.load(sys.argv[1])\n"
      "assert type(d) is dict, type(d)\n"
      "assert sorted(d) == sorted({}), sorted(d)\n"
      "assert d['steps'].dtype == torch.int64 and d['steps'].tolist() == [0, 1, 2, 3, 4]\n"
      "assert d['transposed'].shape == (32, 64) and d['slice'].shape == (2, 32)\n"
      "assert torch.equal(d['slice'], d['transposed'].t()[10:12])\n"
      "assert d['scalar'].item() == 3.5 and d['empty'].shape == (0, 4)\n"
      "assert not d['h.0.attn.c_attn.weight'].requires_grad\n"
      "b = torch.load(sys.argv[2])\n"
      "assert b['w'].dtype == torch.bfloat16 and b['w'].sum().item() == 4\n",
      "['h.0.attn.c_attn.weight', 'h.0.ln_1.bias', 'steps', 'transposed', 'slice', 'scalar', "
      "'empty']");
  EXPECT_EQ(tp::run_program({"/usr/bin/python3", "-c", script, path("model.pt"), path("bf16.pt")},
                            {}, 120s),
            0);
}

TEST_F(SaveStateDict, RefusedEntriesAndPathsLeaveNothing) {
  try {
    tp::save_state_dict_file({{"ok", at::ones({2})}, {"hole", at::Tensor()}}, path("bad.pt"));
    ADD_FAILURE() << "an undefined tensor was saved";
  } catch (const tp::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("'hole'"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::is_empty(dir_));

  const std::string nowhere = path("no_such_dir/model.pt");
  try {
    tp::save_state_dict_file({{"a", at::ones({2})}}, nowhere);
    ADD_FAILURE() << "no error for a missing directory";
  } catch (const tp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no_such_dir"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::is_empty(dir_));
}

/// A view as a torch.save file states it (what a hostile file may claim).
struct View {
  int64_t storage_numel;  // floats in the storage, as the pickle says
  int64_t offset;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t record_floats = -1;  // floats in the storage's record; -1: storage_numel
};

/// The bytes of a torch.save archive of {key: float tensor with view `v`}, written opcode by
/// opcode as Python's pickler writes them (protocol 2), so that any view can be stated.
std::vector<char> torch_save_with_view(const std::string& key, const View& v) {
  std::string p = "\x80\x02}(";  // PROTO 2, EMPTY_DICT, MARK
  auto unicode = [&](const std::string& s) {
    const auto n = static_cast<uint32_t>(s.size());
    p += 'X';
    p.append(reinterpret_cast<const char*>(&n), 4);
    p += s;
  };
  auto long1 = [&](int64_t i) {  // LONG1, 8 bytes: the only length LibTorch reads
    p += "\x8a\x08";
    p.append(reinterpret_cast<const char*>(&i), 8);
  };
  auto tuple = [&](const std::vector<int64_t>& ints) {
    p += '(';
    for (const int64_t i : ints) long1(i);
    p += 't';
  };
  unicode(key);
  p += "ctorch._utils\n_rebuild_tensor_v2\n(";
  p += '(';
  unicode("storage");
  p += "ctorch\nFloatStorage\n";
  unicode("0");
  unicode("cpu");
  long1(v.storage_numel);
  p += "tQ";  // TUPLE, BINPERSID
  long1(v.offset);
  tuple(v.sizes);
  tuple(v.strides);
  p += "\x89";                           // NEWFALSE: requires_grad
  p += "ccollections\nOrderedDict\n)R";  // backward hooks
  p += "tRu.";                           // TUPLE, REDUCE, SETITEMS, STOP
  const int64_t floats = v.record_floats >= 0 ? v.record_floats : v.storage_numel;
  std::vector<float> storage(static_cast<size_t>(floats));
  for (size_t i = 0; i < storage.size(); ++i) storage[i] = static_cast<float>(i);
  std::vector<char> zip;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* b, size_t n) {
    zip.insert(zip.end(), static_cast<const char*>(b), static_cast<const char*>(b) + n);
    return n;
  });
  writer.writeRecord("data.pkl", p.data(), p.size());
  writer.writeRecord("data/0", storage.data(), storage.size() * sizeof(float));
  writer.writeEndOfFile();
  return zip;
}

class HostileView : public SaveStateDict {
 protected:
  std::string write(const View& v) {
    const auto bytes = torch_save_with_view("h.0.mlp.c_fc.weight", v);
    const std::string p = path("hostile.pt");
    std::FILE* f = std::fopen(p.c_str(), "wb");
    EXPECT_NE(f, nullptr);
    EXPECT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), f), bytes.size());
    std::fclose(f);
    return p;
  }
};

TEST_F(HostileView, AFifoIsRefusedAtOnce) {
  // open(O_RDONLY) of a FIFO waited for a writer, for ever; now fstat refuses it first.
  ASSERT_EQ(::mkfifo(path("fifo.pt").c_str(), 0600), 0);
  try {
    tp::load_state_dict_file(path("fifo.pt"));
    ADD_FAILURE() << "a FIFO was loaded";
  } catch (const tp::SerializationError& e) {
    EXPECT_NE(std::string(e.what()).find("not a regular file"), std::string::npos) << e.what();
  }
}

TEST_F(HostileView, AStatedViewThatFitsLoads) {
  // The hand-written archive is one LibTorch reads: a [2, 3] view at offset 2 of 8 floats.
  const std::string p =
      write({.storage_numel = 8, .offset = 2, .sizes = {2, 3}, .strides = {3, 1}});
  for (bool mmap : {true, false}) {
    const auto sd = tp::load_state_dict_file(p, {.mmap = mmap});
    EXPECT_TRUE(
        at::equal(sd.at("h.0.mlp.c_fc.weight"), at::arange(2, 8).view({2, 3}).to(at::kFloat)));
  }
}

TEST_F(HostileView, ViewsThatDoNotFitAreRefusedNamingTheKey) {
  const struct {
    const char* what;
    View view;
  } cases[] = {
      {"huge stride",
       {.storage_numel = 4, .offset = 0, .sizes = {2}, .strides = {int64_t{1} << 40}}},
      {"stride overflowing int64",
       {.storage_numel = 4, .offset = 0, .sizes = {3}, .strides = {INT64_MAX / 2 + 1}}},
      {"size * stride beyond the storage",
       {.storage_numel = 8, .offset = 0, .sizes = {4, 4}, .strides = {4, 1}}},
      {"negative stride", {.storage_numel = 4, .offset = 3, .sizes = {4}, .strides = {-1}}},
      {"negative size", {.storage_numel = 4, .offset = 0, .sizes = {-1}, .strides = {1}}},
      {"negative offset", {.storage_numel = 4, .offset = -2, .sizes = {2}, .strides = {1}}},
      {"offset beyond the storage",
       {.storage_numel = 4, .offset = 100, .sizes = {2}, .strides = {1}}},
      {"sizes and strides of different lengths",
       {.storage_numel = 4, .offset = 0, .sizes = {2, 2}, .strides = {1}}},
      {"elements overflowing int64",
       {.storage_numel = 4,
        .offset = 0,
        .sizes = {int64_t{1} << 40, int64_t{1} << 40},
        .strides = {0, 0}}},
      {"storage larger than its record",
       {.storage_numel = 1 << 20,
        .offset = 0,
        .sizes = {1 << 20},
        .strides = {1},
        .record_floats = 4}},
      {"negative storage size",
       {.storage_numel = -4, .offset = 0, .sizes = {2}, .strides = {1}, .record_floats = 4}},
  };
  for (const auto& c : cases) {
    const std::string p = write(c.view);
    for (bool mmap : {true, false}) {
      SCOPED_TRACE(fmt::format("{} ({})", c.what, mmap ? "mmap" : "read"));
      try {
        const auto sd = tp::load_state_dict_file(p, {.mmap = mmap});
        ADD_FAILURE() << "loaded, sizes " << sd.begin()->second.sizes() << " strides "
                      << sd.begin()->second.strides();
      } catch (const tp::SerializationError& e) {
        EXPECT_NE(std::string(e.what()).find("'h.0.mlp.c_fc.weight'"), std::string::npos)
            << e.what();
        if (mmap) std::printf("%s: %s\n", c.what, e.what());
      }
    }
  }
}

}  // namespace
