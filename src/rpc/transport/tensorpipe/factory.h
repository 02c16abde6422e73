#pragma once
// The TensorPipe transport's factories: uv + shm (tests and benchmarks), and shm alone, for
// create_transport's composite. No TensorPipe type appears here.

#include <memory>

#include "rpc/transport/transport.h"

namespace torchpar::rpc {

/// A TensorPipe transport (uv = TCP, plus shm when options.shm; channels cma and basic)
/// listening on options.bind_host, port chosen by the kernel. Kept for tests and benchmarks;
/// the RPC agent uses create_transport.
/// Errors: ValueError for an empty key or name (or one over 256 bytes); SystemError when it
/// cannot listen.
/// Process: sets SIGPIPE to "ignore" when it is at its default (libuv writes without
/// MSG_NOSIGNAL), as World does. TensorPipe aborts the process on garbage sent to its TCP
/// port before any handshake can run: keep bind_host on loopback or a trusted network
/// (docs/wire_format.md, "RPC transport").
std::unique_ptr<Transport> create_tensorpipe_transport(TransportOptions options,
                                                       TransportHandlers handlers);

namespace detail {

/// A TensorPipe transport that registers only TensorPipe's shm transport (channels cma and
/// basic; no uv, so no TCP listener): the same-host half of create_transport. It listens on an
/// autobound abstract Unix socket; address() is "shm://<name>" and send() accepts only such
/// addresses (ValueError otherwise). options.bind_host and options.shm are ignored. Otherwise
/// as create_tensorpipe_transport (handshake, limits, threads, errors).
///
/// Errors:  ValueError for an empty key or name (or one over 256 bytes); SystemError when
///          TensorPipe's shm transport is not viable here (no boot id or network namespace id,
///          no shared memory) or cannot listen.
/// Security: anyone who can connect to the abstract socket (a local user in the same network
///          namespace; abstract sockets have no permissions) can end the process with eight
///          bytes of garbage (docs/wire_format.md, "RPC transport").
std::unique_ptr<Transport> create_tensorpipe_shm_transport(TransportOptions options,
                                                           TransportHandlers handlers);

}  // namespace detail
}  // namespace torchpar::rpc
