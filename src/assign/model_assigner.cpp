#include "torchpar/assign/model_assigner.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>
#include <torch/optim/adam.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "torchpar/assign/model_size_estimator.h"
#include "torchpar/core/error.h"

namespace torchpar {
namespace {

constexpr double kBytesPerMiB = 1024.0 * 1024.0;

// One column of the placement problem.
struct Candidate {
  c10::Device device;
  double capacity_mib;  // floor(free MiB) * max_mem_ratio
  double power;         // compute power relative to one idle GPU
};

void check_option(bool ok, const char* name, double value, const char* rule) {
  if (!ok) throw ValueError(fmt::format("ModelAssigner: {} must be {}, got {}", name, rule, value));
}

void check_options(const ModelAssignerOptions& o) {
  check_option(o.model_size_multiplier >= 0, "model_size_multiplier", o.model_size_multiplier,
               ">= 0");
  check_option(o.max_mem_ratio > 0 && o.max_mem_ratio <= 1, "max_mem_ratio", o.max_mem_ratio,
               "in (0, 1]");
  check_option(o.cpu_weight >= 0, "cpu_weight", o.cpu_weight, ">= 0");
  check_option(o.connection_weight >= 0, "connection_weight", o.connection_weight, ">= 0");
  check_option(o.size_match_weight >= 0, "size_match_weight", o.size_match_weight, ">= 0");
  check_option(o.complexity_match_weight >= 0, "complexity_match_weight", o.complexity_match_weight,
               ">= 0");
  check_option(o.entropy_weight >= 0, "entropy_weight", o.entropy_weight, ">= 0");
  check_option(o.iterations >= 0, "iterations", static_cast<double>(o.iterations), ">= 0");
  check_option(o.update_rate > 0, "update_rate", o.update_rate, "> 0");
  check_option(o.gpu_gpu_distance > 0, "gpu_gpu_distance", o.gpu_gpu_distance, "> 0");
  check_option(o.cpu_gpu_distance > 0, "cpu_gpu_distance", o.cpu_gpu_distance, "> 0");
}

// cpu and cuda only; "cuda" means cuda:0, and the CPU has no index.
c10::Device normalize(c10::Device d, const char* where) {
  if (d.is_cpu()) return c10::Device(c10::kCPU);
  if (d.is_cuda()) return c10::Device(c10::kCUDA, d.has_index() ? d.index() : 0);
  throw ValueError(fmt::format(
      "ModelAssigner: {} device {}: only cpu and cuda devices can be assigned", where, d.str()));
}

c10::Device parse_table_name(const std::string& name) {
  try {
    return normalize(c10::Device(name), "device table");
  } catch (const ValueError&) {
    throw;
  } catch (const c10::Error&) {
    throw ValueError(fmt::format("ModelAssigner: device table name '{}' is not a device", name));
  }
}

// The columns of the problem: the devices asked for that the table has (or its GPUs, least
// busy first), else the CPU; with their capacity and compute power.
std::vector<Candidate> choose_devices(const std::optional<std::vector<c10::Device>>& asked,
                                      const std::vector<DeviceInfo>& table,
                                      const ModelAssignerOptions& o,
                                      std::vector<c10::Device>& removed) {
  std::vector<std::pair<c10::Device, const DeviceInfo*>> known;
  for (const auto& info : table) known.emplace_back(parse_table_name(info.name), &info);
  auto find = [&](c10::Device d) -> const DeviceInfo* {
    for (const auto& [dev, info] : known) {
      if (dev == d) return info;
    }
    return nullptr;
  };

  std::vector<c10::Device> chosen;
  if (asked) {
    for (const auto& raw : *asked) {
      const auto d = normalize(raw, "requested");
      if (std::find(chosen.begin(), chosen.end(), d) != chosen.end()) continue;
      if (d.is_cuda() && find(d) == nullptr) {
        removed.push_back(d);
        continue;
      }
      chosen.push_back(d);
    }
  } else {
    std::vector<std::pair<c10::Device, double>> gpus;
    for (const auto& [dev, info] : known) {
      if (dev.is_cuda()) gpus.emplace_back(dev, info->compute_power.value_or(1.0));
    }
    std::stable_sort(gpus.begin(), gpus.end(),
                     [](const auto& a, const auto& b) { return a.second > b.second; });
    for (const auto& g : gpus) {
      if (std::find(chosen.begin(), chosen.end(), g.first) == chosen.end()) {
        chosen.push_back(g.first);
      }
    }
  }
  if (chosen.empty()) chosen.emplace_back(c10::kCPU);

  std::vector<Candidate> out;
  for (const auto& d : chosen) {
    const DeviceInfo* info = find(d);
    if (info == nullptr) {
      throw ValueError("ModelAssigner: the device table has no \"cpu\" entry");
    }
    const double power = info->compute_power.value_or(d.is_cpu() ? o.cpu_weight : 1.0);
    if (!(power >= 0)) {
      throw ValueError(
          fmt::format("ModelAssigner: device table entry '{}' has compute_power {}, must be >= 0",
                      info->name, power));
    }
    const double free_mib =
        std::floor(static_cast<double>(info->free_memory_bytes()) / kBytesPerMiB);
    out.push_back(Candidate{d, free_mib * o.max_mem_ratio, power});
  }
  return out;
}

at::Tensor row(const std::vector<double>& v) {
  return at::tensor(std::vector<float>(v.begin(), v.end()), at::kFloat)
      .view({1, static_cast<int64_t>(v.size())});
}

// x / sum(x), or nullopt when the sum is 0 (the term built from it is then 0: machin divides
// 0 by 0 there and its placement turns NaN).
std::optional<at::Tensor> normalized(const at::Tensor& x) {
  const at::Tensor sum = x.sum();
  if (sum.item<float>() == 0) return std::nullopt;
  return x / sum;
}

// The placement problem of machin's optimize_placement, for n models on m devices.
struct Problem {
  at::Tensor model_size;                          // [1, n], MiB
  at::Tensor size_capacity;                       // [1, m], MiB
  std::optional<at::Tensor> norm_model_cmplx;     // [1, n]
  std::optional<at::Tensor> norm_cmplx_capacity;  // [1, m]
  std::optional<at::Tensor> norm_model_conn;      // [n, n]
  std::optional<at::Tensor> norm_dev_dist;        // [m, m]
  at::Tensor self_mask;                           // [n, n], true on the diagonal
};

// The cost of machin's ModelAssigner.optimize_placement for placement logits [n, m].
at::Tensor placement_cost(const at::Tensor& logits, const Problem& p,
                          const ModelAssignerOptions& o) {
  const at::Tensor placement = at::softmax(logits, -1);
  at::Tensor total = at::zeros({}, at::kFloat);

  if (p.norm_model_conn && p.norm_dev_dist) {
    // Expected distance between the devices of models i and k; a model is 0 from itself.
    const at::Tensor model_distance =
        at::einsum("ij,mn,jn->im", {placement, placement, *p.norm_dev_dist})
            .masked_fill(p.self_mask, 0);
    total = total + (*p.norm_model_conn * model_distance).mean() * o.connection_weight;
  }

  // Expected MiB on each device beyond its capacity.
  const at::Tensor size_match_cost =
      at::relu(at::einsum("ij,jk->ik", {p.model_size, placement}) - p.size_capacity);
  total = total + size_match_cost.mean() * o.size_match_weight;

  if (p.norm_model_cmplx && p.norm_cmplx_capacity) {
    // Each device's share of the computation against its share of the compute power.
    const at::Tensor cmplx_match_cost =
        (at::einsum("ij,jk->ik", {*p.norm_model_cmplx, placement}) - *p.norm_cmplx_capacity).pow(2);
    total = total + cmplx_match_cost.mean() * o.complexity_match_weight;
  }

  // Entropy of each model's row: low when a model sits on one device with probability ~1.
  const at::Tensor entropy_cost =
      -at::where(placement > 0, placement * placement.log(), at::zeros_like(placement)).sum(-1);
  return total + entropy_cost.mean() * o.entropy_weight;
}

}  // namespace

ModelAssigner::ModelAssigner(std::vector<std::shared_ptr<torch::nn::Module>> models,
                             ModelConnection model_connection,
                             std::optional<std::vector<c10::Device>> devices,
                             ModelAssignerOptions options) {
  check_options(options);
  const auto n = static_cast<int64_t>(models.size());
  for (int64_t i = 0; i < n; ++i) {
    if (!models[i]) throw ValueError(fmt::format("ModelAssigner: model {} is null", i));
  }
  for (const auto& [edge, amount] : model_connection) {
    const auto [from, to] = edge;
    if (from < 0 || from >= n || to < 0 || to >= n) {
      throw ValueError(fmt::format("ModelAssigner: connection ({}, {}) names a model outside 0..{}",
                                   from, to, n - 1));
    }
    if (!(amount >= 0) || !std::isfinite(amount)) {
      throw ValueError(
          fmt::format("ModelAssigner: connection ({}, {}) is {}, must be >= 0", from, to, amount));
    }
  }

  const std::vector<Candidate> candidates = choose_devices(
      devices, options.device_table ? *options.device_table : probe_devices(), options, removed_);
  const auto m = static_cast<int64_t>(candidates.size());
  for (const auto& c : candidates) devices_.push_back(c.device);

  for (const auto& model : models) {
    model_sizes_.push_back(
        ModelSizeEstimator(model, options.model_size_multiplier).estimate_size());
  }
  const double total_size = std::accumulate(model_sizes_.begin(), model_sizes_.end(), 0.0);
  const double total_capacity =
      std::accumulate(candidates.begin(), candidates.end(), 0.0,
                      [](double s, const Candidate& c) { return s + c.capacity_mib; });
  if (total_size > total_capacity) {
    throw Error(
        fmt::format("Estimated model will use {:.2f} MB, but only have {:.2f} MB "
                    "allowed memory in total.",
                    total_size, total_capacity));
  }

  // The caller may hold a no-grad or inference-mode guard; the optimisation needs autograd.
  c10::InferenceMode no_inference(false);
  c10::AutoGradMode grad(true);

  std::vector<double> capacity, power;
  for (const auto& c : candidates) {
    capacity.push_back(c.capacity_mib);
    power.push_back(c.power);
  }
  std::vector<float> conn(static_cast<size_t>(n * n), 0.0f);
  for (const auto& [edge, amount] : model_connection) {
    conn[static_cast<size_t>(edge.first * n + edge.second)] = static_cast<float>(amount);
  }
  // Device distances: 0 on one device, gpu_gpu_distance between GPUs, cpu_gpu_distance
  // between the CPU and a GPU.
  std::vector<float> distance(static_cast<size_t>(m * m), 0.0f);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < m; ++j) {
      const auto& a = devices_[i];
      const auto& b = devices_[j];
      double d = 0;
      if (a.is_cpu() != b.is_cpu()) d = options.cpu_gpu_distance;
      if (a.is_cuda() && b.is_cuda() && a.index() != b.index()) d = options.gpu_gpu_distance;
      distance[static_cast<size_t>(i * m + j)] = static_cast<float>(d);
    }
  }

  Problem problem;
  problem.model_size = row(model_sizes_);
  problem.size_capacity = row(capacity);
  // A model's computation is taken to grow with its size (machin: model_complexity =
  // model_size).
  problem.norm_model_cmplx = normalized(problem.model_size);
  problem.norm_cmplx_capacity = normalized(row(power));
  problem.norm_model_conn = normalized(at::tensor(conn, at::kFloat).view({n, n}));
  problem.norm_dev_dist = normalized(at::tensor(distance, at::kFloat).view({m, m}));
  problem.self_mask = at::eye(n, at::kBool);

  // The placement logits: softmax over a row is model i's distribution over the devices.
  at::Tensor logits = at::randn({n, m}, at::detail::createCPUGenerator(options.seed), at::kFloat)
                          .requires_grad_(true);
  if (n > 0) {
    torch::optim::Adam optimizer(std::vector<at::Tensor>{logits},
                                 torch::optim::AdamOptions(options.update_rate));
    for (int64_t it = 0; it < options.iterations; ++it) {
      optimizer.zero_grad();
      placement_cost(logits, problem, options).backward();
      optimizer.step();
    }
  }
  placement_ = at::softmax(logits.detach(), -1);

  const at::Tensor best = placement_.argmax(1);
  for (int64_t i = 0; i < n; ++i) assignment_.push_back(devices_[best[i].item<int64_t>()]);

  if (options.move_models) {
    for (int64_t i = 0; i < n; ++i) models[i]->to(assignment_[i]);
  }
}

}  // namespace torchpar
