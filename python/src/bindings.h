#pragma once
// torchpar._C: the parts of the extension module (python/src/). Each binds its share of the
// C++ runtime on the module; module.cpp calls them in order.

#include <pybind11/pybind11.h>

namespace torchpar::python {

/// The exception classes (torchpar.Error, ClosedError, ...) and the translator from
/// torchpar's C++ errors to them and to Python's own (queue.Empty, TimeoutError, ...).
void bind_errors(pybind11::module_& m);

/// Queue (the shared ring carrying a pickle and its tensors) and Connection (a Pipe end).
void bind_channels(pybind11::module_& m);

}  // namespace torchpar::python
