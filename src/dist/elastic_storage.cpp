#include "dist/elastic_storage.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <exception>

#include "torchpar/core/error.h"
#include "torchpar/core/fd.h"
#include "torchpar/core/syscall.h"
#include "torchpar/dist/elastic_state.h"

namespace torchpar::detail::elastic_state {
namespace {

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
    const ssize_t w = check_syscall(
        "pwrite", what, [&] { return ::pwrite(fd, p + done, n - done, at + off_t(done)); });
    done += static_cast<size_t>(w);
  }
}

/// Reads exactly `n` bytes at `at`; false when the file ends first.
bool pread_all(int fd, void* data, size_t n, off_t at, const std::string& what) {
  auto* p = static_cast<char*>(data);
  for (size_t done = 0; done < n;) {
    const ssize_t r = check_syscall(
        "pread", what, [&] { return ::pread(fd, p + done, n - done, at + off_t(done)); });
    if (r == 0) return false;
    done += static_cast<size_t>(r);
  }
  return true;
}

/// Streams a payload into a slot after its header, computing its crc32: the zip writer's many
/// small pieces (headers, small records) are gathered in `pending` (kept across snapshots, so
/// its pages are not faulted in again), large ones go straight to the memfd.
class SlotWriter {
 public:
  SlotWriter(const SnapshotSlots::Slot& slot, std::string& pending)
      : slot_(slot), pending_(pending) {
    pending_.clear();
  }
  void write(const void* data, size_t n) {
    crc_ = crc32_z(crc_, static_cast<const Bytef*>(data), n);
    if (n >= kDirectBytes) {
      flush();
      put(data, n);
      return;
    }
    pending_.append(static_cast<const char*>(data), n);
    if (pending_.size() >= kPendingBytes) flush();
  }
  void flush() {
    put(pending_.data(), pending_.size());
    pending_.clear();
  }
  uint64_t written() const { return written_; }
  uint32_t crc() const { return static_cast<uint32_t>(crc_); }

 private:
  static constexpr size_t kDirectBytes = 64 << 10;
  static constexpr size_t kPendingBytes = 1 << 20;
  void put(const void* data, size_t n) {
    pwrite_all(slot_.fd, data, n, static_cast<off_t>(kHeaderBytes + written_), slot_.label);
    written_ += n;
  }
  const SnapshotSlots::Slot& slot_;
  std::string& pending_;
  uint64_t written_ = 0;
  uLong crc_ = crc32_z(0L, Z_NULL, 0);
};

/// The slot's header if it is valid (magic, its own crc, the file long enough), else nullopt.
std::optional<SlotHeader> read_header(const SnapshotSlots::Slot& s) {
  SlotHeader h;
  if (!pread_all(s.fd, &h, sizeof h, 0, s.label)) return std::nullopt;
  if (h.magic != kSlotMagic || h.header_crc != header_crc(h) || h.sequence == 0) {
    return std::nullopt;
  }
  struct stat st {};
  check_syscall("fstat", s.label, [&] { return ::fstat(s.fd, &st); });
  if (static_cast<uint64_t>(st.st_size) < kHeaderBytes + h.payload_bytes) return std::nullopt;
  return h;
}

/// The slot's payload when its crc matches the header's.
std::optional<std::string> read_payload(const SnapshotSlots::Slot& s, const SlotHeader& h) {
  std::string bytes(h.payload_bytes, '\0');
  if (!pread_all(s.fd, bytes.data(), bytes.size(), kHeaderBytes, s.label)) return std::nullopt;
  if (crc_of(bytes.data(), bytes.size()) != h.payload_crc) return std::nullopt;
  return bytes;
}

}  // namespace

SnapshotSlots SnapshotSlots::from_env(const std::string& value) {
  auto bad = [&](std::string_view why) {
    return ValueError(
        fmt::format("{}='{}': {} (want two open memfd numbers, \"FD_A,FD_B\", as "
                    "`torchpar run` sets it)",
                    kElasticStateFdsEnv, value, why));
  };
  const auto comma = value.find(',');
  if (comma == std::string::npos) throw bad("no comma");
  SnapshotSlots out;
  auto& slots = out.slots_;
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
  for (auto& s : slots) {
    const auto h = read_header(s);
    s.sequence = h ? h->sequence : 0;
  }
  return out;
}

std::optional<std::pair<int64_t, std::string>> SnapshotSlots::newest() {
  std::array<std::optional<SlotHeader>, 2> heads;
  for (size_t i = 0; i < 2; ++i) {
    heads[i] = read_header(slots_[i]);
    slots_[i].sequence = heads[i] ? heads[i]->sequence : 0;
  }
  const size_t first = slots_[1].sequence > slots_[0].sequence ? 1 : 0;
  for (size_t i : {first, 1 - first}) {
    if (!heads[i]) continue;
    if (auto bytes = read_payload(slots_[i], *heads[i])) {
      return std::pair{heads[i]->step, std::move(*bytes)};
    }
  }
  return std::nullopt;
}

void SnapshotSlots::write(int64_t step, const std::function<void(const PieceWriter&)>& save) {
  // The older slot (or an invalid one): the newer stays whole while this one is written.
  Slot& target = slots_[0].sequence <= slots_[1].sequence ? slots_[0] : slots_[1];
  const uint64_t sequence = std::max(slots_[0].sequence, slots_[1].sequence) + 1;
  target.sequence = 0;
  const std::array<char, kHeaderBytes> zero{};
  pwrite_all(target.fd, zero.data(), zero.size(), 0, target.label);  // invalid while written
  SlotWriter out(target, pending_);
  std::exception_ptr failed;
  try {
    save([&](const void* data, size_t n) -> size_t {
      try {
        out.write(data, n);
      } catch (...) {  // not through LibTorch's zip writer (C code): rethrown below
        failed = std::current_exception();
        return 0;
      }
      return n;
    });
    out.flush();
  } catch (const c10::Error&) {
    if (!failed) throw;
  }
  if (failed) std::rethrow_exception(failed);
  const off_t size = static_cast<off_t>(kHeaderBytes + out.written());
  struct stat st {};
  check_syscall("fstat", target.label, [&] { return ::fstat(target.fd, &st); });
  if (st.st_size != size) {  // a smaller state than the slot's previous one
    check_syscall("ftruncate", target.label, [&] { return ::ftruncate(target.fd, size); });
  }
  SlotHeader h;
  h.magic = kSlotMagic;
  h.sequence = sequence;
  h.step = step;
  h.payload_bytes = out.written();
  h.payload_crc = out.crc();
  h.header_crc = header_crc(h);
  pwrite_all(target.fd, &h, sizeof h, 0, target.label);
  target.sequence = sequence;
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
  UniqueFd fd(
      check_syscall("open", path, [&] { return ::open(path.c_str(), O_RDONLY | O_CLOEXEC); }));
  struct stat st {};
  check_syscall("fstat", path, [&] { return ::fstat(fd.get(), &st); });
  std::string bytes(static_cast<size_t>(st.st_size), '\0');
  if (!pread_all(fd.get(), bytes.data(), bytes.size(), 0, path)) {
    throw SerializationError(fmt::format("ElasticState: '{}' shrank while read", path));
  }
  return bytes;
}

void fsync_dir(const std::string& dir) {
  UniqueFd fd(check_syscall(
      "open", dir, [&] { return ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); }));
  check_syscall("fsync", dir, [&] { return ::fsync(fd.get()); });
}

}  // namespace torchpar::detail::elastic_state
