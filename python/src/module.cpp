// torchpar._C, the extension module under the Python package: torchpar's C++ runtime for
// Python (shared tensors, sharing strategies, queues, pipes). `import torch` must come first
// (torchpar/__init__.py does it): the module links LibTorch's Python bindings, whose types
// it converts torch.Tensor with.
#include <ATen/ATen.h>
#include <Python.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "bindings.h"
#include "torchpar/shm/share.h"
#include "torchpar/shm/sharing_strategy.h"
#include "torchpar/version.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "torchpar's C++ runtime (shared tensors, queues, pipes) for the Python package.";
  torchpar::python::bind_errors(m);
  torchpar::python::bind_channels(m);
  torchpar::python::bind_sync(m);

  m.def(
      "share_memory_",
      [](at::Tensor tensor) {
        py::gil_scoped_release nogil;  // the copy into shared memory runs without the GIL
        torchpar::share_memory_(tensor);
      },
      py::arg("tensor"),
      "Moves `tensor`'s storage (CPU, any dtype and shape) into torchpar shared memory in "
      "place, as Tensor.share_memory_: every view of it sees the shared copy. A no-op when "
      "it is already there. Releases the GIL while it copies. Errors: ValueError for a "
      "tensor that cannot be shared (not on the CPU, sparse); OSError when shared memory "
      "runs out.");
  m.def(
      "empty_shared",
      [](const std::vector<int64_t>& sizes, const at::Tensor& like) {
        py::gil_scoped_release nogil;
        return torchpar::empty_shared(sizes, like.options());
      },
      py::arg("sizes"), py::arg("like"),
      "An uninitialised tensor of `sizes` in torchpar shared memory, with the dtype of "
      "`like` (an empty tensor).");
  m.def("is_shared", &torchpar::is_shared, py::arg("tensor"),
        "True when `tensor`'s storage is in torchpar shared memory.");
  m.def("get_sharing_strategy", &torchpar::get_sharing_strategy,
        "This process's sharing strategy: 'file_descriptor' (default) or 'file_system'.");
  m.def("set_sharing_strategy", &torchpar::set_sharing_strategy, py::arg("strategy"),
        "Sets this process's sharing strategy (torch.multiprocessing.set_sharing_strategy); "
        "ValueError names the valid ones.");
  m.def("get_all_sharing_strategies", &torchpar::get_all_sharing_strategies);
  m.attr("__version__") = torchpar::version();
}
