#pragma once
// The manager's request/response protocol. Each message is one torchpar payload (dumps with
// tensors copied, no fds) inside one multiprocessing.connection frame of a Listener/Client
// connection; a client sends a Request and waits for its Response (one outstanding request
// per connection). A call connection whose client attached a ShmChannel (kAttachChannel)
// carries the same payload bytes in that shared memory instead (src/manager/shm_channel.h).
// docs/wire_format.md, Manager protocol.

#include <cstddef>
#include <cstdint>
#include <string>

namespace torchpar::detail::manager {

enum class RequestKind : uint8_t {
  kCreate = 1,           ///< type_id, args -> the new object's id (refcount 1)
  kCall = 2,             ///< object_id, method, args -> the method's result
  kIncref = 3,           ///< object_id -> nothing
  kDecref = 4,           ///< object_id -> nothing; the object goes at refcount 0
  kShutdown = 5,         ///< -> nothing; then the server exits
  kNumberOfObjects = 6,  ///< -> uint64_t, the live objects (Python's _number_of_objects)
  /// type_id = the name of a ShmChannel (src/manager/shm_channel.h) the client made ->
  /// nothing. Only as the first request of a call connection, on its socket; the server
  /// answers on the socket, and after an ok both sides move every later request and
  /// response of that connection to the channel. A server that cannot open it (another
  /// host or user, no /dev/shm) answers "OSError" and the connection stays on the socket.
  kAttachChannel = 7,
};

struct Request {
  uint8_t kind = 0;
  std::string type_id;     // kCreate
  uint64_t object_id = 0;  // kCall, kIncref, kDecref
  std::string method;      // kCall
  std::string args;        // kCreate, kCall: payload bytes of the arguments, opaque here
  uint64_t caller = 0;     // kCall: the calling thread (random per process + thread ordinal)

  template <class Archive>
  void serialize(Archive& ar) {
    ar(kind, type_id, object_id, method, args, caller);
  }
};

struct Response {
  bool ok = false;
  std::string value;          // ok: payload bytes of the result ("" for none)
  std::string error_type;     // !ok: the exception's type name ("KeyError", "std::...")
  std::string error_message;  // !ok: its message

  template <class Archive>
  void serialize(Archive& ar) {
    ar(ok, value, error_type, error_message);
  }
};

/// The longest request or response frame either side reads (a longer one ends the
/// connection: ProtocolError).
inline constexpr size_t kMaxMessageBytes = size_t{1} << 30;

}  // namespace torchpar::detail::manager
