#pragma once
// The TCP implementation of the RPC transport (transport.h): our own code on POSIX stream
// sockets, so that nothing a peer sends is parsed before the peer proved the job's key. Wire
// format: docs/wire_format.md, "RPC transport" (TCP); threads: tcp_transport.cpp.

#include <memory>

#include "dist/rpc/transport/transport.h"

namespace torchpar::rpc {

/// A transport over TCP, listening on options.bind_host (an IPv4 or IPv6 address, or a host
/// name resolved to IPv4) with a port the kernel chooses; address() is "tcp://<ip>:<port>"
/// ("tcp://[v6]:<port>" for IPv6), and send() takes such addresses (numeric hosts only).
/// options.shm is ignored (create_transport adds shared memory beside this transport).
///
/// Every accepted connection runs the mutual handshake (multiprocessing.connection's
/// `{sha256}` challenge, frames capped at 256 bytes) within options.handshake_timeout on its
/// own thread, at most 64 at a time (more are closed unheard); garbage, a wrong key or silence
/// closes that connection and logs one line naming the peer's address, and the transport goes
/// on. Message frames are checked against max_header_bytes, max_storages and
/// max_message_bytes before anything is allocated for them.
///
/// send() connects, handshakes and writes on the calling thread: it returns once the kernel
/// took the whole message. A write that passes `deadline` part-way closes the connection
/// (on_peer_lost) and throws TimeoutError; one that has not begun throws TimeoutError and keeps
/// the connection.
///
/// Errors:  ValueError for an empty key or name (or one over 256 bytes) or a bind_host that is
///          no host; SystemError when it cannot listen; std::system_error when no thread can
///          be made.
/// Safety:  as Transport: any thread may send; handlers as TransportHandlers says (with
///          inline_handlers, on_message runs on the reader thread of the peer's connection:
///          different peers' messages may be handled concurrently).
std::unique_ptr<Transport> create_tcp_transport(TransportOptions options,
                                                TransportHandlers handlers);

}  // namespace torchpar::rpc
