#pragma once
// The multiprocessing.connection handshake over any channel of whole frames. auth.cpp holds
// the one implementation; its socket functions (torchpar/core/auth.h) run it over a stream
// socket with multiprocessing's length-prefixed frames, the RPC transport
// (src/rpc/transport/tensorpipe/) over a TensorPipe pipe with one message a frame.

#include <cstddef>
#include <string>
#include <string_view>

#include "torchpar/core/auth.h"

namespace torchpar::detail {

/// A bidirectional channel of whole frames, the handshake's unit: one send is one frame, one
/// recv returns one frame.
///
/// Errors:  TimeoutError past `deadline`; ClosedError when the peer is gone; AuthenticationError
///          for a frame longer than recv's `max_bytes` (refused before it is read) or one the
///          channel's framing does not allow; SystemError on system-call failures. After any
///          error the channel is unusable: its owner closes it.
/// Safety:  one handshake on a channel at a time; send and recv block (bounded by `deadline`).
struct AuthChannel {
  virtual ~AuthChannel() = default;
  /// Sends the frame `bytes`.
  virtual void send(std::string_view bytes, AuthDeadline deadline) = 0;
  /// Receives one frame of at most `max_bytes` bytes.
  virtual std::string recv(size_t max_bytes, AuthDeadline deadline) = 0;
};

/// One half of the handshake over `channel`: sends a challenge, checks the answer, sends
/// `#WELCOME#` or `#FAILURE#`. Errors as torchpar::deliver_challenge, plus the channel's.
/// Source: multiprocessing.connection.deliver_challenge.
void deliver_challenge(AuthChannel& channel, const AuthKey& key, AuthDeadline deadline,
                       AuthOptions options = {});

/// The other half: answers a challenge, expects `#WELCOME#`.
/// Source: multiprocessing.connection.answer_challenge.
void answer_challenge(AuthChannel& channel, const AuthKey& key, AuthDeadline deadline,
                      AuthOptions options = {});

/// Server side (the order of Python's Listener.accept): deliver_challenge, answer_challenge.
void auth_accept(AuthChannel& channel, const AuthKey& key, AuthDeadline deadline,
                 AuthOptions options = {});

/// Client side (the order of Python's Client): answer_challenge, deliver_challenge.
void auth_connect(AuthChannel& channel, const AuthKey& key, AuthDeadline deadline,
                  AuthOptions options = {});

}  // namespace torchpar::detail
