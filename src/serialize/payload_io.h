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
/// rest of the bytes in records of up to 80 KiB (shorter while the socket refuses them:
/// EMSGSIZE, ENOBUFS). `started` (may be null) is set once the first record went out: an
/// error after that leaves the peer inside a frame, and the socket should be closed.
/// Errors and safety as send_payload.
void send_payload_records(int sock, const Payload& payload, bool* started = nullptr);

/// recv_payload_spinning for frames sent with send_payload_records. Later records of a frame
/// are spun for too (up to `spin` each). A first record that is no frame's start (shorter
/// than a header, a bad magic, more bytes than its header says) is a SerializationError:
/// the record is dropped whole and the socket stays in step. A fault after the first record
/// (a record that does not fit where the frame says it goes, an fd record without fds, fds
/// lost to RLIMIT_NOFILE) is a ProtocolError: the rest of the frame may still be queued.
/// ECONNRESET (the peer closed with data of ours unread) is read past; an empty record
/// (a raw write of nothing on the socket) is skipped.
Payload recv_payload_records(int sock, Timeout timeout, size_t max_bytes,
                             std::chrono::microseconds spin);

}  // namespace torchpar::detail
