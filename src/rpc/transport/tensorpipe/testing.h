#pragma once
// Test support for tests/dist/rpc_transport_test.cpp: a bare TensorPipe peer that does what no
// transport would (stall its handshake, break the message layout). Compiled into that test,
// not into the library; no TensorPipe type appears in this header.

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "torchpar/core/auth.h"

namespace torchpar::rpc::testing {

/// The shape of one raw TensorPipe message (docs/wire_format.md, "RPC transport").
struct RawMessage {
  size_t payloads = 2;       ///< an RPC message has 2 (header, body)
  size_t payload_bytes = 1;  ///< length of each payload
  size_t tensors = 0;
  size_t tensor_bytes = 0;  ///< length of each tensor
  bool tagged = true;       ///< the RPC message tag as descriptor metadata
};

/// A TensorPipe context of its own (uv transport, basic channel) that opens pipes to a
/// transport's address.
/// Safety: one thread at a time. Lifetime: the destructor closes its pipes and its context.
class RawPeer {
 public:
  RawPeer();
  ~RawPeer();
  RawPeer(const RawPeer&) = delete;
  RawPeer& operator=(const RawPeer&) = delete;

  /// Opens a pipe to `address` ("tcp://ip:port") and sends nothing: TensorPipe's own setup
  /// completes, so the transport accepts the pipe and waits for the handshake's answer.
  void connect_silent(const std::string& address);

  /// Opens a pipe, runs the client handshake with `key`, sends the name frame `name`, then one
  /// message of `shape`, and waits until TensorPipe wrote it or the transport closed the pipe
  /// (which it may do on reading the descriptor, before the payloads).
  /// Errors: the handshake's (AuthenticationError, TimeoutError, ClosedError); TimeoutError
  /// past `timeout`.
  void send_raw(const std::string& address, const AuthKey& key, const std::string& name,
                const RawMessage& shape, std::chrono::duration<double> timeout);

  /// Waits until the transport ends the pipe of the last send_raw: true if it did in `timeout`.
  bool closed_by_peer(std::chrono::duration<double> timeout);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace torchpar::rpc::testing
