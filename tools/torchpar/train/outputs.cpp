#include "outputs.h"

#include <fmt/format.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <fstream>
#include <utility>

#include "torchpar/core/env.h"
#include "torchpar/core/error.h"
#include "torchpar/process/exec.h"
#include "torchpar/version.h"

namespace torchpar::train {

ProgressBar::ProgressBar(std::string label, int64_t total, std::string unit, std::string rate_unit)
    : label_(std::move(label)),
      unit_(std::move(unit)),
      rate_unit_(std::move(rate_unit)),
      total_(total),
      tty_(::isatty(STDOUT_FILENO) != 0) {}

void ProgressBar::update(int64_t done, double loss, double rate) {
  const double frac = total_ > 0 ? std::min(1.0, static_cast<double>(done) / total_) : 1;
  if (tty_) {
    const int width = 30;
    const int fill = static_cast<int>(frac * width);
    std::printf("\r%s [%s%s] %6lld/%lld  loss %.4f  %7.0f %s", label_.c_str(),
                std::string(static_cast<size_t>(fill), '#').c_str(),
                std::string(static_cast<size_t>(width - fill), '.').c_str(),
                static_cast<long long>(done), static_cast<long long>(total_), loss, rate,
                rate_unit_.c_str());
    std::fflush(stdout);
  } else if (static_cast<int>(frac * 10) > last_decile_) {
    last_decile_ = static_cast<int>(frac * 10);
    std::printf("%s %3d%% %lld/%lld %s, loss %.4f, %.0f %s\n", label_.c_str(), last_decile_ * 10,
                static_cast<long long>(done), static_cast<long long>(total_), unit_.c_str(), loss,
                rate, rate_unit_.c_str());
    std::fflush(stdout);
  }
}

void ProgressBar::finish() {
  if (tty_) std::printf("\n");
}

std::string now_stamp() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y%m%d-%H%M%S", std::localtime(&t));
  return buf;
}

void write_atomic(const std::filesystem::path& dir, const std::string& name,
                  const std::string& bytes) {
  const auto tmp = dir / ("." + name + ".tmp");
  {
    std::ofstream f(tmp, std::ios::binary);
    f << bytes;
    if (!f) throw Error(fmt::format("cannot write {}", tmp.string()));
  }
  std::filesystem::rename(tmp, dir / name);
}

int check_out_writable(const TrainConfig& cfg) {
  try {
    const std::filesystem::path dir = cfg.out;
    std::filesystem::create_directories(dir);
    write_atomic(dir, ".write_check", "");
    std::filesystem::remove(dir / ".write_check");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torchpar train: --out %s is not writable: %s\n", cfg.out.c_str(),
                 e.what());
    return 2;
  }
  return 0;
}

void add_run_metrics(nlohmann::json& j, const TrainConfig& cfg, const std::string& status,
                     const std::string& error) {
  j["seed"] = cfg.seed;
  j["threads_per_worker"] = cfg.threads_per_worker;
  j["limit"] = cfg.limit;
  j["data"] = cfg.data;
  j["status"] = status;
  if (!error.empty()) j["error"] = error;
  j["versions"] = {{"torchpar", version()},
                   {"libtorch", TORCH_VERSION},
                   {"compiler", fmt::format("gcc {}.{}", __GNUC__, __GNUC_MINOR__)}};
}

namespace {

std::string tools_dir() {
  if (auto d = env_value("TORCHPAR_TOOLS_DIR")) return *d;
#ifdef TORCHPAR_SOURCE_TOOLS_DIR
  if (std::filesystem::exists(TORCHPAR_SOURCE_TOOLS_DIR "/plot_curves.py")) {
    return TORCHPAR_SOURCE_TOOLS_DIR;
  }
#endif
#ifdef TORCHPAR_INSTALL_TOOLS_DIR
  return TORCHPAR_INSTALL_TOOLS_DIR;
#else
  return "tools";
#endif
}

}  // namespace

void draw_curves(const std::filesystem::path& dir) {
  const std::string script = tools_dir() + "/plot_curves.py";
  // argv, never a shell: --out may hold quotes, spaces or `;` (it reaches python as is).
  int code = -1;
  try {
    ExecOptions exec;
    exec.stdout_fd = STDERR_FILENO;  // the plot script's chatter is diagnostics
    code = run_program({"/usr/bin/python3", script, (dir / "metrics.json").string(),
                        (dir / "curves.png").string()},
                       exec, std::chrono::minutes(2));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torchpar train: warning: %s\n", e.what());
  }
  if (code != 0) {
    std::fprintf(stderr,
                 "torchpar train: warning: curves.png not drawn (needs /usr/bin/python3 with "
                 "python3-matplotlib and %s)\n",
                 script.c_str());
  }
}

}  // namespace torchpar::train
