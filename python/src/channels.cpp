// torchpar._C.Queue and torchpar._C.Connection: torchpar's shared-memory ring and its Pipe
// ends carrying what the Python side makes of an object (torchpar/multiprocessing/
// reductions.py): the pickle's bytes and the tensors it refers to. The tensors travel as
// torchpar shared-memory handles (no fd per tensor, no resource-sharer thread); the bytes
// are copied.
//
// Every blocking call releases the GIL, and waits in slices of at most 100 ms between which
// it takes the GIL back to run Python's signal handlers (Ctrl-C interrupts a get, as it does
// Python's) and to see a close() made by another thread of this process.
#include <ATen/ATen.h>
#include <Python.h>
#include <fcntl.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings.h"
#include "torchpar/core/error.h"
#include "torchpar/ipc/connection.h"
#include "torchpar/ipc/queue.h"

namespace py = pybind11;
using namespace std::chrono_literals;

namespace torchpar::python {
namespace {

/// What travels: an object's pickle and the tensors its persistent ids index.
struct Message {
  std::string pickle;
  std::vector<at::Tensor> tensors;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(pickle, tensors);
  }
};

py::tuple to_python(Message&& m) {
  return py::make_tuple(py::bytes(m.pickle), py::cast(std::move(m.tensors)));
}

/// A Queue of Messages with the fd of its ring at hand (to pass it to a child) and a close()
/// of this process's own (Python's Queue.close: other processes keep using the queue).
class PyQueue : public Queue<Message> {
 public:
  PyQueue(uint64_t maxsize, uint64_t capacity_bytes)
      : Queue<Message>(maxsize,
                       QueueOptions{.copy_tensor = false, .capacity_bytes = capacity_bytes}) {}
  /// The queue whose ring is the memfd `fd` (a duplicate this object then owns).
  explicit PyQueue(int fd) : Queue<Message>(0) {
    const int own = ::fcntl(fd, F_DUPFD_CLOEXEC, 3);
    if (own < 0)
      throw SystemError("fcntl(F_DUPFD_CLOEXEC)", errno, "fd " + std::to_string(fd),
                        "Queue.from_fd");
    q_ = std::make_shared<detail::ShmQueue>(UniqueFd(own));
  }

  void put_message(const py::bytes& pickle, std::vector<at::Tensor> tensors,
                   std::optional<double> timeout) {
    check_open();
    Message m{std::string(pickle), std::move(tensors)};
    const auto deadline = deadline_of(timeout);
    for (;;) {
      {
        py::gil_scoped_release nogil;
        try {
          put(m, slice_until(deadline));
          return;
        } catch (const Full&) {
          if (deadline && Clock::now() >= *deadline) throw;
        }
      }
      check_signals();
      check_open();
    }
  }

  py::tuple get_message(std::optional<double> timeout) {
    check_open();
    const auto deadline = deadline_of(timeout);
    for (;;) {
      std::optional<Message> m;
      {
        py::gil_scoped_release nogil;
        try {
          m = get(slice_until(deadline));
        } catch (const Empty&) {
          if (deadline && Clock::now() >= *deadline) throw;
        }
      }
      if (m) return to_python(std::move(*m));
      check_signals();
      check_open();
    }
  }

  int fileno() const { return q_->fd(); }
  uint64_t maxsize() const { return q_->maxsize(); }
  void close_here() { closed_here_.store(true); }
  bool closed_here() const { return closed_here_.load(); }

 private:
  void check_open() const {
    if (closed_here_.load()) throw ClosedError("Queue is closed");
  }
  std::atomic<bool> closed_here_{false};
};

/// One end of a Pipe.
class PyConnection {
 public:
  explicit PyConnection(Connection c) : c_(std::move(c)) {}
  /// The end whose socket is `fd` (a duplicate this object then owns).
  PyConnection(int fd, bool readable, bool writable) {
    const int own = ::fcntl(fd, F_DUPFD_CLOEXEC, 3);
    if (own < 0)
      throw SystemError("fcntl(F_DUPFD_CLOEXEC)", errno, "fd " + std::to_string(fd), "Connection");
    c_ = Connection(UniqueFd(own), readable, writable);
  }

  void send_message(const py::bytes& pickle, std::vector<at::Tensor> tensors) {
    Message m{std::string(pickle), std::move(tensors)};
    py::gil_scoped_release nogil;
    c_.send(m);
  }
  py::tuple recv_message() {
    wait_readable(std::nullopt);
    Message m;
    {
      py::gil_scoped_release nogil;
      m = c_.recv<Message>();
    }
    return to_python(std::move(m));
  }
  void send_bytes(const py::buffer& data) {
    const py::buffer_info info = data.request();
    const std::string_view bytes(static_cast<const char*>(info.ptr),
                                 static_cast<size_t>(info.size * info.itemsize));
    py::gil_scoped_release nogil;
    c_.send_bytes(bytes);
  }
  py::bytes recv_bytes(std::optional<size_t> maxlength) {
    wait_readable(std::nullopt);
    std::string bytes;
    {
      py::gil_scoped_release nogil;
      bytes = c_.recv_bytes(std::nullopt, maxlength);
    }
    return py::bytes(bytes);
  }
  /// True when a message (or EOF) is ready within `timeout` seconds (None: no limit).
  bool poll(std::optional<double> timeout) { return wait_readable(deadline_of(timeout)); }
  void close() { c_.close(); }
  bool closed() const { return c_.closed(); }
  bool readable() const { return c_.readable(); }
  bool writable() const { return c_.writable(); }
  int fileno() const { return c_.fileno(); }

 private:
  bool wait_readable(const std::optional<Clock::time_point>& deadline) {
    for (;;) {
      {
        py::gil_scoped_release nogil;
        if (c_.poll(slice_until(deadline))) return true;
      }
      if (deadline && Clock::now() >= *deadline) return false;
      check_signals();
    }
  }
  Connection c_;
};

}  // namespace

void bind_channels(py::module_& m) {
  py::class_<PyQueue>(m, "Queue",
                      "torchpar's shared-memory ring carrying (pickle bytes, [tensors]) "
                      "messages; torchpar.multiprocessing.Queue is built on it.")
      .def(py::init<uint64_t, uint64_t>(), py::arg("maxsize") = 0,
           py::arg("capacity_bytes") = uint64_t{4} << 20)
      .def_static(
          "from_fd", [](int fd) { return std::make_unique<PyQueue>(fd); }, py::arg("fd"),
          "The queue whose ring is the memfd `fd` (duplicated; the caller keeps `fd`).")
      .def(
          "put",
          [](PyQueue& q, const py::bytes& pickle, std::vector<at::Tensor> tensors,
             const py::object& timeout) {
            q.put_message(pickle, std::move(tensors), optional_timeout(timeout));
          },
          py::arg("pickle"), py::arg("tensors"), py::arg("timeout") = py::none(),
          "Puts a message, waiting up to `timeout` seconds (None: no limit) for room; "
          "queue.Full when it passes. The tensors move to shared memory (in place).")
      .def(
          "get",
          [](PyQueue& q, const py::object& timeout) {
            return q.get_message(optional_timeout(timeout));
          },
          py::arg("timeout") = py::none(),
          "The oldest message as (bytes, [tensors]), waiting up to `timeout` seconds (None: "
          "no limit); queue.Empty when it passes.")
      .def("qsize", &PyQueue::qsize)
      .def("close_shared", &PyQueue::close,
           "Closes the queue for every process (a waiting get raises ClosedError).")
      .def("close", &PyQueue::close_here, "Closes this process's use of the queue.")
      .def_property_readonly("closed", &PyQueue::closed_here)
      .def_property_readonly("maxsize", &PyQueue::maxsize)
      .def("fileno", &PyQueue::fileno);

  py::class_<PyConnection>(m, "Connection",
                           "One end of a Pipe: messages of (pickle bytes, [tensors]) with the "
                           "tensors shared, and raw byte messages.")
      .def(py::init<int, bool, bool>(), py::arg("fd"), py::arg("readable"), py::arg("writable"),
           "The end whose socket is `fd` (duplicated).")
      .def("send", &PyConnection::send_message, py::arg("pickle"), py::arg("tensors"))
      .def("recv", &PyConnection::recv_message)
      .def("send_bytes", &PyConnection::send_bytes, py::arg("data"))
      .def(
          "recv_bytes",
          [](PyConnection& c, const py::object& maxlength) {
            return c.recv_bytes(maxlength.is_none()
                                    ? std::nullopt
                                    : std::optional<size_t>(maxlength.cast<size_t>()));
          },
          py::arg("maxlength") = py::none())
      .def(
          "poll",
          [](PyConnection& c, const py::object& timeout) {
            return c.poll(optional_timeout(timeout));
          },
          py::arg("timeout") = 0.0)
      .def("close", &PyConnection::close)
      .def_property_readonly("closed", &PyConnection::closed)
      .def_property_readonly("readable", &PyConnection::readable)
      .def_property_readonly("writable", &PyConnection::writable)
      .def("fileno", &PyConnection::fileno);

  m.def(
      "Pipe",
      [](bool duplex) {
        auto [a, b] = torchpar::Pipe(duplex);
        return std::make_pair(std::make_unique<PyConnection>(std::move(a)),
                              std::make_unique<PyConnection>(std::move(b)));
      },
      py::arg("duplex") = true,
      "A connected pair of Connections (duplex: both send and receive; otherwise the first "
      "only receives, the second only sends).");
}

}  // namespace torchpar::python
