#pragma once
// The TensorPipe transport's second factory: shm alone, for create_transport's composite
// (transport.h declares create_tensorpipe_transport, uv + shm). No TensorPipe type appears here.

#include <memory>

#include "dist/rpc/transport/transport.h"

namespace torchpar::rpc::detail {

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

}  // namespace torchpar::rpc::detail
