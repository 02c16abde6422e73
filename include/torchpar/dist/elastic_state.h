#pragma once
/// ElasticState: a training job's state kept in memory across the restarts of an elastic
/// job (`torchpar run --nnodes MIN:MAX`), handed to ranks that lost it (a new node, a
/// restarted rank) by a broadcast from a rank that holds it, with a disk checkpoint as the
/// fallback. torchrun's elastic agent restarts every worker from scratch and leaves state to
/// the user's checkpoint file (torch.distributed.elastic's "train_loop ... load_checkpoint");
/// torchft keeps it in memory: this is the latter for torchpar's launcher.

#include <torch/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace torchpar {

class CollectiveGroup;

/// The environment variable through which `torchpar run` in elastic mode hands each local
/// rank its two snapshot slots: "FD_A,FD_B", two memfds the node's agent owns (they outlive
/// the rank, die with the agent, and are never in /dev/shm).
inline constexpr const char* kElasticStateFdsEnv = "TORCHPAR_ELASTIC_STATE_FDS";

/// Where a restored state came from.
enum class StateSource {
  kNone,       ///< nothing held anywhere: start from scratch (step 0)
  kMemory,     ///< a rank's in-memory snapshot (this node's agent kept it), broadcast
  kCheckpoint  ///< the newest complete checkpoint under the given directory
};

/// What restore() found.
struct RestoreResult {
  StateSource source = StateSource::kNone;
  int64_t step = 0;      ///< the step the state was saved at (0 when kNone)
  int from_rank = -1;    ///< the rank whose snapshot was broadcast (kMemory), else -1
  double seconds = 0.0;  ///< wall time restore() took (the collective included)
  /// kCheckpoint: the file loaded, as rank 0 named it (every rank gets the same text).
  std::string checkpoint_path{};
};

/// The state of one rank's training: named modules' state dicts, optimizers, and integer
/// counters (epoch, step, the sampler's position: whatever the loop needs to continue).
///
///   torchpar::ElasticState state;
///   state.add("model", model);
///   state.add("optimizer", optimizer);
///   state.add_counter("epoch", &epoch);
///   state.add_counter("position", &position);     // samples of this epoch consumed
///   auto r = state.restore(group, "ckpt");          // collective; step 0 when fresh
///   for (int64_t step = r.step; ...; ++step) {
///     ...
///     state.snapshot(step + 1);                     // memory: cheap, every step
///     if ((step + 1) % 100 == 0) state.save_checkpoint("ckpt", step + 1);  // rank 0 only
///   }
///
/// The bytes (to_bytes, a snapshot's payload, a checkpoint file) are one LibTorch archive
/// (torch::serialize::OutputArchive, a TorchScript zip: Python's torch.jit.load reads it):
/// "format" = "torchpar.elastic_state.v1", "step", "names", "kinds", "counters" (the
/// counters' values in registration order), and per module / optimizer entry i a nested
/// archive "e<i>" written by Module::save / Optimizer::save.
///
/// Snapshot slots: each memfd holds a 64-byte header (magic "TPELSNP1", sequence number,
/// step, payload bytes, crc32 of the payload, crc32 of the header) and the payload. A
/// snapshot clears the older slot's header, writes the payload, then the header: a rank
/// killed mid-write leaves that slot invalid and the other whole; restore() takes the valid
/// slot (both crcs match) with the higher sequence number.
///
/// Lifetime: registered objects must outlive the ElasticState. Snapshots live in the
/// memfds of kElasticStateFdsEnv (owned by the launcher's agent, which keeps them across the
/// restarts of its ranks; the rank never closes them); without that variable snapshot() does
/// nothing and restore() only reads checkpoints. One ElasticState per process: two would
/// write the same slots.
/// Safety: not thread-safe; use from the training thread.
/// Source: torch.distributed.elastic's "save a checkpoint, load it on restart" train loop
///         (torchrun's docs), torchft's in-memory state transfer to recovering replicas.
class ElasticState {
 public:
  /// Reads kElasticStateFdsEnv. Errors: ValueError naming the variable when it is set but
  /// not two distinct open regular files (memfds), "FD_A,FD_B".
  ElasticState();
  ~ElasticState();
  ElasticState(const ElasticState&) = delete;
  ElasticState& operator=(const ElasticState&) = delete;

  /// Registers a module (its parameters and buffers) or an optimizer (its state and
  /// hyper-parameters) under `name`. Errors: ValueError on a repeated or empty name.
  void add(const std::string& name, torch::nn::Module& module);
  void add(const std::string& name, torch::optim::Optimizer& optimizer);
  /// Registers an integer the loop owns; restore() writes it back. Errors: ValueError on a
  /// repeated or empty name or a null pointer.
  ///
  /// A module's parameters and buffers are restored in place (copy_ under NoGradGuard, so
  /// views, DistributedDataParallel's hooks and shared memory stay valid); a module that
  /// overrides Module::save must keep LibTorch's layout (one attribute per parameter,
  /// buffer and child). An optimizer is restored with Optimizer::load.
  void add_counter(const std::string& name, int64_t* value);

  /// Whether the launcher gave this rank snapshot slots (kElasticStateFdsEnv).
  bool has_memory() const;

  /// Writes the registered state, tagged `step`, into this rank's in-memory slot (the older
  /// of its two, so a rank killed mid-write leaves the previous snapshot whole). Does nothing
  /// without slots. Units: `step` is the caller's count of completed optimizer steps.
  /// Cost: the archive streams into the memfd (no buffer of the state's size; after the
  /// first snapshot of a slot its pages exist) with a crc32 on the way. Measured on the
  /// 2-core VM (docs/training.md): 0.4-0.5 ms for `torchpar train`'s mnist Net with SGD
  /// (195 KB), 28-31 ms for its default gpt with AdamW (3.3 M parameters, 39 MB).
  /// Errors: SystemError when the slot cannot be written (memory exhausted); the other
  /// slot still holds the previous snapshot.
  void snapshot(int64_t step);

  /// Writes the registered state atomically (a temporary file, then rename) as
  /// `dir`/step_<step>.pt, creating `dir`; keeps the newest `keep` files. Call it on one
  /// rank (rank 0): every rank's state is the same in data-parallel training. The file is
  /// written to step_<step>.pt.tmp.<pid> beside it, fsync'ed, renamed, and the directory
  /// fsync'ed: a writer killed at any point leaves the previous checkpoints as they were
  /// (and a temporary file, which latest_checkpoint ignores and the next save removes).
  /// Memory: the file's bytes are assembled in a buffer the ElasticState keeps for the next
  /// checkpoint (about the state's size).
  /// Errors: ValueError for an empty `dir`, step < 0 or keep < 1; SystemError naming the
  /// path when it cannot be written (the temporary file is removed).
  void save_checkpoint(const std::string& dir, int64_t step, int keep = 2);

  /// Collective over `group`: finds the newest state any rank holds in memory and
  /// broadcasts it from the lowest such rank; when no rank holds one, loads the newest
  /// complete checkpoint of `checkpoint_dir` (if given); else leaves everything as it is.
  /// A snapshot is newer than a checkpoint of an equal or lower step.
  ///
  /// Protocol: one all_reduce (max) of two int64s: every rank's newest whole snapshot step
  /// (-1 without one) and group rank 0's newest checkpoint step (-1 on the others); then
  /// from the chosen rank a broadcast of the lengths and one of the bytes (uint8), and
  /// every rank calls from_bytes. Only group rank 0 reads `checkpoint_dir` (the others'
  /// value is ignored): the directory needs to exist on rank 0's host only.
  /// Errors: SerializationError on a checkpoint or snapshot that does not match the
  /// registered objects (names, kinds, dtypes, shapes; the message names the entry and, for
  /// a checkpoint, the file), on every rank alike; torchpar::Error on every rank when rank 0
  /// cannot read the checkpoint it chose (rank 0 raises the SystemError); the group's
  /// errors (TimeoutError, RankLostError). A mismatch found before anything changed leaves
  /// the objects as they were (modules' shapes, names, kinds); an optimizer that refuses its
  /// saved groups raises after earlier optimizers loaded.
  /// Safety: collective; every rank of `group` calls it with the same registrations.
  RestoreResult restore(CollectiveGroup& group,
                        const std::optional<std::string>& checkpoint_dir = std::nullopt);

  /// The registered state as bytes (what snapshots and checkpoints hold), tagged `step`.
  std::string to_bytes(int64_t step) const;
  /// Restores the registered objects from to_bytes' output; returns its step.
  /// Errors: SerializationError naming what does not match (see restore()).
  int64_t from_bytes(const std::string& bytes);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// The newest complete checkpoint in `dir` (the regular, non-empty step_<N>.pt with the
/// largest N; temporary files of interrupted writes are not checkpoints), if any; nullopt
/// also when `dir` does not exist. Safety: thread-safe.
std::optional<std::string> latest_checkpoint(const std::string& dir);

}  // namespace torchpar
