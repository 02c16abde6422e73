#include "resume.h"

#include "workers.h"  // Clock

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include "torchpar/core/env.h"

namespace torchpar::train {

int check_resume_options(const TrainConfig& cfg, bool env_rank) {
  if (cfg.checkpoint_every <= 0 && cfg.resume.empty()) return 0;
  if (cfg.strategy == "ddp" && env_rank) return 0;
  std::fprintf(stderr,
               "torchpar train: %s applies to --strategy ddp run as the ranks of a job (RANK and "
               "WORLD_SIZE set by `torchpar run` or torchrun), not to --strategy %s%s; start it "
               "as `torchpar run --nproc-per-node N -- torchpar train --strategy ddp ...`\n",
               cfg.checkpoint_every > 0 ? "--checkpoint-every" : "--resume", cfg.strategy.c_str(),
               env_rank ? "" : " with spawned workers");
  return 2;
}

Resumable::Resumable(const TrainConfig& cfg, bool lead) : cfg_(cfg), lead_(lead) {
  state_.add_counter("epoch", &epoch);
  state_.add_counter("position", &position);
  state_.add_counter("step", &step);
}

bool Resumable::restore(CollectiveGroup& group, const World& world) {
  std::optional<std::string> dir;
  if (!cfg_.resume.empty()) {
    dir = cfg_.resume;
  } else if (world.rendezvous_round() > 0) {
    dir = cfg_.checkpoint_dir;  // a restart: this job's own checkpoints
  } else if (env_value("TORCHELASTIC_RUN_ID") && !env_value("TORCHPAR_RDZV_ROUND")) {
    // torchrun restarts its workers on a membership change (a node joins or leaves) without
    // counting a restart, and exports no round: any start may be a restart, so its
    // checkpoints are taken whenever there are some (torch.distributed.elastic's own advice).
    dir = cfg_.checkpoint_dir;
  }
  restored_ = state_.restore(group, dir);
  const RestoreResult& r = *restored_;
  if (r.source == StateSource::kNone) {
    if (cfg_.resume.empty()) return true;
    if (lead_) {
      std::fprintf(stderr,
                   "torchpar train: --resume %s: no complete checkpoint (step_<N>.pt) there, and "
                   "no rank holds a snapshot in memory\n",
                   cfg_.resume.c_str());
    }
    return false;
  }
  if (lead_) {
    const std::string from = r.source == StateSource::kMemory
                                 ? fmt::format("memory (rank {})", r.from_rank)
                                 : fmt::format("checkpoint {}", r.checkpoint_path);
    std::printf("resumed at epoch %lld step %lld from %s in %.2f s\n",
                static_cast<long long>(epoch), static_cast<long long>(step), from.c_str(),
                r.seconds);
    std::fflush(stdout);
  }
  return true;
}

void Resumable::after_step() {
  if (cfg_.snapshot_every > 0 && step % cfg_.snapshot_every == 0 && state_.has_memory()) {
    const auto t0 = Clock::now();
    state_.snapshot(step);
    snapshot_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
    ++snapshots_;
  }
  if (lead_ && cfg_.checkpoint_every > 0 && step % cfg_.checkpoint_every == 0) {
    const auto t0 = Clock::now();
    state_.save_checkpoint(cfg_.checkpoint_dir, step, cfg_.keep_checkpoints);
    checkpoint_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
    ++checkpoints_;
    // A line of its own (after the progress line on a terminal): tests wait for it.
    std::printf("%scheckpoint step %lld -> %s\n", ::isatty(STDOUT_FILENO) ? "\n" : "",
                static_cast<long long>(step),
                (std::filesystem::path(cfg_.checkpoint_dir) / fmt::format("step_{}.pt", step))
                    .string()
                    .c_str());
    std::fflush(stdout);
  }
}

nlohmann::json Resumable::metrics() const {
  nlohmann::json j;
  j["snapshot_every"] = cfg_.snapshot_every;
  j["memory_slots"] = state_.has_memory();
  j["snapshots"] = snapshots_;
  j["snapshot_ms_mean"] = snapshots_ ? 1e3 * snapshot_seconds_ / snapshots_ : 0.0;
  j["checkpoint_every"] = cfg_.checkpoint_every;
  j["checkpoint_dir"] = cfg_.checkpoint_dir;
  j["checkpoints"] = checkpoints_;
  j["checkpoint_ms_mean"] = checkpoints_ ? 1e3 * checkpoint_seconds_ / checkpoints_ : 0.0;
  if (restored_ && restored_->source != StateSource::kNone) {
    const RestoreResult& r = *restored_;
    j["resumed"] = {{"source", r.source == StateSource::kMemory ? "memory" : "checkpoint"},
                    {"step", r.step},
                    {"from_rank", r.from_rank},
                    {"checkpoint", r.checkpoint_path},
                    {"seconds", r.seconds}};
  }
  return j;
}

}  // namespace torchpar::train
