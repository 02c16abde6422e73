#pragma once
// The parent's side of `torchpar train` that every model shares: the progress line and the
// files in --out (each written through a temporary file and a rename; curves.png drawn by
// tools/plot_curves.py).

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "trainer.h"

namespace torchpar::train {

/// One progress line, redrawn in place on a terminal; on anything else a plain line each time
/// another tenth of `total` is done.
///
///   tty:   epoch 1/3 [#########.....................]  18000/60000  loss 0.9123     9411 samples/s
///   other: epoch 1/3  30% 18000/60000 samples, loss 0.9123, 9411 samples/s
class ProgressBar {
 public:
  /// `label` starts the line ("epoch 1/3"); update()'s `done` counts up to `total`, in `unit`
  /// ("samples"); `rate_unit` names update()'s rate ("samples/s").
  ProgressBar(std::string label, int64_t total, std::string unit, std::string rate_unit);

  /// Draws `done` of total with the running `loss` and `rate`.
  void update(int64_t done, double loss, double rate);
  /// Ends the line on a terminal (before other output); a later update() starts a new one.
  void finish();

 private:
  std::string label_, unit_, rate_unit_;
  int64_t total_;
  bool tty_;
  int last_decile_ = -1;
};

/// "20261122-065012": the default --out is runs/<now_stamp()>.
std::string now_stamp();

/// Writes `bytes` to dir/name through a temporary file and a rename: never half-written.
/// Throws torchpar::Error naming the file when it cannot.
void write_atomic(const std::filesystem::path& dir, const std::string& name,
                  const std::string& bytes);

/// Checks that --out can be written before training: an unwritable --out must not cost a
/// whole run. Returns 2 (after a message) when it cannot, else 0.
int check_out_writable(const TrainConfig& cfg);

/// What every model's metrics.json holds beside its own fields: seed, threads_per_worker,
/// limit, data, status (and error, when there is one), and the versions of torchpar, LibTorch
/// and the compiler.
void add_run_metrics(nlohmann::json& j, const TrainConfig& cfg, const std::string& status,
                     const std::string& error);

/// dir/curves.png from dir/metrics.json (tools/plot_curves.py, run with an argv, never a
/// shell); a warning on stderr when it cannot be drawn.
void draw_curves(const std::filesystem::path& dir);

}  // namespace torchpar::train
