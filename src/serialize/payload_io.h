#pragma once
// recv_payload with a busy-wait first, for channels whose replies usually come within
// microseconds (Connection: a ping-pong's answer).
#include <chrono>
#include <cstddef>

#include "torchpar/core/timeout.h"
#include "torchpar/serialize/payload.h"

namespace torchpar::detail {

/// recv_payload (torchpar/serialize/payload.h), but for up to `spin` it retries a
/// non-blocking read of the frame's start instead of sleeping: a wake-up from poll or a
/// blocking recvmsg costs tens of microseconds on small VMs, the retried read about one,
/// and the read that finds the frame is the one that takes it (no separate readiness
/// check). The spin never outlasts `timeout`. Errors and safety as recv_payload.
Payload recv_payload_spinning(int sock, Timeout timeout, size_t max_bytes,
                              std::chrono::microseconds spin);

/// send_payload over a SOCK_SEQPACKET Unix socket (Pipe): the frame goes as records, the
/// first holding the header, the fds (up to 250) and up to 16 KiB of the bytes, so that the
/// receiver takes a small frame whole in one read; more fds follow in 1-byte records, the
/// rest of the bytes in records of up to 128 KiB (smaller when the socket's send buffer
/// refuses that: EMSGSIZE). Errors and safety as send_payload.
void send_payload_records(int sock, const Payload& payload);

/// recv_payload_spinning for frames sent with send_payload_records. A record that does not
/// fit where the frame says it goes (longer than the frame's rest, or a first record
/// shorter than a header) is a SerializationError; the record is gone, the socket usable.
Payload recv_payload_records(int sock, Timeout timeout, size_t max_bytes,
                             std::chrono::microseconds spin);

}  // namespace torchpar::detail
