#include "torchpar/dist/elastic_state.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <filesystem>
#include <limits>
#include <string_view>
#include <variant>

#include "core/atomic_file.h"
#include "dist/elastic_storage.h"
#include "torchpar/core/env.h"
#include "torchpar/core/error.h"
#include "torchpar/dist/collective_group.h"

// Helpers in a named namespace: the library is built as unity groups, where an anonymous
// namespace is shared with the other files of the group.
namespace torchpar::detail::elastic_state {

// ---- the bytes: one torch::serialize archive -------------------------------------------------

/// What to_bytes writes under "format"; from_bytes refuses anything else.
constexpr const char* kFormat = "torchpar.elastic_state.v1";

enum class Kind : int64_t { kModule = 0, kOptimizer = 1, kCounter = 2 };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kModule:
      return "module";
    case Kind::kOptimizer:
      return "optimizer";
    case Kind::kCounter:
      return "counter";
  }
  return "?";
}

/// The archive's key of entry `i`: archive keys become TorchScript attribute names, so the
/// user's names (any text) travel in a list instead.
std::string entry_key(size_t i) { return fmt::format("e{}", i); }

std::string shape_text(const at::Tensor& t) {
  return fmt::format("{} {}", c10::toString(t.scalar_type()), t.sizes());
}

/// Collects (registered tensor, saved tensor) pairs of `module` and its children from `ar`,
/// as torch::nn::Module::load reads them, checking every name, dtype and shape first.
void collect_module(torch::nn::Module& module, torch::serialize::InputArchive& ar,
                    const std::string& entry, const std::string& prefix,
                    std::vector<std::pair<at::Tensor, at::Tensor>>& copies) {
  auto take = [&](const std::string& key, const at::Tensor& mine, bool buffer) {
    at::Tensor saved;
    if (!ar.try_read(key, saved, buffer)) {
      throw SerializationError(
          fmt::format("ElasticState: module '{}' has {} '{}{}' ({}), which "
                      "the saved state does not hold",
                      entry, buffer ? "buffer" : "parameter", prefix, key, shape_text(mine)));
    }
    if (saved.scalar_type() != mine.scalar_type() || !saved.sizes().equals(mine.sizes())) {
      throw SerializationError(fmt::format(
          "ElasticState: module '{}': {} '{}{}' is {} here but {} in the saved state", entry,
          buffer ? "buffer" : "parameter", prefix, key, shape_text(mine), shape_text(saved)));
    }
    copies.emplace_back(mine, saved);
  };
  std::vector<std::string> expected;
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    take(p.key(), p.value(), false);
    expected.push_back(p.key());
  }
  for (const auto& b : module.named_buffers(/*recurse=*/false)) {
    take(b.key(), b.value(), true);
    expected.push_back(b.key());
  }
  for (const auto& c : module.named_children()) {
    if (!c.value()->is_serializable()) continue;
    torch::serialize::InputArchive sub;
    if (!ar.try_read(c.key(), sub)) {
      throw SerializationError(
          fmt::format("ElasticState: module '{}' has a submodule '{}{}', which the saved state "
                      "does not hold",
                      entry, prefix, c.key()));
    }
    collect_module(*c.value(), sub, entry, prefix + c.key() + ".", copies);
    expected.push_back(c.key());
  }
  // Every attribute of the saved module is a parameter, buffer or submodule of this one
  // ("training" is TorchScript's own).
  for (const auto& key : ar.keys()) {
    if (key != "training" && std::find(expected.begin(), expected.end(), key) == expected.end()) {
      throw SerializationError(fmt::format(
          "ElasticState: module '{}': the saved state holds '{}{}', which this module does not "
          "have",
          entry, prefix, key));
    }
  }
}

}  // namespace torchpar::detail::elastic_state

namespace torchpar {

// ---- ElasticState ----------------------------------------------------------------------------

struct ElasticState::Impl {
  using Kind = detail::elastic_state::Kind;
  struct Entry {
    std::string name;
    Kind kind;
    std::variant<torch::nn::Module*, torch::optim::Optimizer*, int64_t*> target;
  };
  std::vector<Entry> entries;
  std::optional<detail::elastic_state::SnapshotSlots> slots;

  void add(const std::string& name, Kind kind, decltype(Entry::target) target) {
    if (name.empty()) throw ValueError("ElasticState::add: empty name");
    for (const auto& e : entries) {
      if (e.name == name) {
        throw ValueError(fmt::format("ElasticState::add: '{}' is registered already (as a {})",
                                     name, detail::elastic_state::kind_name(e.kind)));
      }
    }
    entries.push_back({name, kind, target});
  }

  size_t last_bytes = 0;         // of the last to_bytes: the next one reserves as much
  std::string checkpoint_bytes;  // save_checkpoint(): the file's bytes, capacity kept

  /// Writes the archive (see the header's format) through `writer`, chunk by chunk.
  void save(int64_t step, const std::function<size_t(const void*, size_t)>& writer) const {
    namespace es = detail::elastic_state;
    torch::serialize::OutputArchive ar;
    c10::List<std::string> names;
    c10::List<int64_t> kinds;
    c10::List<int64_t> counters;
    for (size_t i = 0; i < entries.size(); ++i) {
      const auto& e = entries[i];
      names.push_back(e.name);
      kinds.push_back(static_cast<int64_t>(e.kind));
      if (e.kind == Kind::kCounter) {
        counters.push_back(*std::get<int64_t*>(e.target));
        continue;
      }
      torch::serialize::OutputArchive sub(ar.compilation_unit());
      if (e.kind == Kind::kModule) {
        std::get<torch::nn::Module*>(e.target)->save(sub);
      } else {
        std::get<torch::optim::Optimizer*>(e.target)->save(sub);
      }
      ar.write(es::entry_key(i), sub);
    }
    ar.write("format", c10::IValue(std::string(es::kFormat)));
    ar.write("step", c10::IValue(step));
    ar.write("names", c10::IValue(names));
    ar.write("kinds", c10::IValue(kinds));
    ar.write("counters", c10::IValue(counters));
    ar.save_to(writer);
  }

  /// Throws SerializationError naming the first registered name that was not saved, or saved
  /// name that is not registered.
  void check_names(const std::vector<std::string>& saved) const {
    std::vector<std::string> mine;
    for (const auto& e : entries) mine.push_back(e.name);
    auto listing = [](const auto& v) { return fmt::format("{}", fmt::join(v, ", ")); };
    for (const auto& e : entries) {
      if (std::find(saved.begin(), saved.end(), e.name) == saved.end()) {
        throw SerializationError(fmt::format(
            "ElasticState: '{}' ({}) is registered but not in the saved state (saved: [{}]; "
            "registered: [{}])",
            e.name, detail::elastic_state::kind_name(e.kind), listing(saved), listing(mine)));
      }
    }
    for (const auto& n : saved) {
      if (std::find(mine.begin(), mine.end(), n) == mine.end()) {
        throw SerializationError(fmt::format(
            "ElasticState: the saved state holds '{}', which is not registered (saved: [{}]; "
            "registered: [{}])",
            n, listing(saved), listing(mine)));
      }
    }
  }
};

ElasticState::ElasticState() : impl_(std::make_unique<Impl>()) {
  namespace es = detail::elastic_state;
  const auto fds = env_value(kElasticStateFdsEnv);
  if (!fds || fds->empty()) return;
  impl_->slots = es::SnapshotSlots::from_env(*fds);
}

ElasticState::~ElasticState() = default;

void ElasticState::add(const std::string& name, torch::nn::Module& module) {
  namespace es = detail::elastic_state;
  impl_->add(name, es::Kind::kModule, &module);
}

void ElasticState::add(const std::string& name, torch::optim::Optimizer& optimizer) {
  namespace es = detail::elastic_state;
  impl_->add(name, es::Kind::kOptimizer, &optimizer);
}

void ElasticState::add_counter(const std::string& name, int64_t* value) {
  namespace es = detail::elastic_state;
  if (value == nullptr) {
    throw ValueError(fmt::format("ElasticState::add_counter: '{}' points nowhere", name));
  }
  impl_->add(name, es::Kind::kCounter, value);
}

bool ElasticState::has_memory() const { return impl_->slots.has_value(); }

std::string ElasticState::to_bytes(int64_t step) const {
  std::string bytes;
  bytes.reserve(impl_->last_bytes);  // grows once, not by doubling (page faults dominate)
  impl_->save(step, [&](const void* data, size_t n) {
    bytes.append(static_cast<const char*>(data), n);
    return n;
  });
  impl_->last_bytes = bytes.size();
  return bytes;
}

int64_t ElasticState::from_bytes(const std::string& bytes) {
  namespace es = detail::elastic_state;
  torch::serialize::InputArchive ar;
  try {
    ar.load_from(bytes.data(), bytes.size());
  } catch (const c10::Error& e) {
    throw SerializationError(
        fmt::format("ElasticState: {} bytes are not a saved state (not a torch archive: {})",
                    bytes.size(), e.what_without_backtrace()));
  }
  c10::IValue format, step, names, kinds, counters;
  if (!ar.try_read("format", format) || !format.isString() || format.toStringRef() != es::kFormat) {
    throw SerializationError(
        fmt::format("ElasticState: the bytes are a torch archive but not a saved state (no "
                    "format '{}')",
                    es::kFormat));
  }
  if (!ar.try_read("step", step) || !step.isInt() || !ar.try_read("names", names) ||
      !names.isList() || !ar.try_read("kinds", kinds) || !kinds.isIntList() ||
      !ar.try_read("counters", counters) || !counters.isIntList()) {
    throw SerializationError("ElasticState: the saved state lacks its step, names or counters");
  }
  // The saved entries, by name: the same names, each of the same kind.
  const auto saved_names = names.toListRef();
  const auto saved_kinds = kinds.toIntVector();
  const auto saved_counters = counters.toIntVector();
  std::vector<std::string> saved;
  for (const auto& n : saved_names) {
    if (!n.isString()) throw SerializationError("ElasticState: a saved name is not a string");
    saved.push_back(n.toStringRef());
  }
  if (saved.size() != saved_kinds.size()) {
    throw SerializationError("ElasticState: the saved state's names and kinds differ in number");
  }
  impl_->check_names(saved);
  // Check everything before changing anything: modules, then counters; optimizers check
  // their own groups as they load (LibTorch's Optimizer::load), before the modules change.
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;
  std::vector<std::pair<int64_t*, int64_t>> counter_values;
  std::vector<std::pair<const Impl::Entry*, torch::serialize::InputArchive>> optimizers;
  size_t counter_index = 0;
  for (size_t i = 0; i < saved.size(); ++i) {
    const auto it = std::find_if(impl_->entries.begin(), impl_->entries.end(),
                                 [&](const auto& e) { return e.name == saved[i]; });
    const es::Kind kind = static_cast<es::Kind>(saved_kinds[i]);
    if (kind != it->kind) {
      throw SerializationError(
          fmt::format("ElasticState: '{}' is registered as a {} but "
                      "saved as a {}",
                      it->name, es::kind_name(it->kind), es::kind_name(kind)));
    }
    if (kind == es::Kind::kCounter) {
      if (counter_index >= saved_counters.size()) {
        throw SerializationError("ElasticState: the saved state lacks counter values");
      }
      counter_values.emplace_back(std::get<int64_t*>(it->target), saved_counters[counter_index++]);
      continue;
    }
    torch::serialize::InputArchive sub;
    if (!ar.try_read(es::entry_key(i), sub)) {
      throw SerializationError(
          fmt::format("ElasticState: the saved state lacks the data of '{}'", it->name));
    }
    if (kind == es::Kind::kModule) {
      es::collect_module(*std::get<torch::nn::Module*>(it->target), sub, it->name, "", copies);
    } else {
      optimizers.emplace_back(&*it, std::move(sub));
    }
  }
  for (auto& [entry, sub] : optimizers) {
    try {
      std::get<torch::optim::Optimizer*>(entry->target)->load(sub);
    } catch (const c10::Error& e) {
      throw SerializationError(
          fmt::format("ElasticState: optimizer '{}' does not match the saved state: {}",
                      entry->name, e.what_without_backtrace()));
    }
  }
  {
    at::NoGradGuard no_grad;
    for (auto& [mine_t, saved_t] : copies) mine_t.copy_(saved_t);
  }
  for (auto& [ptr, value] : counter_values) *ptr = value;
  return step.toInt();
}

void ElasticState::snapshot(int64_t step) {
  if (!impl_->slots) return;
  impl_->slots->write(
      step, [&](const detail::elastic_state::PieceWriter& writer) { impl_->save(step, writer); });
}

void ElasticState::save_checkpoint(const std::string& dir, int64_t step, int keep) {
  namespace es = detail::elastic_state;
  if (dir.empty()) throw ValueError("ElasticState::save_checkpoint: empty directory");
  if (step < 0) {
    throw ValueError(fmt::format("ElasticState::save_checkpoint: step {} < 0", step));
  }
  if (keep < 1) {
    throw ValueError(fmt::format("ElasticState::save_checkpoint: keep {} < 1", keep));
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    throw SystemError("mkdir", ec.value(), dir, "ElasticState::save_checkpoint: the directory");
  }
  const std::string path = (std::filesystem::path(dir) / fmt::format("step_{}.pt", step)).string();
  // Into a buffer kept across checkpoints: a fresh one of the state's size costs more in
  // page faults than the serialization itself (39 MB: 170 ms against 20 ms here).
  std::string& bytes = impl_->checkpoint_bytes;
  bytes.clear();
  impl_->save(step, [&](const void* data, size_t n) {
    bytes.append(static_cast<const char*>(data), n);
    return n;
  });
  detail::write_file_atomically(path, bytes);
  es::fsync_dir(dir);  // the rename itself survives a crash of the host
  auto all = es::list_checkpoints(dir);
  while (all.size() > static_cast<size_t>(keep)) {
    std::filesystem::remove(all.front().second, ec);
    all.erase(all.begin());
  }
  // Temporary files of writers killed mid-write (step_<N>.pt.tmp.<pid>) for older steps.
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const auto tmp = name.find(".pt.tmp.");
    if (tmp == std::string::npos) continue;
    const auto n = es::checkpoint_step(name.substr(0, tmp + 3));
    std::error_code ec2;
    if (n && *n < step) std::filesystem::remove(e.path(), ec2);
  }
}

RestoreResult ElasticState::restore(CollectiveGroup& group,
                                    const std::optional<std::string>& checkpoint_dir) {
  namespace es = detail::elastic_state;
  const auto t0 = std::chrono::steady_clock::now();
  const int n = group.size();
  const int rank = group.rank();
  std::optional<std::pair<int64_t, std::string>> mem;
  if (impl_->slots) mem = impl_->slots->newest();
  std::optional<std::pair<int64_t, std::filesystem::path>> ckpt;
  if (rank == 0 && checkpoint_dir) {
    auto all = es::list_checkpoints(*checkpoint_dir);
    if (!all.empty()) ckpt = all.back();
  }
  // One round: the highest snapshot step (lowest rank among equals, encoded in the low digits
  // of step * n) and rank 0's newest checkpoint step.
  int64_t encoded = -1;
  if (mem) {
    if (mem->first < 0 || mem->first > std::numeric_limits<int64_t>::max() / n - n) {
      throw SerializationError(
          fmt::format("ElasticState::restore: this rank's snapshot claims step {}", mem->first));
    }
    encoded = mem->first * n + (n - 1 - rank);
  }
  at::Tensor round = at::tensor({encoded, ckpt ? ckpt->first : int64_t{-1}}, at::kLong);
  group.all_reduce(round, {.op = ReduceOp::kMax});
  encoded = round[0].item<int64_t>();
  const int64_t ckpt_step = round[1].item<int64_t>();
  const int64_t mem_step = encoded >= 0 ? encoded / n : -1;

  RestoreResult result;
  int src = -1;
  std::string path, payload;
  if (mem_step >= 0 && mem_step >= ckpt_step) {
    result.source = StateSource::kMemory;
    src = n - 1 - static_cast<int>(encoded % n);
    result.from_rank = src;
    if (rank == src) payload = std::move(mem->second);
  } else if (ckpt_step >= 0) {
    result.source = StateSource::kCheckpoint;
    src = 0;
  } else {
    result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return result;
  }
  // From src: the lengths (path, payload; -1 when src could not read its file), then both.
  std::exception_ptr failed;
  if (rank == src && result.source == StateSource::kCheckpoint) {
    path = ckpt->second.string();
    try {
      payload = es::read_file(path);
    } catch (...) {
      failed = std::current_exception();
    }
  }
  at::Tensor lengths = at::tensor({static_cast<int64_t>(path.size()),
                                   failed ? int64_t{-1} : static_cast<int64_t>(payload.size())},
                                  at::kLong);
  group.broadcast(lengths, src);
  if (failed) std::rethrow_exception(failed);
  const int64_t path_len = lengths[0].item<int64_t>();
  const int64_t payload_len = lengths[1].item<int64_t>();
  if (payload_len < 0) {
    throw Error(
        fmt::format("ElasticState::restore: rank {} could not read its newest checkpoint "
                    "(step {}); its error says why",
                    src, ckpt_step));
  }
  at::Tensor buffer = at::empty({path_len + payload_len}, at::kByte);
  auto* data = reinterpret_cast<char*>(buffer.data_ptr<uint8_t>());
  if (rank == src) {
    std::memcpy(data, path.data(), path.size());
    std::memcpy(data + path_len, payload.data(), payload.size());
  }
  group.broadcast(buffer, src);
  if (rank != src) {
    path.assign(data, static_cast<size_t>(path_len));
    payload.assign(data + path_len, static_cast<size_t>(payload_len));
  }
  buffer = at::Tensor();
  try {
    result.step = from_bytes(payload);
  } catch (const SerializationError& e) {
    if (result.source != StateSource::kCheckpoint) throw;
    throw SerializationError(fmt::format("checkpoint '{}': {}", path, e.what_without_backtrace()));
  }
  result.checkpoint_path = path;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

std::optional<std::string> latest_checkpoint(const std::string& dir) {
  namespace es = detail::elastic_state;
  auto all = es::list_checkpoints(dir);
  if (all.empty()) return std::nullopt;
  return all.back().second.string();
}

}  // namespace torchpar
