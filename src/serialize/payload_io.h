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

}  // namespace torchpar::detail
