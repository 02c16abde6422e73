#pragma once
// What the collective benchmarks whose ranks are processes (coll_bench, scaleout_bench)
// share: their list options and how they time calls, so their JSON lines mean the same.

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

namespace torchpar::bench {

/// Timed calls for a message of `bytes`: `iters` up to 1 MiB, max(3, iters x 1 MiB / bytes)
/// above (big messages take long; the peers in bench/peers/ shrink the same way).
inline int iters_for(long bytes, int iters) {
  return bytes > (1L << 20) ? std::max(3, static_cast<int>(1L * iters * (1L << 20) / bytes))
                            : iters;
}

/// Untimed calls before them: max(1, min(warmup, timed)), as the peers in bench/peers/ do (a
/// 64 MiB all_gather over Gloo takes ~0.9 s here: ten warm-ups of it were most of a run).
inline int warmup_for(int timed, int warmup) { return std::max(1, std::min(warmup, timed)); }

/// Statistics of one rank's timed calls, in microseconds.
struct CallTimes {
  double median_us = 0;  // the upper median: sorted[n / 2]
  double p99_us = 0;     // nearest rank: sorted[ceil(0.99 n) - 1] (the maximum below 100 calls)
  double min_us = 0;     // the fastest call
};

/// Runs `call` `iters` (>= 1) times, each timed alone with steady_clock.
/// The times' buffer is written before the first call: a fresh heap page first touched in
/// the loop costs 3-5 us on these VMs, and in a collective the other ranks wait for it (a
/// 4 KiB all_reduce's p99 was such a fault, of the other rank's buffer).
template <typename Call>
CallTimes time_calls(int iters, Call&& call) {
  std::vector<double> us(static_cast<size_t>(iters), 0.0);
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    us[static_cast<size_t>(i)] =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  }
  std::sort(us.begin(), us.end());
  return {us[us.size() / 2], us[(us.size() * 99 + 99) / 100 - 1], us.front()};
}

}  // namespace torchpar::bench
