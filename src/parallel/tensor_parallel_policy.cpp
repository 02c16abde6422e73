#include "torchpar/parallel/tensor_parallel_policy.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cctype>
#include <optional>
#include <set>
#include <utility>

#include "torchpar/core/error.h"
#include "torchpar/parallel/tensor_parallel_layers.h"

namespace torchpar {
namespace {

enum class Split { kColumn, kRow };

/// What a policy does to one path inside its blocks.
struct Rule {
  Split split = Split::kColumn;
  const TensorParallelLayer* layer = nullptr;
  bool is_bias = false;
};

struct PolicyRules {
  const TensorParallelPolicy* policy = nullptr;
  std::map<std::string, Rule> by_path;
};

PolicyRules rules_of(const TensorParallelPolicy& p) {
  PolicyRules out{&p, {}};
  auto add = [&](const std::string& path, Rule rule) {
    if (path.empty()) return;
    if (!out.by_path.emplace(path, rule).second)
      throw ValueError(fmt::format("policy for {}: '{}' is listed twice", p.block_type, path));
  };
  auto add_all = [&](const std::vector<TensorParallelLayer>& layers, Split split) {
    for (const auto& l : layers) {
      if (l.weight.empty() && l.bias.empty())
        throw ValueError(
            fmt::format("policy for {}: a layer with neither weight nor bias", p.block_type));
      if (l.n_fused < 1)
        throw ValueError(fmt::format("policy for {}: '{}' has n_fused {} (must be >= 1)",
                                     p.block_type, l.weight, l.n_fused));
      add(l.weight, {split, &l, false});
      add(l.bias, {split, &l, true});
    }
  };
  add_all(p.attn_qkv, Split::kColumn);
  add_all(p.attn_out, Split::kRow);
  add_all(p.mlp_in, Split::kColumn);
  add_all(p.mlp_out, Split::kRow);
  return out;
}

/// The block prefix of `name` under `pattern` ("h.{}." on "h.3.attn.x" -> "h.3."), if any.
std::optional<std::string> block_prefix(const std::string& pattern, const std::string& name) {
  const auto brace = pattern.find("{}");
  if (brace == std::string::npos) {
    if (name.size() > pattern.size() && name.compare(0, pattern.size(), pattern) == 0)
      return pattern;
    return std::nullopt;
  }
  if (name.compare(0, brace, pattern, 0, brace) != 0) return std::nullopt;
  size_t end = brace;
  while (end < name.size() && std::isdigit(static_cast<unsigned char>(name[end])) != 0) ++end;
  if (end == brace) return std::nullopt;
  const size_t tail = pattern.size() - brace - 2;
  if (name.compare(end, tail, pattern, brace + 2, tail) != 0) return std::nullopt;
  end += tail;
  if (end >= name.size()) return std::nullopt;
  return name.substr(0, end);
}

/// The policy (index into `rules`) and block prefix `name` belongs to: the first policy whose
/// pattern matches.
std::optional<std::pair<size_t, std::string>> find_block(const std::vector<PolicyRules>& rules,
                                                         const std::string& name) {
  for (size_t i = 0; i < rules.size(); ++i) {
    if (auto prefix = block_prefix(rules[i].policy->block_pattern, name))
      return std::make_pair(i, std::move(*prefix));
  }
  return std::nullopt;
}

at::Tensor apply(const Rule& rule, const at::Tensor& t, const std::string& name, int rank,
                 int world_size) {
  const TensorParallelLayer& l = *rule.layer;
  if (rule.is_bias) {
    if (rule.split == Split::kRow) return t;  // added once, after the all_reduce
    return column_slice(t, rank, world_size, {.n_fused = l.n_fused, .name = name});
  }
  if (t.dim() != 2)
    throw ValueError(
        fmt::format("shard_state_dict: weight '{}' has {} dimension(s), not 2", name, t.dim()));
  // Slicing the transposed view gives nn.Linear's [out, in] layout in one copy.
  const at::Tensor linear = l.transposed ? t.t() : t;
  const SliceOptions o{.n_fused = l.n_fused, .transposed = false, .name = name};
  try {
    return rule.split == Split::kColumn ? column_slice(linear, rank, world_size, o)
                                        : row_slice(linear, rank, world_size, o);
  } catch (const ValueError& e) {
    // The likeliest cause is a checkpoint in the other layout: say which one the policy assumed.
    throw ValueError(fmt::format(
        "{} (the policy reads this weight as {}; a checkpoint in {} layout needs transposed = {})",
        e.what(), l.transposed ? "Conv1D [in, out]" : "nn.Linear [out, in]",
        l.transposed ? "nn.Linear [out, in]" : "Conv1D [in, out]", !l.transposed));
  }
}

}  // namespace

std::map<std::string, int64_t> arguments_per_rank(const TensorParallelPolicy& policy,
                                                  int world_size) {
  if (world_size < 1)
    throw ValueError(fmt::format("{}: world size {} must be >= 1", policy.block_type, world_size));
  std::map<std::string, int64_t> out;
  for (const auto& a : policy.replace_arguments) {
    if (a.value % world_size != 0)
      throw ValueError(fmt::format(
          "{}: {} = {} is not divisible by the world size {}; tensor parallelism gives each rank "
          "an equal part of it",
          policy.block_type, a.name, a.value, world_size));
    out[a.name] = a.value / world_size;
  }
  return out;
}

StateDict shard_state_dict(StateDict full, const std::vector<TensorParallelPolicy>& policies,
                           int rank, int world_size) {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw ValueError(
        fmt::format("shard_state_dict: rank {} of world size {} is not a rank", rank, world_size));
  std::vector<PolicyRules> rules;
  rules.reserve(policies.size());
  for (const auto& p : policies) {
    arguments_per_rank(p, world_size);
    rules.push_back(rules_of(p));
  }

  // Every block a policy covers must have the layers it lists (before anything is sliced).
  std::set<std::pair<size_t, std::string>> blocks;
  for (const auto& [name, tensor] : full) {
    if (auto b = find_block(rules, name)) blocks.insert(std::move(*b));
  }
  for (const auto& [index, prefix] : blocks) {
    for (const auto& [path, rule] : rules[index].by_path) {
      if (!rule.layer->ignore_checker && full.count(prefix + path) == 0)
        throw ValueError(fmt::format(
            "shard_state_dict: {} block '{}' has no '{}' (its policy slices '{}{}'; set "
            "ignore_checker for layers that only some configurations have)",
            rules[index].policy->block_type, prefix, path, prefix, path));
    }
  }

  StateDict out;
  while (!full.empty()) {
    // extract: the full tensor is released (if nobody else holds it) once its shard exists.
    auto node = full.extract(full.begin());
    const std::string& name = node.key();
    at::Tensor result = node.mapped();
    if (auto b = find_block(rules, name)) {
      const auto& by_path = rules[b->first].by_path;
      const auto it = by_path.find(name.substr(b->second.size()));
      if (it != by_path.end()) result = apply(it->second, node.mapped(), name, rank, world_size);
    }
    out.emplace(name, std::move(result));
  }
  return out;
}

}  // namespace torchpar
