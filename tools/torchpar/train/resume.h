#pragma once
// `torchpar train`'s checkpoints, in-memory snapshots and resume (--checkpoint-every,
// --snapshot-every, --resume; docs/training.md, "Checkpoints, snapshots and resume"), shared
// by the mnist and gpt models as ranks of a job: an ElasticState holding the model, its
// optimizer and the run's position, restored once before training and saved after steps.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "torchpar/dist/elastic_state.h"
#include "torchpar/torchpar.h"
#include "trainer.h"

namespace torchpar::train {

/// --checkpoint-every and --resume need --strategy ddp run as the ranks of a job (`env_rank`);
/// --snapshot-every does nothing without a launcher's slots, so it is never refused. Returns 2
/// (after a message naming the option) when they were given otherwise, else 0.
int check_resume_options(const TrainConfig& cfg, bool env_rank);

/// The run's resumable state. Counters: `epoch` (1-based, the epoch being trained; mnist),
/// `position` (samples of that epoch consumed by the whole job, whatever its world size; mnist)
/// and `step` (optimizer steps completed; both models). The gpt model's data position is its
/// step (its windows are drawn from a generator seeded by the seed, the rank and the step).
class Resumable {
 public:
  /// `lead`: this rank prints and writes checkpoints (rank 0). Register the model and optimizer
  /// on state() before restore().
  Resumable(const TrainConfig& cfg, bool lead);

  ElasticState& state() { return state_; }

  /// Collective: the newest state of the job's memory (snapshots the launcher's agent kept) or
  /// checkpoints: --resume DIR when given, else --checkpoint-dir after a restart
  /// (World::rendezvous_round() > 0) and under torchrun (TORCHELASTIC_RUN_ID without
  /// TORCHPAR_RDZV_ROUND: its restarts after a membership change are not counted). On the lead
  /// prints "resumed at epoch E step S from memory (rank R) in X s" or "... from checkpoint PATH in
  /// X s". Returns false after a message when --resume names a directory without a checkpoint and
  /// no rank holds a snapshot (exit 2).
  bool restore(CollectiveGroup& group, const World& world);

  /// After each optimizer step (`step` already counts it): a snapshot every --snapshot-every
  /// steps when the launcher gave this rank slots; on the lead a checkpoint every
  /// --checkpoint-every steps ("checkpoint step S -> PATH" on stdout).
  void after_step();

  /// metrics.json's "elastic": what was restored, and the snapshots' and checkpoints' counts
  /// and mean times.
  nlohmann::json metrics() const;

  int64_t epoch = 1;
  int64_t position = 0;
  int64_t step = 0;

 private:
  TrainConfig cfg_;
  bool lead_;
  ElasticState state_;
  std::optional<RestoreResult> restored_;
  int64_t snapshots_ = 0, checkpoints_ = 0;
  double snapshot_seconds_ = 0, checkpoint_seconds_ = 0;
};

}  // namespace torchpar::train
