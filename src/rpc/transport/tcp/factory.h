#pragma once
// The TCP implementation of the RPC transport (transport.h): our own code on POSIX stream
// sockets, so that nothing a peer sends is parsed before the peer proved the job's key. Wire
// format: docs/wire_format.md, "RPC transport" (TCP); threads: transport_impl.h.

#include <memory>

#include "rpc/transport/transport.h"

namespace torchpar::rpc {

/// A transport over TCP, listening on options.bind_host (an IPv4 or IPv6 address, or a host
/// name resolved to IPv4) with a port the kernel chooses; address() is "tcp://<ip>:<port>"
/// ("tcp://[v6]:<port>" for IPv6), and send() takes such addresses (numeric hosts only).
/// options.shm is ignored (create_transport adds shared memory beside this transport).
///
/// Every accepted connection runs the mutual handshake (multiprocessing.connection's
/// `{sha256}` challenge, frames capped at 256 bytes) on its own thread, within
/// options.handshake_timeout and at most 5 s; garbage, a wrong key or silence closes that
/// connection and logs one line naming the peer's address, and the transport goes on. At most
/// 64 accepted connections wait for their peer to prove the key (a member does within a round
/// trip of its challenge): a newcomer beyond that closes the oldest of them (or, while 128
/// handshake threads still run, is itself closed unheard); a sender whose handshake the
/// member closed so tries again until its deadline (a TimeoutError then, not a ClosedError).
/// So strangers that connect and stall cost members nothing; only a flood of new connections
/// (64 within one member's handshake round trip) can delay members.
/// Message frames are checked against max_header_bytes, max_storages and max_message_bytes
/// before anything is allocated for them.
///
/// send() connects and handshakes on the calling thread (first contact, bounded by
/// `deadline`), then writes what the socket takes at once and queues the rest for the
/// connection's writer thread: it never waits for the peer to read, so a stopped peer does not
/// block its senders. The writer writes queued messages in order; one that has not begun by
/// its `deadline` is dropped (the caller's timeout reports it). A socket that takes no byte
/// for 30 s while messages wait (a stopped or unreachable peer) ends the connection
/// (on_peer_lost); a message cut off part-way can only end with its connection. The
/// storages of a queued message are read until it is written: do not modify them meanwhile.
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
