// save_state_dict_file: what it writes load_state_dict_file reads back (mmap and not), and so does
// Python's torch.load (/usr/bin/python3 with python3-torch; skipped without it); dtypes, views and
// slices, a one-entry dict; refused entries and unwritable paths leave no file behind.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
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

}  // namespace
