#pragma once
// Subcommands of the torchpar CLI. Each registers its options on `app` and returns the
// function to run when it was chosen.

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>

namespace torchpar::cli {

using Command = std::function<int()>;

Command add_info(CLI::App& app);
Command add_run(CLI::App& app);
Command add_train(CLI::App& app);
Command add_bench(CLI::App& app);
Command add_infer(CLI::App& app);
Command add_serve(CLI::App& app);
Command add_manager(CLI::App& app);

/// The longest timeout an option takes, in seconds (about 115 days): a steady_clock deadline
/// now + 1e10 s overflows (292 years of nanoseconds), so larger values are refused, not
/// wrapped.
inline constexpr double kMaxTimeoutSeconds = 1e7;

/// A finite number in [lo, hi] ((lo, hi] with `lo_open`). CLI::PositiveNumber and
/// CLI::Range let NaN through (every comparison with NaN is false), and inf too.
inline CLI::Validator finite_number(double lo, double hi, bool lo_open = false) {
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(s.c_str(), &end);
        if (s.empty() || end != s.c_str() + s.size()) return "not a number: " + s;
        if (!std::isfinite(v) || (lo_open ? !(v > lo) : !(v >= lo)) || !(v <= hi))
          return hi == std::numeric_limits<double>::max()
                     ? fmt::format("{} is not a finite number {} {}", s, lo_open ? ">" : ">=", lo)
                     : fmt::format("{} is not a finite number in {}{}, {}]", s, lo_open ? "(" : "[",
                                   lo, hi);
        return {};
      },
      hi == std::numeric_limits<double>::max()
          ? fmt::format("FINITE {} {}", lo_open ? ">" : ">=", lo)
          : fmt::format("FINITE {}{} - {}]", lo_open ? "(" : "[", lo, hi));
}

/// A decimal integer that fits T ("-" only for a signed T). CLI11 reads integers with
/// strtoull / strtoll, which saturate what does not fit, read "-1" as 2^64 - 1 for an
/// unsigned T, and "010" as octal.
template <class T>
CLI::Validator decimal_integer() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        T v{};
        const char* first = s.data();
        const char* last = s.data() + s.size();
        if (std::is_unsigned_v<T> && !s.empty() && s[0] == '-')
          return s + " is negative; give an integer in [0, " +
                 std::to_string(std::numeric_limits<T>::max()) + "]";
        const auto [p, ec] = std::from_chars(first, last, v);
        if (ec == std::errc::result_out_of_range)
          return s + " is out of range: give an integer in [" +
                 std::to_string(std::numeric_limits<T>::min()) + ", " +
                 std::to_string(std::numeric_limits<T>::max()) + "]";
        if (s.empty() || ec != std::errc() || p != last) return "not a decimal integer: " + s;
        s = std::to_string(v);  // no leading zeros left for CLI11 to read as octal
        return {};
      },
      "INT");
}

/// The worker options `torchpar infer` and `torchpar serve` share (TensorParallelOptions'
/// dtype, backend and threads_per_worker).
inline void add_worker_options(CLI::App* cmd, std::string& dtype, std::string& backend,
                               int& threads_per_worker) {
  cmd->add_option("--dtype", dtype, "weights in the workers: float32 | bfloat16 | float16")
      ->check(CLI::IsMember({"float32", "bfloat16", "float16"}))
      ->capture_default_str();
  cmd->add_option("--backend", backend, "collectives between the workers: auto | shm | gloo")
      ->check(CLI::IsMember({"auto", "shm", "gloo"}))
      ->capture_default_str();
  cmd->add_option("--threads-per-worker", threads_per_worker,
                  "LibTorch intra-op threads per worker; 0: cores / tensor-parallel")
      ->check(CLI::Range(0, 256))
      ->capture_default_str();
}

}  // namespace torchpar::cli
