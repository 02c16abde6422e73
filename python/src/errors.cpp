// torchpar's C++ errors as Python exceptions: the type a Python user already catches for
// each (Python's own where one exists: queue.Empty, queue.Full, TimeoutError, ValueError,
// OSError (also for a frame over recv_bytes' maxlength), multiprocessing.AuthenticationError,
// threading.BrokenBarrierError), torchpar's own classes otherwise, each a subclass of the
// Python type it stands for.
#include <Python.h>

#include <string>

#include "bindings.h"
#include "torchpar/core/error.h"

namespace py = pybind11;

namespace torchpar::python {
namespace {

struct Types {
  PyObject* error = nullptr;           // torchpar.Error(RuntimeError)
  PyObject* closed = nullptr;          // torchpar.ClosedError(Error, EOFError, ValueError)
  PyObject* timeout = nullptr;         // torchpar.TimeoutError(Error, TimeoutError)
  PyObject* serialization = nullptr;   // torchpar.SerializationError(Error, pickle.UnpicklingError)
  PyObject* peer_lost = nullptr;       // torchpar.PeerLostError(Error)
  PyObject* worker_lost = nullptr;     // torchpar.WorkerLostError(PeerLostError)
  PyObject* remote_raised = nullptr;   // torchpar.RemoteRaisedError(Error)
  PyObject* queue_empty = nullptr;     // queue.Empty
  PyObject* queue_full = nullptr;      // queue.Full
  PyObject* authentication = nullptr;  // multiprocessing.AuthenticationError
  PyObject* broken_barrier = nullptr;  // threading.BrokenBarrierError
};

Types& types() {
  static Types t;
  return t;
}

PyObject* new_type(py::module_& m, const char* name, const char* doc, py::tuple bases) {
  const std::string qualified = std::string("torchpar.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), nullptr);
  if (type == nullptr) throw py::error_already_set();
  m.add_object(name, py::handle(type));  // the module keeps a reference for ever
  return type;
}

void set(PyObject* type, const char* what) { PyErr_SetString(type, what); }

void translate(std::exception_ptr p) {
  const Types& t = types();
  try {
    std::rethrow_exception(p);
  } catch (const Empty& e) {
    set(t.queue_empty, e.what());
  } catch (const Full& e) {
    set(t.queue_full, e.what());
  } catch (const TimeoutError& e) {
    set(t.timeout, e.what());
  } catch (const ClosedError& e) {
    set(t.closed, e.what());
  } catch (const ValueError& e) {
    set(PyExc_ValueError, e.what());
  } catch (const AuthenticationError& e) {
    set(t.authentication, e.what());
  } catch (const BrokenBarrierError& e) {
    set(t.broken_barrier, e.what());
  } catch (const SerializationError& e) {
    set(t.serialization, e.what());
  } catch (const SystemError& e) {
    set(PyExc_OSError, e.what());
  } catch (const ProtocolError& e) {
    set(PyExc_OSError, e.what());  // Python: OSError "bad message length"
  } catch (const WorkerLostError& e) {
    set(t.worker_lost, e.what());
  } catch (const PeerLostError& e) {
    set(t.peer_lost, e.what());
  } catch (const RemoteRaisedError& e) {
    set(t.remote_raised, e.what());
  } catch (const Error& e) {
    set(t.error, e.what());
  }
}

}  // namespace

void bind_errors(py::module_& m) {
  Types& t = types();
  const auto attr = [](const char* module, const char* name) {
    py::object o = py::module_::import(module).attr(name);
    return o.release().ptr();
  };
  t.queue_empty = attr("queue", "Empty");
  t.queue_full = attr("queue", "Full");
  t.authentication = attr("multiprocessing", "AuthenticationError");
  t.broken_barrier = attr("threading", "BrokenBarrierError");
  const py::handle runtime(PyExc_RuntimeError);
  t.error =
      new_type(m, "Error", "Base of torchpar's errors (a RuntimeError).", py::make_tuple(runtime));
  const py::handle error(t.error);
  t.closed =
      new_type(m, "ClosedError",
               "The queue, pipe or pool was closed, or the peer of a pipe is gone: an "
               "EOFError (Connection.recv) and a ValueError (a closed queue), as Python "
               "raises one or the other.",
               py::make_tuple(error, py::handle(PyExc_EOFError), py::handle(PyExc_ValueError)));
  t.timeout = new_type(m, "TimeoutError", "A blocking call ran out of time (a TimeoutError).",
                       py::make_tuple(error, py::handle(PyExc_TimeoutError)));
  t.serialization =
      new_type(m, "SerializationError",
               "Bytes that are not what they claim to be, or a shared tensor whose sender is gone.",
               py::make_tuple(error, py::module_::import("pickle").attr("UnpicklingError")));
  t.peer_lost =
      new_type(m, "PeerLostError", "A peer process (pool worker, child, rank) died or went away.",
               py::make_tuple(error));
  t.worker_lost = new_type(m, "WorkerLostError",
                           "A pool worker died while it held this task (its pid and signal "
                           "are in the message); the pool replaced it and goes on.",
                           py::make_tuple(py::handle(t.peer_lost)));
  t.remote_raised = new_type(m, "RemoteRaisedError",
                             "Code running in another process raised; its type name and "
                             "message travel.",
                             py::make_tuple(error));
  py::register_exception_translator(&translate);
}

}  // namespace torchpar::python
