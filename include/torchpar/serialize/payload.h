#pragma once
/// Payload: what `dumps` produces and `loads` reads, plus moving it over a Unix socket.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "torchpar/core/fd.h"
#include "torchpar/core/timeout.h"

namespace torchpar {

/// Serialized bytes plus the out-of-band file descriptors (shared-memory segments of the
/// file_descriptor strategy) they refer to by index. Move-only: it owns the fds.
struct Payload {
  std::string bytes;
  std::vector<UniqueFd> fds;
};

/// Writes `payload` to the connected Unix stream socket `sock`: a 16-byte frame header,
/// the fds as SCM_RIGHTS (in groups of at most 250), then the bytes.
/// Errors: SystemError (EPIPE / ECONNRESET when the peer is gone).
/// Safety: one writer per socket at a time.
void send_payload(int sock, const Payload& payload);

/// Reads one payload written by send_payload. The whole frame must arrive within `timeout`
/// (seconds, fractions allowed; nullopt: wait forever; negative counts as 0). Memory grows
/// with the bytes actually received, never with what a header claims.
/// Errors: TimeoutError; ClosedError when the peer closed before a whole frame;
///         SerializationError for a malformed frame; ProtocolError when the header announces
///         more than `max_bytes` bytes (the bytes are not read: the socket is out of sync);
///         SystemError for socket errors.
/// Safety: one reader per socket at a time.
Payload recv_payload(int sock, Timeout timeout = std::nullopt, size_t max_bytes = SIZE_MAX);

}  // namespace torchpar
