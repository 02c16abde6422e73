#include "torchpar/parallel/gpt_checkpoint.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "core/atomic_file.h"
#include "torchpar/core/error.h"

namespace torchpar {
namespace {

using Json = nlohmann::ordered_json;

/// The most bytes a sidecar may have: a real one is a few hundred.
constexpr size_t kMaxSidecarBytes = size_t{1} << 20;
/// The largest size a sidecar may give: an int32, so that products of a few sizes (4 * n_embd,
/// n_embd * vocab_size) stay far from int64 overflow.
constexpr int64_t kMaxSize = std::numeric_limits<int32_t>::max();

void check_layout(const std::string& layout, const char* what) {
  if (layout != "conv1d" && layout != "linear")
    throw ValueError(fmt::format(
        "{}: weight_layout '{}' is not one of \"conv1d\" ([in, out], GPT-2's) or \"linear\" "
        "([out, in], nn.Linear's)",
        what, layout));
}

/// The names of the projection weights of every block (those whose layout differs).
std::vector<std::string> projection_weights(const GptConfig& config) {
  const TensorParallelPolicy p = gpt2_policy(config);
  std::vector<std::string> out;
  for (int64_t i = 0; i < config.n_layer; ++i) {
    for (const auto* layers : {&p.attn_qkv, &p.attn_out, &p.mlp_in, &p.mlp_out}) {
      for (const auto& l : *layers) out.push_back(fmt::format("h.{}.{}", i, l.weight));
    }
  }
  return out;
}

template <class T>
T required(const Json& j, const char* key, const std::string& path) {
  if (!j.contains(key))
    throw SerializationError(fmt::format("'{}': the key \"{}\" is missing", path, key));
  try {
    return j.at(key).get<T>();
  } catch (const Json::exception& e) {
    throw SerializationError(
        fmt::format("'{}': \"{}\" has the wrong type: {}", path, key, e.what()));
  }
}

template <class T>
T optional_key(const Json& j, const char* key, T fallback, const std::string& path) {
  return j.contains(key) && !j.at(key).is_null() ? required<T>(j, key, path) : fallback;
}

/// An integer key in [lo, kMaxSize]: a JSON integer (1e30 or 768.5 is refused, not converted).
int64_t size_key(const Json& j, const char* key, int64_t lo, const std::string& path,
                 std::optional<int64_t> fallback = std::nullopt) {
  if (fallback && (!j.contains(key) || j.at(key).is_null())) return *fallback;
  if (!j.contains(key))
    throw SerializationError(fmt::format("'{}': the key \"{}\" is missing", path, key));
  const Json& v = j.at(key);
  bool ok = false;
  int64_t x = 0;
  if (v.is_number_unsigned()) {  // nlohmann keeps non-negative integers unsigned
    ok = v.get<uint64_t>() <= static_cast<uint64_t>(kMaxSize);
    x = ok ? static_cast<int64_t>(v.get<uint64_t>()) : 0;
  } else if (v.is_number_integer()) {
    ok = true;
    x = v.get<int64_t>();
  }
  if (!ok || x < lo || x > kMaxSize)
    throw SerializationError(fmt::format("'{}': \"{}\" is {}; it must be an integer in [{}, {}]",
                                         path, key, v.dump(), lo, kMaxSize));
  return x;
}

}  // namespace

TensorParallelPolicy GptCheckpointInfo::policy() const {
  check_layout(weight_layout, "GptCheckpointInfo::policy");
  TensorParallelPolicy p = gpt2_policy(config);
  for (auto* layers : {&p.attn_qkv, &p.attn_out, &p.mlp_in, &p.mlp_out}) {
    for (auto& l : *layers) l.transposed = weight_layout == "conv1d";
  }
  return p;
}

std::string gpt_checkpoint_info_path(const std::string& model_path) {
  return std::filesystem::path(model_path).replace_extension(".json").string();
}

GptCheckpointInfo load_gpt_checkpoint_info(const std::string& model_path) {
  const std::string path = gpt_checkpoint_info_path(model_path);
  std::string text;
  try {
    text = detail::read_small_file(path, kMaxSidecarBytes, "load_gpt_checkpoint_info");
  } catch (const SystemError& e) {
    throw Error(fmt::format(
        "load_gpt_checkpoint_info: cannot read '{}', the sidecar of '{}' (a GPT checkpoint is "
        "model.pt with model.json beside it, as `torchpar train --model gpt` writes): {}",
        path, model_path, e.what()));
  }
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::exception& e) {
    throw SerializationError(fmt::format("'{}' is not valid JSON: {}", path, e.what()));
  }
  if (!j.is_object()) throw SerializationError(fmt::format("'{}' is not a JSON object", path));
  GptCheckpointInfo info;
  GptConfig& c = info.config;
  c.vocab_size = size_key(j, "vocab_size", 1, path);
  c.n_positions = size_key(j, "n_positions", 1, path);
  c.n_embd = size_key(j, "n_embd", 1, path);
  c.n_layer = size_key(j, "n_layer", 1, path);
  c.n_head = size_key(j, "n_head", 1, path);
  c.n_inner = size_key(j, "n_inner", 0, path, 0);
  c.layer_norm_epsilon = optional_key<double>(j, "layer_norm_epsilon", 1e-5, path);
  if (!std::isfinite(c.layer_norm_epsilon) || !(c.layer_norm_epsilon > 0))
    throw SerializationError(
        fmt::format("'{}': \"layer_norm_epsilon\" is {}; it must be finite and > 0", path,
                    c.layer_norm_epsilon));
  const auto dtype = optional_key<std::string>(j, "dtype", "float32", path);
  try {
    c.dtype = dtype_from_string(dtype);
  } catch (const ValueError& e) {
    throw SerializationError(fmt::format("'{}': \"dtype\": {}", path, e.what()));
  }
  info.tokenizer = optional_key<std::string>(j, "tokenizer", "bytes", path);
  info.weight_layout = optional_key<std::string>(j, "weight_layout", "conv1d", path);
  try {
    check_layout(info.weight_layout, "load_gpt_checkpoint_info");
  } catch (const ValueError& e) {
    throw SerializationError(fmt::format("'{}': {}", path, e.what()));
  }
  return info;
}

void save_gpt_checkpoint_info(const GptCheckpointInfo& info, const std::string& model_path) {
  check_layout(info.weight_layout, "save_gpt_checkpoint_info");
  const GptConfig& c = info.config;
  Json j;
  j["vocab_size"] = c.vocab_size;
  j["n_positions"] = c.n_positions;
  j["n_embd"] = c.n_embd;
  j["n_layer"] = c.n_layer;
  j["n_head"] = c.n_head;
  j["n_inner"] = c.n_inner;
  j["layer_norm_epsilon"] = c.layer_norm_epsilon;
  j["dtype"] = dtype_name(c.dtype);
  j["tokenizer"] = info.tokenizer;
  j["weight_layout"] = info.weight_layout;
  detail::write_file_atomically(gpt_checkpoint_info_path(model_path), j.dump(2) + "\n");
}

StateDict gpt_checkpoint_state_dict(GptImpl& gpt, const std::string& weight_layout) {
  check_layout(weight_layout, "gpt_checkpoint_state_dict");
  if (gpt.comm().world_size != 1)
    throw ValueError(fmt::format(
        "gpt_checkpoint_state_dict: the Gpt is rank {} of {}, a shard; a checkpoint holds a "
        "whole model (TP = 1)",
        gpt.comm().rank, gpt.comm().world_size));
  StateDict sd;
  for (const auto& item : gpt.named_parameters(/*recurse=*/true))
    sd.emplace(item.key(), item.value().detach());
  if (weight_layout == "conv1d") {
    for (const auto& name : projection_weights(gpt.config())) {
      auto& w = sd.at(name);
      w = w.t().contiguous();
    }
  }
  return sd;
}

void save_gpt_checkpoint(GptImpl& gpt, const std::string& model_path,
                         const std::string& tokenizer) {
  GptCheckpointInfo info{.config = gpt.config(), .tokenizer = tokenizer, .weight_layout = "conv1d"};
  save_state_dict_file(gpt_checkpoint_state_dict(gpt, info.weight_layout), model_path);
  save_gpt_checkpoint_info(info, model_path);
}

at::ScalarType dtype_from_string(const std::string& name) {
  if (name == "float32" || name == "float") return at::kFloat;
  if (name == "float64" || name == "double") return at::kDouble;
  if (name == "float16" || name == "half") return at::kHalf;
  if (name == "bfloat16") return at::kBFloat16;
  throw ValueError(fmt::format(
      "unknown dtype '{}': expected float32 (float), float64 (double), float16 (half) or "
      "bfloat16",
      name));
}

std::string dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kHalf:
      return "float16";
    case at::kBFloat16:
      return "bfloat16";
    default:
      return c10::toString(dtype);
  }
}

}  // namespace torchpar
