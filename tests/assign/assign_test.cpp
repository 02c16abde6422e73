// Model placement: machin's test_estimator and test_assigner cases (seed 0, device tables
// injected so the GPU cases run on a CPU-only machine, model sizes from meta tensors so a
// 600 MiB model takes no memory), every dtype of the estimator, the 0/0 guards machin lacks,
// device filtering, option errors, and the real probe on this machine.

#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include <cmath>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "torchpar/assign/device_info.h"
#include "torchpar/assign/model_assigner.h"
#include "torchpar/assign/model_size_estimator.h"
#include "torchpar/core/error.h"

namespace tp = torchpar;

namespace {

constexpr int64_t kMiB = 1024 * 1024;

// A module whose one float32 buffer takes `mib` MiB, on the meta device (no memory).
std::shared_ptr<torch::nn::Module> model_of_mib(int64_t mib) {
  auto m = std::make_shared<torch::nn::Module>();
  m->register_buffer("data", at::empty({mib * kMiB / 4}, at::device(at::kMeta).dtype(at::kFloat)));
  return m;
}

// machin's mocks: GPUs of `gpus_mib` free MiB at load 0, a CPU of `cpu_mib` available MiB.
std::vector<tp::DeviceInfo> table(const std::vector<int64_t>& gpus_mib, int64_t cpu_mib) {
  std::vector<tp::DeviceInfo> t{{.name = "cpu", .total_memory_bytes = cpu_mib * kMiB}};
  for (size_t i = 0; i < gpus_mib.size(); ++i) {
    t.push_back({.name = "cuda:" + std::to_string(i),
                 .total_memory_bytes = gpus_mib[i] * kMiB,
                 .compute_power = 1.0});
  }
  return t;
}

std::vector<c10::Device> devs(const std::vector<std::string>& names) {
  return {names.begin(), names.end()};
}

std::vector<std::string> names(const std::vector<c10::Device>& d) {
  std::vector<std::string> out;
  for (const auto& x : d) out.push_back(x.str());
  return out;
}

// machin's test_assigner parameters, apart from what each case changes.
tp::ModelAssignerOptions machin_options(std::vector<tp::DeviceInfo> device_table) {
  return {.model_size_multiplier = 1,
          .max_mem_ratio = 0.7,
          .cpu_weight = 0.1,
          .connection_weight = 1,
          .size_match_weight = 1e-2,
          .complexity_match_weight = 10,
          .entropy_weight = 1,
          .iterations = 500,
          .update_rate = 0.01,
          .gpu_gpu_distance = 1,
          .cpu_gpu_distance = 10,
          .move_models = false,  // meta tensors; machin's mocks ignore `to` as well
          .seed = 0,
          .device_table = std::move(device_table)};
}

void expect_finite_rows(const at::Tensor& placement) {
  EXPECT_TRUE(placement.isfinite().all().item<bool>()) << placement;
  EXPECT_TRUE(at::allclose(placement.sum(1), at::ones({placement.size(0)}))) << placement;
}

}  // namespace

// ---- ModelSizeEstimator -----------------------------------------------------------------

TEST(ModelSizeEstimator, MachinCase) {
  auto model = std::make_shared<torch::nn::Module>();
  model->register_parameter("param1", at::zeros({10}, at::kChar), /*requires_grad=*/false);
  model->register_parameter("param2", at::zeros({10}, at::kShort), false);
  model->register_parameter("param3", at::zeros({10}, at::kInt), false);
  model->register_parameter("param4", at::zeros({10}, at::kDouble), false);
  model->register_buffer("buffer1", at::zeros({10}, at::kFloat));
  tp::ModelSizeEstimator est(model, /*size_multiplier=*/1);
  EXPECT_EQ(est.get_buffer_sizes(), (10 * 4) / double(kMiB));
  EXPECT_EQ(est.get_parameter_sizes(), (10 * 1 + 10 * 2 + 10 * 4 + 10 * 8) / double(kMiB));
  EXPECT_EQ(est.estimate_size(), (10 * 1 + 10 * 2 + 10 * 4 + 10 * 8 + 10 * 4) / double(kMiB));
  EXPECT_EQ(tp::ModelSizeEstimator(model, 2).estimate_size(), 2 * 190 / double(kMiB));
}

TEST(ModelSizeEstimator, EveryDtype) {
  using ST = c10::ScalarType;
  const std::vector<std::pair<ST, int64_t>> bytes_of_ten = {
      {ST::Bool, 10},           {ST::Byte, 10},        {ST::Char, 10},
      {ST::Short, 20},          {ST::Int, 40},         {ST::Long, 80},
      {ST::Half, 20},           {ST::BFloat16, 20},    {ST::Float, 40},
      {ST::Double, 80},         {ST::ComplexHalf, 40}, {ST::ComplexFloat, 80},
      {ST::ComplexDouble, 160}, {ST::QInt8, 10},       {ST::QUInt8, 10},
      {ST::QInt32, 40},         {ST::QUInt4x2, 5},     {ST::QUInt2x4, 3}};
  for (const auto& [dtype, expected] : bytes_of_ten) {
    EXPECT_EQ(tp::ModelSizeEstimator::nbytes({10}, dtype), expected) << c10::toString(dtype);
  }
  // Every ScalarType LibTorch defines is covered by the table above (NumOptions also counts
  // Undefined, which has no size).
  EXPECT_EQ(bytes_of_ten.size() + 1, static_cast<size_t>(ST::NumOptions));
  // Sub-byte types round each innermost row up to a byte: 3 rows of 5 values.
  EXPECT_EQ(tp::ModelSizeEstimator::nbytes({3, 5}, ST::QUInt4x2), 3 * 3);
  EXPECT_EQ(tp::ModelSizeEstimator::nbytes({3, 5}, ST::QUInt2x4), 3 * 2);
  EXPECT_EQ(tp::ModelSizeEstimator::nbytes({}, ST::Float), 4);
  EXPECT_EQ(tp::ModelSizeEstimator::nbytes({0, 7}, ST::Double), 0);
  EXPECT_THROW(tp::ModelSizeEstimator::nbytes({10}, ST::Undefined), tp::ValueError);

  // machin raises on bfloat16 and counts complex32 as 8 bytes; through a module here.
  auto model = std::make_shared<torch::nn::Module>();
  model->register_buffer("bf16", at::empty({10}, at::kBFloat16));
  model->register_buffer("c32", at::empty({10}, at::kComplexHalf));
  model->register_buffer("c128", at::empty({10}, at::kComplexDouble));
  EXPECT_EQ(tp::ModelSizeEstimator(model, 1).get_buffer_sizes(), (20 + 40 + 160) / double(kMiB));
}

TEST(ModelSizeEstimator, SharedTensorsCountOnceAndUndefinedBuffersZero) {
  auto parent = std::make_shared<torch::nn::Module>();
  torch::nn::Linear shared(4, 4);  // 16 + 4 floats
  parent->register_module("a", shared);
  parent->register_module("b", shared);
  parent->register_buffer("nothing", at::Tensor());
  tp::ModelSizeEstimator est(parent, 1);
  EXPECT_EQ(est.get_parameter_sizes(), 20 * 4 / double(kMiB));
  EXPECT_EQ(est.get_buffer_sizes(), 0.0);
  // Meta tensors count as if allocated; a module holder works as well.
  EXPECT_EQ(tp::ModelSizeEstimator(model_of_mib(600), 1).estimate_size(), 600.0);
  EXPECT_EQ(tp::ModelSizeEstimator(shared, 3).estimate_size(), 3 * 20 * 4 / double(kMiB));
  EXPECT_THROW(tp::ModelSizeEstimator(parent, -1), tp::ValueError);
  EXPECT_THROW(tp::ModelSizeEstimator(std::shared_ptr<torch::nn::Module>(), 1), tp::ValueError);
}

// ---- ModelAssigner: machin's test_assigner ----------------------------------------------

struct MachinCase {
  std::string name;
  int64_t model_mib;
  std::optional<std::vector<std::string>> devices;
  std::vector<int64_t> gpus_mib;
  int64_t cpu_mib;
  double connection_weight;
  double complexity_match_weight;
  std::set<std::vector<std::string>> accepted;  // empty: an error is expected
};

class MachinAssignerCase : public ::testing::TestWithParam<MachinCase> {};

TEST_P(MachinAssignerCase, Assigns) {
  const MachinCase& c = GetParam();
  auto options = machin_options(table(c.gpus_mib, c.cpu_mib));
  options.connection_weight = c.connection_weight;
  options.complexity_match_weight = c.complexity_match_weight;
  std::optional<std::vector<c10::Device>> devices;
  if (c.devices) devices = devs(*c.devices);
  auto make = [&] {
    return tp::ModelAssigner({model_of_mib(c.model_mib), model_of_mib(c.model_mib)},
                             {{{0, 1}, 1.0}}, devices, options);
  };
  if (c.accepted.empty()) {
    try {
      make();
      ADD_FAILURE() << "no error";
    } catch (const tp::Error& e) {
      EXPECT_EQ(std::string(e.what()),
                "Estimated model will use 200.00 MB, but only have 14.00 MB allowed memory in "
                "total.");
    }
    return;
  }
  const tp::ModelAssigner assigner = make();
  EXPECT_TRUE(c.accepted.count(names(assigner.assignment())))
      << ::testing::PrintToString(names(assigner.assignment())) << "\n"
      << assigner.placement();
  expect_finite_rows(assigner.placement());
  EXPECT_EQ(assigner.model_sizes(),
            (std::vector<double>{double(c.model_mib), double(c.model_mib)}));
}

const std::vector<std::string> kMachinDevices{"cuda:0", "cuda:1", "cpu"};

INSTANTIATE_TEST_SUITE_P(Machin, MachinAssignerCase,
                         ::testing::Values(
                             // Two small models, a strong complexity match: one on each GPU.
                             MachinCase{.name = "SmallModelsSpread",
                                        .model_mib = 10,
                                        .devices = kMachinDevices,
                                        .gpus_mib = {1000, 1000},
                                        .cpu_mib = 1000,
                                        .connection_weight = 1,
                                        .complexity_match_weight = 10,
                                        .accepted = {{"cuda:0", "cuda:1"}, {"cuda:1", "cuda:0"}}},
                             // A strong connection: both on one GPU.
                             MachinCase{.name = "ConnectedModelsPacked",
                                        .model_mib = 10,
                                        .devices = kMachinDevices,
                                        .gpus_mib = {1000, 1000},
                                        .cpu_mib = 1000,
                                        .connection_weight = 10,
                                        .complexity_match_weight = 1,
                                        .accepted = {{"cuda:0", "cuda:0"}, {"cuda:1", "cuda:1"}}},
                             // 600 MiB each, 700 MiB allowed per GPU: split.
                             MachinCase{.name = "LargeModelsSplit",
                                        .model_mib = 600,
                                        .devices = kMachinDevices,
                                        .gpus_mib = {1000, 1000},
                                        .cpu_mib = 1000,
                                        .connection_weight = 1,
                                        .complexity_match_weight = 10,
                                        .accepted = {{"cuda:1", "cuda:0"}, {"cuda:0", "cuda:1"}}},
                             // cuda:1 does not exist: both on cuda:0, not on the weak CPU.
                             MachinCase{.name = "OneGpu",
                                        .model_mib = 10,
                                        .devices = kMachinDevices,
                                        .gpus_mib = {1000},
                                        .cpu_mib = 1000,
                                        .connection_weight = 1,
                                        .complexity_match_weight = 10,
                                        .accepted = {{"cuda:0", "cuda:0"}}},
                             MachinCase{.name = "NoGpu",
                                        .model_mib = 10,
                                        .devices = kMachinDevices,
                                        .gpus_mib = {},
                                        .cpu_mib = 1000,
                                        .connection_weight = 1,
                                        .complexity_match_weight = 10,
                                        .accepted = {{"cpu", "cpu"}}},
                             MachinCase{.name = "NoGpuNoDevices",
                                        .model_mib = 10,
                                        .devices = std::nullopt,
                                        .gpus_mib = {},
                                        .cpu_mib = 1000,
                                        .connection_weight = 1,
                                        .complexity_match_weight = 10,
                                        .accepted = {{"cpu", "cpu"}}},
                             // 200 MiB against 0.7 * (10 + 10) MiB: an error.
                             MachinCase{.name = "Oversize",
                                        .model_mib = 100,
                                        .devices = kMachinDevices,
                                        .gpus_mib = {10},
                                        .cpu_mib = 10,
                                        .connection_weight = 1,
                                        .complexity_match_weight = 10,
                                        .accepted = {}}),
                         [](const ::testing::TestParamInfo<MachinCase>& p) {
                           return p.param.name;
                         });

// ---- ModelAssigner: what machin gets wrong, devices, options ----------------------------

TEST(ModelAssigner, OneDeviceNoConnectionsAndPowerlessCpuStayFinite) {
  // machin divides 0 by 0 in each of these: its placement turns NaN.
  auto options = machin_options(table({}, 1000));
  const tp::ModelAssigner one_device({model_of_mib(10), model_of_mib(10)}, {{{0, 1}, 1.0}},
                                     devs({"cpu"}), options);
  expect_finite_rows(one_device.placement());
  EXPECT_TRUE(at::equal(one_device.placement(), at::ones({2, 1})));

  options.device_table = table({1000, 1000}, 1000);
  const tp::ModelAssigner unconnected({model_of_mib(10), model_of_mib(10)}, {},
                                      devs({"cuda:0", "cuda:1"}), options);
  expect_finite_rows(unconnected.placement());

  options.device_table = table({}, 1000);
  options.cpu_weight = 0;  // machin's default: no compute power anywhere
  const tp::ModelAssigner powerless({model_of_mib(10)}, {}, std::nullopt, options);
  expect_finite_rows(powerless.placement());
  EXPECT_EQ(names(powerless.assignment()), std::vector<std::string>{"cpu"});

  // Empty models (complexity sum 0) and no models at all.
  options.device_table = table({1000, 1000}, 1000);
  const tp::ModelAssigner empty({std::make_shared<torch::nn::Module>()}, {}, std::nullopt, options);
  expect_finite_rows(empty.placement());
  const tp::ModelAssigner none({}, {}, std::nullopt, options);
  EXPECT_TRUE(none.assignment().empty());
  EXPECT_EQ(none.placement().size(0), 0);
}

TEST(ModelAssigner, DeviceSelection) {
  auto options = machin_options(table({1000, 1000}, 1000));
  // nullopt: every GPU, least busy first, and no CPU.
  (*options.device_table)[1].compute_power = 0.2;
  const tp::ModelAssigner all({model_of_mib(10)}, {}, std::nullopt, options);
  EXPECT_EQ(names(all.devices()), (std::vector<std::string>{"cuda:1", "cuda:0"}));
  EXPECT_TRUE(all.removed_devices().empty());

  // Missing GPUs are dropped and reported; "cuda" is cuda:0; duplicates count once.
  const tp::ModelAssigner some({model_of_mib(10)}, {},
                               devs({"cuda:3", "cuda", "cuda:0", "cpu", "cuda:2"}), options);
  EXPECT_EQ(names(some.devices()), (std::vector<std::string>{"cuda:0", "cpu"}));
  EXPECT_EQ(names(some.removed_devices()), (std::vector<std::string>{"cuda:3", "cuda:2"}));

  // Only cpu and cuda; a table without "cpu" when the CPU is the fallback.
  EXPECT_THROW(tp::ModelAssigner({model_of_mib(10)}, {},
                                 std::vector<c10::Device>{c10::Device(c10::kMeta)}, options),
               tp::ValueError);
  options.device_table = std::vector<tp::DeviceInfo>{{.name = "cuda:0"}};
  EXPECT_THROW(tp::ModelAssigner({model_of_mib(10)}, {}, devs({"cuda:1"}), options),
               tp::ValueError);
  options.device_table = std::vector<tp::DeviceInfo>{{.name = "not a device"}};
  EXPECT_THROW(tp::ModelAssigner({model_of_mib(10)}, {}, std::nullopt, options), tp::ValueError);
}

TEST(ModelAssigner, OptionAndConnectionErrors) {
  const auto base = machin_options(table({1000}, 1000));
  auto with = [&](auto set) {
    auto o = base;
    set(o);
    return o;
  };
  auto assign = [](const tp::ModelAssignerOptions& o, tp::ModelConnection conn = {}) {
    return tp::ModelAssigner({model_of_mib(1), model_of_mib(1)}, std::move(conn), std::nullopt, o);
  };
  EXPECT_THROW(assign(with([](auto& o) { o.max_mem_ratio = 0; })), tp::ValueError);
  EXPECT_THROW(assign(with([](auto& o) { o.max_mem_ratio = 1.5; })), tp::ValueError);
  EXPECT_THROW(assign(with([](auto& o) { o.cpu_weight = -1; })), tp::ValueError);
  EXPECT_THROW(assign(with([](auto& o) { o.entropy_weight = std::nan(""); })), tp::ValueError);
  EXPECT_THROW(assign(with([](auto& o) { o.iterations = -1; })), tp::ValueError);
  EXPECT_THROW(assign(with([](auto& o) { o.update_rate = 0; })), tp::ValueError);
  EXPECT_THROW(assign(with([](auto& o) { o.gpu_gpu_distance = 0; })), tp::ValueError);
  EXPECT_THROW(assign(with([](auto& o) { o.cpu_gpu_distance = -10; })), tp::ValueError);
  EXPECT_THROW(assign(base, {{{0, 2}, 1.0}}), tp::ValueError);
  EXPECT_THROW(assign(base, {{{-1, 0}, 1.0}}), tp::ValueError);
  EXPECT_THROW(assign(base, {{{0, 1}, -1.0}}), tp::ValueError);
  EXPECT_THROW(tp::ModelAssigner({model_of_mib(1), nullptr}, {}, std::nullopt, base),
               tp::ValueError);
  EXPECT_NO_THROW(assign(base, {{{0, 1}, 0.0}, {{1, 0}, 2.0}, {{1, 1}, 1.0}}));
}

TEST(ModelAssigner, SeededPrivatelyAndUnderNoGrad) {
  const auto options = machin_options(table({1000, 1000}, 1000));
  torch::manual_seed(123);
  const at::Tensor expected = at::randn({4});
  torch::manual_seed(123);
  const tp::ModelAssigner a({model_of_mib(10), model_of_mib(10)}, {{{0, 1}, 1.0}}, std::nullopt,
                            options);
  EXPECT_TRUE(at::equal(at::randn({4}), expected)) << "the global generator was used";

  torch::NoGradGuard no_grad;
  const tp::ModelAssigner b({model_of_mib(10), model_of_mib(10)}, {{{0, 1}, 1.0}}, std::nullopt,
                            options);
  EXPECT_TRUE(at::equal(a.placement(), b.placement()));
  auto other_seed = options;
  other_seed.seed = 1;
  other_seed.iterations = 0;
  const tp::ModelAssigner c({model_of_mib(10), model_of_mib(10)}, {{{0, 1}, 1.0}}, std::nullopt,
                            other_seed);
  expect_finite_rows(c.placement());
}

// ---- The real probe and the default path on this machine --------------------------------

TEST(ProbeDevices, CpuFirstThenGpus) {
  const auto devices = tp::probe_devices();
  ASSERT_FALSE(devices.empty());
  EXPECT_EQ(devices[0].name, "cpu");
  EXPECT_GT(devices[0].total_memory_bytes, 0);
  EXPECT_GT(devices[0].free_memory_bytes(), 0);
  EXPECT_FALSE(devices[0].compute_power);
  for (size_t i = 1; i < devices.size(); ++i) {
    EXPECT_EQ(devices[i].name, "cuda:" + std::to_string(i - 1));
  }
}

TEST(ModelAssigner, DefaultProbeAndMove) {
  // Whatever this machine has: small real models fit, and end on the device assigned.
  auto a = std::make_shared<torch::nn::Module>();
  auto b = std::make_shared<torch::nn::Module>();
  a->register_module("fc", torch::nn::Linear(8, 8));
  b->register_module("fc", torch::nn::Linear(8, 2));
  const tp::ModelAssigner assigner({a, b}, {{{0, 1}, 1.0}}, std::nullopt,
                                   {.iterations = 50, .move_models = true});
  ASSERT_EQ(assigner.assignment().size(), 2U);
  EXPECT_EQ(a->parameters()[0].device(), assigner.assignment()[0]);
  EXPECT_EQ(b->parameters()[0].device(), assigner.assignment()[1]);
}
