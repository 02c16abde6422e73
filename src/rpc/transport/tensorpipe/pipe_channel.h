#pragma once
// Blocking helpers over a TensorPipe pipe for the handshake phase of a connection (before its
// message loop starts): the auth frames and the connecting member's name frame, each one
// TensorPipe message. Private to src/rpc/transport/tensorpipe/ (TensorPipe headers stay
// in this folder).

#include <tensorpipe/tensorpipe.h>

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "core/auth_channel.h"

namespace torchpar::rpc::detail {

/// Descriptor metadata of an RPC message (docs/wire_format.md, "RPC transport"). Handshake
/// frames carry empty metadata.
inline constexpr std::string_view kMessageTag = "torchpar.rpc/1";

/// The handshake's frames over a TensorPipe pipe: one frame is one TensorPipe message with
/// empty metadata, exactly one payload (the frame's bytes) and no tensors.
///
/// TensorPipe completes reads and writes on its own threads; send and recv wait for that
/// (until the deadline) on the calling thread, which must not be one that runs TensorPipe
/// callbacks.
/// Errors:  TimeoutError past the deadline (the pipe is closed first, which fails whatever is
///          pending on it); ClosedError when TensorPipe reports an error (EOF, reset,
///          refused, the context closed); AuthenticationError for a frame of another shape
///          or longer than `max_bytes` (refused unread; the pipe is closed).
/// Safety:  one call at a time per channel; the pipe is used by nobody else meanwhile.
class PipeAuthChannel final : public torchpar::detail::AuthChannel {
 public:
  /// `what` names the connection in error messages ("rpc transport: connection to w1 ...").
  PipeAuthChannel(std::shared_ptr<tensorpipe::Pipe> pipe, std::string what);

  void send(std::string_view bytes, AuthDeadline deadline) override;
  std::string recv(size_t max_bytes, AuthDeadline deadline) override;

 private:
  std::shared_ptr<tensorpipe::Pipe> pipe_;
  std::string what_;
};

/// Waits until the peer ends `pipe`, sends something, or `deadline` passes. After a refusal
/// this lets the `#FAILURE#` frame reach the peer before this side closes: TensorPipe may drop
/// what is still in flight on a pipe that closes (its shm transport reports the closed
/// socket before the ring buffer's last bytes). Safety: not on a TensorPipe callback thread.
void wait_until_peer_closes(const std::shared_ptr<tensorpipe::Pipe>& pipe, AuthDeadline deadline);

/// The text of a TensorPipe error without its "(this error originated at file:line)" tail.
std::string error_text(const tensorpipe::Error& error);

}  // namespace torchpar::rpc::detail
