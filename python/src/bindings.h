#pragma once
// torchpar._C: the parts of the extension module (python/src/). Each binds its share of the
// C++ runtime on the module; module.cpp calls them in order.

#include <Python.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include "torchpar/core/error.h"

namespace torchpar::python {

// Waiting with the GIL released: every blocking call waits in slices of at most kSlice,
// between which it takes the GIL back to run Python's signal handlers (Ctrl-C interrupts
// it, as it does Python's own waits).
using Clock = std::chrono::steady_clock;
inline constexpr std::chrono::duration<double> kSlice = std::chrono::milliseconds(100);

/// `timeout` (seconds; None: no limit; negative counts as 0, as Python's queues and locks
/// do) as a deadline. ValueError for NaN.
inline std::optional<Clock::time_point> deadline_of(std::optional<double> timeout) {
  if (!timeout) return std::nullopt;
  if (std::isnan(*timeout)) throw ValueError("timeout is NaN");
  const double s = std::clamp(*timeout, 0.0, 1e7);
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

/// The next slice to wait before `deadline`: at most kSlice, 0 once it passed.
inline std::chrono::duration<double> slice_until(const std::optional<Clock::time_point>& deadline) {
  if (!deadline) return kSlice;
  return std::clamp(std::chrono::duration<double>(*deadline - Clock::now()),
                    std::chrono::duration<double>(0), kSlice);
}

/// Runs Python's signal handlers (with the GIL held); what they raise propagates.
inline void check_signals() {
  if (PyErr_CheckSignals() != 0) throw pybind11::error_already_set();
}

/// A Python timeout argument: None or seconds.
inline std::optional<double> optional_timeout(const pybind11::object& timeout) {
  if (timeout.is_none()) return std::nullopt;
  return timeout.cast<double>();
}

/// The exception classes (torchpar.Error, ClosedError, ...) and the translator from
/// torchpar's C++ errors to them and to Python's own (queue.Empty, TimeoutError, ...).
void bind_errors(pybind11::module_& m);

/// Queue (the shared ring carrying a pickle and its tensors) and Connection (a Pipe end).
void bind_channels(pybind11::module_& m);

/// Semaphore, Mutex (RLock), Event, ConditionWord, Barrier and SharedBuffer: the process-
/// shared pieces torchpar/multiprocessing/synchronize.py and sharedctypes.py build on.
void bind_sync(pybind11::module_& m);

}  // namespace torchpar::python
