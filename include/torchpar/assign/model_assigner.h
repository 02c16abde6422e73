#pragma once
/// ModelAssigner: places each of several modules on a device (cpu, cuda:N) by gradient
/// descent on a softmax placement matrix (machin.parallel.assigner.ModelAssigner).
/// Cost terms and the differences from machin: docs/assign.md.

#include <ATen/core/TensorBody.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "torchpar/assign/device_info.h"

namespace torchpar {

/// Amount of data model i sends to model j, keyed {i, j} (indices into the model list).
/// Only the relative sizes matter (the cost normalises by the sum). Must be >= 0.
using ModelConnection = std::map<std::pair<int64_t, int64_t>, double>;

/// Options of ModelAssigner; defaults are machin's.
struct ModelAssignerOptions {
  /// Each model's estimated size (ModelSizeEstimator, MiB) is multiplied by this, to leave
  /// room for inputs and activations.
  double model_size_multiplier = 2;
  /// Share of each device's free memory the models may take, in (0, 1].
  double max_mem_ratio = 0.5;
  /// Compute power of "cpu" relative to one idle GPU, when its DeviceInfo leaves
  /// compute_power unset. 0: the complexity term steers computation away from the CPU.
  double cpu_weight = 0;
  /// Weight of the connection cost (data moved between models times device distance).
  double connection_weight = 2;
  /// Weight of the memory overflow cost (relu of assigned size minus capacity, MiB).
  double size_match_weight = 1e-2;
  /// Weight of the complexity match cost (each device's share of the models' complexity
  /// against its share of the compute power).
  double complexity_match_weight = 1;
  /// Weight of the entropy of each model's placement distribution (pushes towards one device).
  double entropy_weight = 1;
  /// Adam steps.
  int64_t iterations = 500;
  /// Adam's learning rate.
  double update_rate = 0.01;
  /// Distance between two different GPUs, and between the CPU and a GPU (> 0).
  double gpu_gpu_distance = 1;
  double cpu_gpu_distance = 10;
  /// Move each model to its device (Module::to) at the end of the constructor.
  bool move_models = true;
  /// Seed of the initial placement (a private generator: the global RNG is untouched).
  /// machin draws from the global RNG; its tests seed it with 0, as this default does.
  uint64_t seed = 0;
  /// The devices that exist, with their memory and compute power. nullopt: probe_devices().
  /// Tests inject a table here; callers may too (to reserve memory for something else).
  std::optional<std::vector<DeviceInfo>> device_table = std::nullopt;
};

/// Assigns models to devices, in the scope of one process. The assignment minimises, by
/// `iterations` Adam steps on a [models x devices] softmax probability matrix:
///   connection_weight * mean(connection[i,k] * E[distance(device(i), device(k))])
/// + size_match_weight * mean(relu(expected MiB on device j - capacity j))
/// + complexity_match_weight * mean((share of complexity on j - share of power of j)^2)
/// + entropy_weight * mean(entropy of each model's row);
/// each model then goes to its most probable device. A model's complexity is its size.
///
/// Devices: `devices` lists the candidates ("cpu", "cuda:1", ...; "cuda" is cuda:0, a
/// device listed twice counts once); a CUDA device missing from the device table is dropped
/// (machin logs it; see removed_devices()). nullopt: every GPU of the table, least busy
/// first, and no CPU. If no device is left, "cpu" alone.
/// Units:  sizes and capacities in MiB; capacity of a device = floor(free MiB) *
///         max_mem_ratio; compute power relative to one idle GPU (DeviceInfo).
///
/// ```cpp
/// auto encoder = std::make_shared<Encoder>(), decoder = std::make_shared<Decoder>();
/// torchpar::ModelAssigner assigner({encoder, decoder}, {{{0, 1}, 1.0}},
///                                  std::vector<c10::Device>{torch::kCUDA, torch::kCPU},
///                                  {.max_mem_ratio = 0.7, .cpu_weight = 0.1});
/// assigner.assignment();  // e.g. {cuda:0, cuda:0}; both models were moved there
/// ```
///
/// Fixes:  machin's cost divides by the sums of the connections, of the device distances,
///         of the model complexities and of the compute powers, which are 0 for one device,
///         no connections, empty models or (the default, cpu_weight 0) a CPU alone: its
///         placement turns NaN. Here a term whose sum is 0 is 0. machin's GPUtil query keeps
///         at most one GPU (limit=1) under 50 % load and memory when `devices` is None;
///         here every GPU of the table counts.
/// Errors: ValueError for an option out of range, a connection index outside the model
///         list or a negative connection, a device type other than cpu and cuda, a null
///         model, a device-table name that is no device or a negative compute_power, or a
///         table without "cpu" when the CPU is needed; what probe_devices() throws (no
///         device_table); Error "Estimated model will use X MB, but only have Y MB allowed
///         memory in total." (machin's text, MiB) when the models exceed the summed
///         capacities; whatever Module::to throws when moving (models moved before it stay
///         moved). Nothing is moved on the other errors.
/// Safety: reads (and with move_models, moves) the models: no other thread may use them
///         meanwhile. Distinct assigners may run in parallel; the accessors are thread-safe.
/// Source: machin.parallel.assigner.ModelAssigner.
class ModelAssigner {
 public:
  ModelAssigner(std::vector<std::shared_ptr<torch::nn::Module>> models,
                ModelConnection model_connection,
                std::optional<std::vector<c10::Device>> devices = std::nullopt,
                ModelAssignerOptions options = {});

  /// The device chosen for each model, in the order of the model list.
  const std::vector<c10::Device>& assignment() const { return assignment_; }
  /// The candidate devices after filtering (the columns of placement()).
  const std::vector<c10::Device>& devices() const { return devices_; }
  /// Devices asked for but absent from the device table, hence dropped.
  const std::vector<c10::Device>& removed_devices() const { return removed_; }
  /// Estimated size of each model in MiB, model_size_multiplier included.
  const std::vector<double>& model_sizes() const { return model_sizes_; }
  /// The final placement probabilities, float32 [models, devices]; rows sum to 1.
  const at::Tensor& placement() const { return placement_; }

 private:
  std::vector<c10::Device> assignment_;
  std::vector<c10::Device> devices_;
  std::vector<c10::Device> removed_;
  std::vector<double> model_sizes_;
  at::Tensor placement_;
};

}  // namespace torchpar
