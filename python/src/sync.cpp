// torchpar._C's process-shared synchronization pieces (torchpar/multiprocessing/
// synchronize.py and sharedctypes.py build Python's multiprocessing.synchronize and
// sharedctypes surface on them): Semaphore (also Python's Lock: a bounded one of 1), Mutex
// (RLock: a robust recursive mutex), Event, ConditionWord (the wait/notify word of a
// Condition whose lock is any of these), Barrier, and SharedBuffer (zero-filled shared
// memory with the buffer protocol, for ctypes objects).
//
// Each object lives in a small sealed memfd (torchpar's SharedPage). `_dump()` gives what
// pickling sends, the serialized bytes and the live fds of its pages (the Python side
// passes them as multiprocessing passes fds: inherited, or duplicated for the child);
// `_load(bytes, fds)` rebuilds the object from duplicates of those fds.
//
// Blocking calls release the GIL and wait in 100 ms slices between which Python's signal
// handlers run (bindings.h), except Barrier.wait: a timed-out barrier wait breaks the
// barrier, so it waits in one piece (Ctrl-C is seen when it returns).
#include <fcntl.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "core/deadline.h"
#include "ipc/condition_word.h"
#include "torchpar/ipc/detail/shared_page.h"
#include "torchpar/ipc/synchronize.h"
#include "torchpar/serialize/serialize.h"

namespace py = pybind11;

namespace torchpar::python {
namespace {

/// A duplicate (close-on-exec) of `fd`, which the caller keeps.
UniqueFd dup_fd(int fd, const char* what) {
  const int own = ::fcntl(fd, F_DUPFD_CLOEXEC, 3);
  if (own < 0) throw SystemError("fcntl(F_DUPFD_CLOEXEC)", errno, "fd " + std::to_string(fd), what);
  return UniqueFd(own);
}

/// Calls `attempt(slice)` with the GIL released until it returns true (-> true) or
/// `timeout` passed (-> false), running signal handlers between slices.
template <class Attempt>
bool wait_sliced(std::optional<double> timeout, Attempt&& attempt) {
  const auto deadline = deadline_of(timeout);
  for (;;) {
    bool ok = false;
    {
      py::gil_scoped_release nogil;
      ok = attempt(slice_until(deadline));
    }
    if (ok) return true;
    if (deadline && Clock::now() >= *deadline) return false;
    check_signals();
  }
}

/// A C++ synchronization object plus what pickling it sends (made on first use and kept,
/// so the fds stay open until the object goes: multiprocessing passes them to a spawned
/// child at its start, after pickling).
template <class T>
struct Shared {
  T obj;
  std::optional<Payload> pickled;

  explicit Shared(T o = T()) : obj(std::move(o)) {}
  Shared(const Shared&) = delete;  // pybind11 must not try (the payload owns fds)
  Shared(Shared&&) = default;

  py::tuple dump() {
    if (!pickled) pickled = torchpar::dumps(obj);
    py::list fds;
    for (const auto& fd : pickled->fds) fds.append(fd.get());
    return py::make_tuple(py::bytes(pickled->bytes), fds);
  }
  static T load(const py::bytes& bytes, const std::vector<int>& fds) {
    Payload p{std::string(bytes), {}};
    for (int fd : fds) p.fds.push_back(dup_fd(fd, "a torchpar synchronization object"));
    return torchpar::loads<T>(p);
  }
};

using PySemaphore = Shared<Semaphore>;
using PyMutex = Shared<Lock>;
using PyEvent = Shared<Event>;

struct PyBarrier : Shared<Barrier> {
  py::object action = py::none();
  /// Runs the Python action (with the GIL) when this process's wait trips the barrier;
  /// an exception it raises breaks the barrier and propagates from that wait.
  void set_action(py::object a) {
    action = std::move(a);
    if (action.is_none()) {
      obj.set_action({});
      return;
    }
    PyObject* callable = action.ptr();  // kept alive by `action`
    obj.set_action([callable] {
      py::gil_scoped_acquire gil;
      py::handle{callable}();
    });
  }
};

/// A ConditionWord waited on with the GIL released, in slices; a wait that ends without a
/// notify (timeout, or an exception from a signal handler) leaves its slot.
struct PyConditionWord {
  detail::ConditionWord word;

  bool wait(uint32_t slot, std::optional<double> timeout) {
    const auto deadline = deadline_of(timeout);
    for (;;) {
      bool notified = false;
      {
        py::gil_scoped_release nogil;
        notified = word.wait_ticket(slot, detail::Deadline::after(slice_until(deadline)));
      }
      if (notified) return true;
      if (deadline && Clock::now() >= *deadline) return word.leave(slot);
      try {
        check_signals();
      } catch (...) {
        word.leave(slot);
        throw;
      }
    }
  }
};

struct PySharedBuffer {
  std::shared_ptr<detail::SharedPage> page;
  size_t size;
};

}  // namespace

void bind_sync(py::module_& m) {
  py::class_<PySemaphore>(m, "Semaphore",
                          "A process-shared counter (multiprocessing.Semaphore's core; with "
                          "bounded=True a BoundedSemaphore, and of 1 Python's Lock).")
      .def(py::init([](uint32_t value, bool bounded) {
             return PySemaphore(bounded ? BoundedSemaphore(value) : Semaphore(value));
           }),
           py::arg("value"), py::arg("bounded") = false)
      .def(
          "acquire",
          [](PySemaphore& s, const py::object& timeout) {
            return wait_sliced(optional_timeout(timeout),
                               [&](auto slice) { return s.obj.acquire(slice); });
          },
          py::arg("timeout") = py::none(),
          "Takes one unit, waiting up to `timeout` seconds (None: no limit; 0: a try); "
          "False when it passed.")
      .def(
          "release",
          [](PySemaphore& s) {
            try {
              s.obj.release();
            } catch (const Error& e) {
              throw py::value_error("semaphore or lock released too many times");
            }
          },
          "Returns one unit. ValueError past a bounded semaphore's initial value.")
      .def("get_value", [](const PySemaphore& s) { return s.obj.get_value(); })
      .def("_dump", &PySemaphore::dump)
      .def_static("_load", [](const py::bytes& b, const std::vector<int>& fds) {
        return PySemaphore(PySemaphore::load(b, fds));
      });

  py::class_<PyMutex>(m, "Mutex",
                      "A process-shared robust recursive mutex (multiprocessing.RLock's core): "
                      "the holder releases it; when a holder dies, the next acquire gets it "
                      "and owner_died is true.")
      .def(py::init([] { return PyMutex(RLock()); }))
      .def(
          "acquire",
          [](PyMutex& l, const py::object& timeout) {
            return wait_sliced(optional_timeout(timeout),
                               [&](auto slice) { return l.obj.acquire(slice); });
          },
          py::arg("timeout") = py::none(),
          "Takes the mutex (again, for its holder), waiting up to `timeout` seconds (None: "
          "no limit; 0: a try); False when it passed.")
      .def(
          "release", [](PyMutex& l) { l.obj.release(); },
          "Releases one level. torchpar.Error (a RuntimeError) when the caller does not "
          "hold it.")
      .def_property_readonly(
          "owner_died", [](const PyMutex& l) { return l.obj.owner_died(); },
          "True when the last acquire recovered the mutex from a holder that died.")
      .def("_dump", &PyMutex::dump)
      .def_static("_load", [](const py::bytes& b, const std::vector<int>& fds) {
        return PyMutex(PyMutex::load(b, fds));
      });

  py::class_<PyEvent>(m, "Event", "A process-shared flag (multiprocessing.Event's core).")
      .def(py::init([] { return PyEvent(Event()); }))
      .def("set", [](PyEvent& e) { e.obj.set(); })
      .def("clear", [](PyEvent& e) { e.obj.clear(); })
      .def("is_set", [](const PyEvent& e) { return e.obj.is_set(); })
      .def(
          "wait",
          [](PyEvent& e, const py::object& timeout) {
            return wait_sliced(optional_timeout(timeout),
                               [&](auto slice) { return e.obj.wait(slice); });
          },
          py::arg("timeout") = py::none(),
          "True once the flag is set, waiting up to `timeout` seconds (None: no limit).")
      .def("_dump", &PyEvent::dump)
      .def_static("_load", [](const py::bytes& b, const std::vector<int>& fds) {
        return PyEvent(PyEvent::load(b, fds));
      });

  py::class_<PyConditionWord>(
      m, "ConditionWord",
      "The waiters of a process-shared Condition: slot = enroll() with the lock held, "
      "release the lock, wait(slot, timeout), re-acquire. notify(n) wakes exactly "
      "min(n, waiting) waiters, oldest first, only those enrolled before it; a notify with "
      "no waiter is not remembered.")
      .def(py::init([] { return std::make_unique<PyConditionWord>(); }))
      .def(
          "enroll", [](PyConditionWord& w) { return w.word.enroll(); },
          "Enrolls the caller (holding the lock) as a waiter; returns its slot. "
          "torchpar.Error past 1000 waiters at once.")
      .def(
          "wait",
          [](PyConditionWord& w, uint32_t slot, const py::object& timeout) {
            return w.wait(slot, optional_timeout(timeout));
          },
          py::arg("slot"), py::arg("timeout") = py::none(),
          "After enroll(): True when notified, False when `timeout` seconds (None: no "
          "limit) passed first. The slot is free again either way.")
      .def(
          "notify",
          [](PyConditionWord& w, int64_t n) {
            if (n > 0)
              w.word.notify(static_cast<uint32_t>(
                  std::min<int64_t>(n, std::numeric_limits<uint32_t>::max())));
          },
          py::arg("n") = 1)
      .def_property_readonly("waiting", [](const PyConditionWord& w) { return w.word.waiting(); })
      .def_property_readonly("tickets", [](const PyConditionWord& w) { return w.word.tickets(); })
      .def("_dump",
           [](PyConditionWord& w) {
             return py::make_tuple(py::bytes(), py::make_tuple(w.word.page()->fd()));
           })
      .def_static("_load", [](const py::bytes&, const std::vector<int>& fds) {
        if (fds.size() != 1) throw py::value_error("a ConditionWord travels with one fd");
        auto page = detail::SharedPage::open(dup_fd(fds[0], "a torchpar Condition"), 4096);
        return std::unique_ptr<PyConditionWord>(
            new PyConditionWord{detail::ConditionWord(std::move(page))});
      });

  py::class_<PyBarrier>(m, "Barrier",
                        "A process-shared barrier (multiprocessing.Barrier's core). wait() "
                        "raises threading.BrokenBarrierError when the barrier is or gets "
                        "broken (abort, reset, a timeout: a timeout breaks it for all).")
      .def(py::init([](uint32_t parties, py::object action, const py::object& timeout) {
             const auto t = optional_timeout(timeout);
             auto b = std::make_unique<PyBarrier>();
             b->obj = Barrier(parties, {},
                              t ? Timeout(std::chrono::duration<double>(*t)) : std::nullopt);
             b->set_action(std::move(action));
             return b;
           }),
           py::arg("parties"), py::arg("action") = py::none(), py::arg("timeout") = py::none())
      .def(
          "wait",
          [](PyBarrier& b, const py::object& timeout) {
            const auto t = optional_timeout(timeout);
            if (t && std::isnan(*t)) throw py::value_error("timeout is NaN");
            py::gil_scoped_release nogil;
            return b.obj.wait(t ? Timeout(std::chrono::duration<double>(std::max(0.0, *t)))
                                : std::nullopt);
          },
          py::arg("timeout") = py::none(),
          "This party's index in [0, parties) once all arrived, waiting up to `timeout` "
          "seconds (None: the barrier's default).")
      .def("reset",
           [](PyBarrier& b) {
             py::gil_scoped_release nogil;
             b.obj.reset();
           })
      .def("abort",
           [](PyBarrier& b) {
             py::gil_scoped_release nogil;
             b.obj.abort();
           })
      .def("set_action", &PyBarrier::set_action, py::arg("action"))
      .def_property_readonly("parties", [](const PyBarrier& b) { return b.obj.parties(); })
      .def_property_readonly("n_waiting", [](const PyBarrier& b) { return b.obj.n_waiting(); })
      .def_property_readonly("broken", [](const PyBarrier& b) { return b.obj.broken(); })
      .def("_dump", &PyBarrier::dump)
      .def_static("_load", [](const py::bytes& bytes, const std::vector<int>& fds) {
        auto b = std::make_unique<PyBarrier>();
        b->obj = PyBarrier::load(bytes, fds);
        return b;
      });

  py::class_<PySharedBuffer>(m, "SharedBuffer", py::buffer_protocol(),
                             "`nbytes` zero-filled bytes of shared memory (a sealed memfd) "
                             "with the buffer protocol: what sharedctypes' objects live in.")
      .def(py::init([](size_t nbytes) {
             return PySharedBuffer{
                 detail::SharedPage::create(std::max<size_t>(nbytes, 1), "torchpar-sharedctypes"),
                 nbytes};
           }),
           py::arg("nbytes"))
      .def_buffer([](PySharedBuffer& b) {
        return py::buffer_info(b.page->data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size)}, {1});
      })
      .def_readonly("nbytes", &PySharedBuffer::size)
      .def("fileno", [](const PySharedBuffer& b) { return b.page->fd(); })
      .def_static(
          "from_fd",
          [](int fd, size_t nbytes) {
            return PySharedBuffer{
                detail::SharedPage::open(dup_fd(fd, "a torchpar shared buffer"), nbytes), nbytes};
          },
          py::arg("fd"), py::arg("nbytes"),
          "The buffer behind the memfd `fd` (duplicated; the caller keeps `fd`); OSError "
          "when it is not a sealed torchpar memfd of at least `nbytes`.");
}

}  // namespace torchpar::python
