#include "torchpar/dist/elastic_state.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <limits>
#include <string_view>
#include <variant>

#include "core/atomic_file.h"
#include "torchpar/core/env.h"
#include "torchpar/core/error.h"
#include "torchpar/core/fd.h"
#include "torchpar/core/syscall.h"
#include "torchpar/dist/collective_group.h"

// Helpers in a named namespace: the library is built as unity groups, where an anonymous
// namespace is shared with the other files of the group.
namespace torchpar::detail::elastic_state {

using Clock = std::chrono::steady_clock;

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

// ---- snapshot slots ----------------------------------------------------------------------------

/// A slot: [0, kHeaderBytes) the header, then the payload (to_bytes). Written payload first,
/// header last, the header cleared before: a slot is whole exactly when its header is valid
/// and its payload's crc32 matches.
constexpr size_t kHeaderBytes = 64;
constexpr std::array<char, 8> kSlotMagic = {'T', 'P', 'E', 'L', 'S', 'N', 'P', '1'};

struct SlotHeader {
  std::array<char, 8> magic{};
  uint64_t sequence = 0;  ///< 1, 2, ... per pair of slots: the higher one is newer
  int64_t step = 0;
  uint64_t payload_bytes = 0;
  uint32_t payload_crc = 0;
  uint32_t header_crc = 0;  ///< crc32 of the bytes above
};
static_assert(sizeof(SlotHeader) <= kHeaderBytes);

uint32_t crc_of(const void* data, size_t n) {
  uLong crc = crc32_z(0L, Z_NULL, 0);
  return static_cast<uint32_t>(crc32_z(crc, static_cast<const Bytef*>(data), n));
}

uint32_t header_crc(const SlotHeader& h) { return crc_of(&h, offsetof(SlotHeader, header_crc)); }

void pwrite_all(int fd, const void* data, size_t n, off_t at, const std::string& what) {
  const auto* p = static_cast<const char*>(data);
  for (size_t done = 0; done < n;) {
    const ssize_t w = detail::check_syscall(
        "pwrite", what, [&] { return ::pwrite(fd, p + done, n - done, at + off_t(done)); });
    done += static_cast<size_t>(w);
  }
}

/// Reads exactly `n` bytes at `at`; false when the file ends first.
bool pread_all(int fd, void* data, size_t n, off_t at, const std::string& what) {
  auto* p = static_cast<char*>(data);
  for (size_t done = 0; done < n;) {
    const ssize_t r = detail::check_syscall(
        "pread", what, [&] { return ::pread(fd, p + done, n - done, at + off_t(done)); });
    if (r == 0) return false;
    done += static_cast<size_t>(r);
  }
  return true;
}

struct Slot {
  int fd = -1;
  std::string label;               // for messages: "snapshot slot fd 5"
  std::optional<SlotHeader> head;  // valid header as last read or written
};

/// The slot's header if it is valid (magic, its own crc, the file long enough), else nullopt.
std::optional<SlotHeader> read_header(const Slot& s) {
  SlotHeader h;
  if (!pread_all(s.fd, &h, sizeof h, 0, s.label)) return std::nullopt;
  if (h.magic != kSlotMagic || h.header_crc != header_crc(h) || h.sequence == 0) {
    return std::nullopt;
  }
  struct stat st {};
  detail::check_syscall("fstat", s.label, [&] { return ::fstat(s.fd, &st); });
  if (static_cast<uint64_t>(st.st_size) < kHeaderBytes + h.payload_bytes) return std::nullopt;
  return h;
}

/// The slot's payload when its crc matches the header's.
std::optional<std::string> read_payload(const Slot& s, const SlotHeader& h) {
  std::string bytes(h.payload_bytes, '\0');
  if (!pread_all(s.fd, bytes.data(), bytes.size(), kHeaderBytes, s.label)) return std::nullopt;
  if (crc_of(bytes.data(), bytes.size()) != h.payload_crc) return std::nullopt;
  return bytes;
}

/// Parses kElasticStateFdsEnv ("A,B"): two open regular files (memfds), distinct.
std::array<Slot, 2> slots_from_env(const std::string& value) {
  auto bad = [&](std::string_view why) {
    return ValueError(
        fmt::format("{}='{}': {} (want two open memfd numbers, \"FD_A,FD_B\", as "
                    "`torchpar run` sets it)",
                    kElasticStateFdsEnv, value, why));
  };
  const auto comma = value.find(',');
  if (comma == std::string::npos) throw bad("no comma");
  std::array<Slot, 2> slots;
  const std::array<std::string_view, 2> parts = {std::string_view(value).substr(0, comma),
                                                 std::string_view(value).substr(comma + 1)};
  for (size_t i = 0; i < 2; ++i) {
    int fd = -1;
    const auto [end, ec] = std::from_chars(parts[i].data(), parts[i].data() + parts[i].size(), fd);
    if (ec != std::errc() || end != parts[i].data() + parts[i].size() || parts[i].empty() ||
        fd < 0) {
      throw bad(fmt::format("'{}' is not a file descriptor number", parts[i]));
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      throw bad(fmt::format("fd {} is not open in this process ({})", fd, std::strerror(errno)));
    }
    if (!S_ISREG(st.st_mode)) throw bad(fmt::format("fd {} is not a memfd or regular file", fd));
    slots[i].fd = fd;
    slots[i].label = fmt::format("snapshot slot fd {}", fd);
  }
  if (slots[0].fd == slots[1].fd) throw bad("both slots are the same fd");
  return slots;
}

// ---- checkpoint files --------------------------------------------------------------------------

/// N of "step_<N>.pt" (digits only), else nullopt.
std::optional<int64_t> checkpoint_step(std::string_view name) {
  constexpr std::string_view kPrefix = "step_", kSuffix = ".pt";
  if (name.size() <= kPrefix.size() + kSuffix.size() || !name.starts_with(kPrefix) ||
      !name.ends_with(kSuffix)) {
    return std::nullopt;
  }
  const std::string_view digits =
      name.substr(kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size());
  int64_t n = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), n);
  if (ec != std::errc() || end != digits.data() + digits.size() || n < 0 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  return n;
}

/// The complete checkpoints of `dir` by step (regular, non-empty step_<N>.pt files).
std::vector<std::pair<int64_t, std::filesystem::path>> list_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::filesystem::path>> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const auto step = checkpoint_step(e.path().filename().string());
    std::error_code ec2;
    if (step && e.is_regular_file(ec2) && e.file_size(ec2) > 0 && !ec2) {
      out.emplace_back(*step, e.path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string read_file(const std::string& path) {
  UniqueFd fd(detail::check_syscall("open", path,
                                    [&] { return ::open(path.c_str(), O_RDONLY | O_CLOEXEC); }));
  struct stat st {};
  detail::check_syscall("fstat", path, [&] { return ::fstat(fd.get(), &st); });
  std::string bytes(static_cast<size_t>(st.st_size), '\0');
  if (!pread_all(fd.get(), bytes.data(), bytes.size(), 0, path)) {
    throw SerializationError(fmt::format("ElasticState: '{}' shrank while read", path));
  }
  return bytes;
}

void fsync_dir(const std::string& dir) {
  UniqueFd fd(detail::check_syscall(
      "open", dir, [&] { return ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); }));
  detail::check_syscall("fsync", dir, [&] { return ::fsync(fd.get()); });
}

}  // namespace torchpar::detail::elastic_state

namespace torchpar {

// ---- ElasticState ----------------------------------------------------------------------------

struct ElasticState::Impl {
  using Kind = detail::elastic_state::Kind;
  using Slot = detail::elastic_state::Slot;
  struct Entry {
    std::string name;
    Kind kind;
    std::variant<torch::nn::Module*, torch::optim::Optimizer*, int64_t*> target;
  };
  std::vector<Entry> entries;
  std::optional<std::array<Slot, 2>> slots;

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

  size_t last_bytes = 0;  // of the last to_bytes: the next one reserves as much

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

  /// The newest whole snapshot of this rank's slots: (step, bytes).
  std::optional<std::pair<int64_t, std::string>> newest_snapshot() {
    namespace es = detail::elastic_state;
    if (!slots) return std::nullopt;
    std::array<size_t, 2> order = {0, 1};
    for (auto& s : *slots) s.head = es::read_header(s);
    auto seq = [&](size_t i) { return (*slots)[i].head ? (*slots)[i].head->sequence : 0; };
    if (seq(1) > seq(0)) std::swap(order[0], order[1]);
    for (size_t i : order) {
      const es::Slot& s = (*slots)[i];
      if (!s.head) continue;
      if (auto bytes = es::read_payload(s, *s.head))
        return std::pair{s.head->step, std::move(*bytes)};
    }
    return std::nullopt;
  }
};

ElasticState::ElasticState() : impl_(std::make_unique<Impl>()) {
  namespace es = detail::elastic_state;
  const auto fds = env_value(kElasticStateFdsEnv);
  if (!fds || fds->empty()) return;
  impl_->slots = es::slots_from_env(*fds);
  for (auto& s : *impl_->slots) s.head = es::read_header(s);
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
  namespace es = detail::elastic_state;
  if (!impl_->slots) return;
  auto& slots = *impl_->slots;
  auto seq = [&](const es::Slot& s) { return s.head ? s.head->sequence : 0; };
  // The older slot (or an invalid one): the newer stays whole while this one is written.
  es::Slot& target = seq(slots[0]) <= seq(slots[1]) ? slots[0] : slots[1];
  target.head.reset();
  const std::array<char, es::kHeaderBytes> zero{};
  es::pwrite_all(target.fd, zero.data(), zero.size(), 0, target.label);  // invalid while written
  // The archive streams into the slot (no buffer of its size: after the first snapshot the
  // memfd's pages exist, and writing them costs no page faults), its crc32 computed on the way.
  es::SlotHeader h;
  uLong crc = crc32_z(0L, Z_NULL, 0);
  uint64_t written = 0;
  std::exception_ptr failed;
  try {
    impl_->save(step, [&](const void* data, size_t n) -> size_t {
      try {
        es::pwrite_all(target.fd, data, n, static_cast<off_t>(es::kHeaderBytes + written),
                       target.label);
      } catch (...) {  // not through LibTorch's zip writer (C code): rethrown below
        failed = std::current_exception();
        return 0;
      }
      crc = crc32_z(crc, static_cast<const Bytef*>(data), n);
      written += n;
      return n;
    });
  } catch (const c10::Error&) {
    if (!failed) throw;
  }
  if (failed) std::rethrow_exception(failed);
  const off_t size = static_cast<off_t>(es::kHeaderBytes + written);
  struct stat st {};
  detail::check_syscall("fstat", target.label, [&] { return ::fstat(target.fd, &st); });
  if (st.st_size != size) {  // a smaller state than the slot's previous one
    detail::check_syscall("ftruncate", target.label, [&] { return ::ftruncate(target.fd, size); });
  }
  h.magic = es::kSlotMagic;
  h.sequence = std::max(seq(slots[0]), seq(slots[1])) + 1;
  h.step = step;
  h.payload_bytes = written;
  h.payload_crc = static_cast<uint32_t>(crc);
  h.header_crc = es::header_crc(h);
  es::pwrite_all(target.fd, &h, sizeof h, 0, target.label);
  target.head = h;
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
  detail::write_file_atomically(path, to_bytes(step));
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
  auto mem = impl_->newest_snapshot();
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
