#pragma once
// Where ElasticState's bytes live: the two in-memory snapshot slots a launcher's agent hands a
// rank (memfds, TORCHPAR_ELASTIC_STATE_FDS), and checkpoint files step_<N>.pt.

#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace torchpar::detail::elastic_state {

/// Writes a payload piece by piece (LibTorch's OutputArchive::save_to writer): returns the
/// bytes taken, 0 on failure.
using PieceWriter = std::function<size_t(const void*, size_t)>;

/// A rank's two snapshot slots. Each memfd holds a 64-byte header (magic "TPELSNP1",
/// sequence number, step, payload bytes, crc32 of the payload, crc32 of the header) and the
/// payload. A write goes to the older slot: its header cleared, the payload streamed, the
/// header written last, so a writer killed at any point leaves the other slot whole.
/// Safety: not thread-safe; one object per process (the slots are the process's).
class SnapshotSlots {
 public:
  /// Parses the variable's value "FD_A,FD_B": two distinct open regular files (memfds), read
  /// as they are (the agent keeps them; they are never closed here).
  /// Errors: ValueError naming kElasticStateFdsEnv and what is wrong.
  static SnapshotSlots from_env(const std::string& value);

  /// The newest whole snapshot (valid header, payload crc matching; the other slot when the
  /// newer one is not whole): (step, payload), or nullopt.
  /// Errors: SystemError when a slot cannot be read.
  std::optional<std::pair<int64_t, std::string>> newest();

  /// Writes what `save` writes through the PieceWriter it is given, tagged `step`, into the
  /// older slot, computing its crc32 on the way (pieces are gathered in a buffer kept across
  /// writes, large ones go straight to the memfd: no buffer of the payload's size).
  /// Errors: SystemError when the slot cannot be written (the other slot is untouched);
  /// whatever `save` throws.
  void write(int64_t step, const std::function<void(const PieceWriter&)>& save);

  struct Slot {
    int fd = -1;
    std::string label;      // for messages: "snapshot slot fd 5"
    uint64_t sequence = 0;  // of its valid header as last read or written; 0: none
  };

 private:
  std::array<Slot, 2> slots_;
  std::string pending_;
};

/// N of "step_<N>.pt" (digits only), else nullopt.
std::optional<int64_t> checkpoint_step(std::string_view name);
/// The complete checkpoints of `dir` by step, oldest first (regular, non-empty step_<N>.pt
/// files; nothing when `dir` does not exist).
std::vector<std::pair<int64_t, std::filesystem::path>> list_checkpoints(const std::string& dir);
/// The bytes of the file `path`. Errors: SystemError naming it.
std::string read_file(const std::string& path);
/// fsync of the directory `dir` (a rename in it survives a crash of the host).
void fsync_dir(const std::string& dir);

}  // namespace torchpar::detail::elastic_state
