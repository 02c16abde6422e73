#pragma once
// Test support for tests/dist/rpc_transport*_test.cpp: the transports under test by kind, what
// their handlers received (with waits that time out), patterned storages, and raw TCP peers
// that do what no transport would (garbage, bad frames) with deadlines.

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "rpc/transport/tcp/factory.h"
#include "rpc/transport/tensorpipe/factory.h"
#include "rpc/transport/transport.h"
#include "support/ranks.h"
#include "support/raw_socket.h"
#include "torchpar/core/auth.h"
#include "torchpar/process/process.h"

namespace torchpar::testing {

namespace rpc = torchpar::rpc;
using Seconds = std::chrono::duration<double>;

inline const AuthKey kRpcKey = {'r', 'p', 'c', '-', 'k', 'e', 'y', '-', '0', '1'};
inline const AuthKey kOtherKey = {'o', 't', 'h', 'e', 'r', '-', 'k', 'e', 'y'};

inline std::chrono::steady_clock::time_point in(Seconds d) {
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(d);
}

/// The transports under test.
enum class TransportKind : int {
  kTensorPipe = 0,  ///< create_tensorpipe_transport (uv + shm when options.shm)
  kTcp = 1,         ///< create_tcp_transport
  kComposite = 2,   ///< create_transport (TCP + TensorPipe shm when options.shm)
};

inline std::unique_ptr<rpc::Transport> make_transport(TransportKind kind,
                                                      rpc::TransportOptions options,
                                                      rpc::TransportHandlers handlers) {
  switch (kind) {
    case TransportKind::kTensorPipe:
      return rpc::create_tensorpipe_transport(std::move(options), std::move(handlers));
    case TransportKind::kTcp:
      return rpc::create_tcp_transport(std::move(options), std::move(handlers));
    case TransportKind::kComposite:
      break;
  }
  return rpc::create_transport(std::move(options), std::move(handlers));
}

/// An address that routes like `address` (same kind, same host identity, shm or not) but
/// reaches no listener: a send to it succeeds only over a connection that is open already.
inline std::string unreachable_like(const std::string& address) {
  const auto parsed = rpc::parse_transport_address(address);
  if (parsed.shm.empty()) return "tcp://127.0.0.1:1";
  return "tcp://127.0.0.1:1;shm=shm://torchpar-nowhere;host=" + parsed.host;
}

inline rpc::TransportOptions transport_options(const std::string& name, bool shm = true,
                                               const AuthKey& key = kRpcKey) {
  return rpc::TransportOptions{.name = name, .authkey = key, .shm = shm};
}

/// What a transport's handlers received, with waits that time out.
class Inbox {
 public:
  rpc::TransportHandlers handlers() {
    return {.on_message =
                [this](const std::string& peer, rpc::Message msg) {
                  std::lock_guard<std::mutex> lock(mu_);
                  if (sealed_) late_ = true;
                  messages_.emplace_back(peer, std::move(msg));
                  cv_.notify_all();
                },
            .on_peer_lost =
                [this](const std::string& peer, const std::string& why) {
                  std::lock_guard<std::mutex> lock(mu_);
                  if (sealed_) late_ = true;
                  lost_.emplace_back(peer, why);
                  cv_.notify_all();
                }};
  }

  /// The next message, or nullopt after `timeout`.
  std::optional<std::pair<std::string, rpc::Message>> next(Seconds timeout = Seconds(30)) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return !messages_.empty(); })) return std::nullopt;
    auto m = std::move(messages_.front());
    messages_.pop_front();
    return m;
  }

  /// Waits until `n` losses were reported; returns them (fewer after `timeout`).
  std::vector<std::pair<std::string, std::string>> lost(size_t n, Seconds timeout = Seconds(30)) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, timeout, [&] { return lost_.size() >= n; });
    return lost_;
  }

  size_t message_count() {
    std::lock_guard<std::mutex> lock(mu_);
    return messages_.size();
  }

  /// From now on any handler call is a failure (after close() returned).
  void seal() {
    std::lock_guard<std::mutex> lock(mu_);
    sealed_ = true;
  }
  bool late() {
    std::lock_guard<std::mutex> lock(mu_);
    return late_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::string, rpc::Message>> messages_;
  std::vector<std::pair<std::string, std::string>> lost_;
  bool sealed_ = false;
  bool late_ = false;
};

/// `n` bytes, byte i = (i * 31 + seed) mod 256.
inline c10::Storage patterned(size_t n, uint8_t seed) {
  c10::Storage s(c10::Storage::use_byte_size_t(), n, c10::GetCPUAllocator(), false);
  auto* p = static_cast<uint8_t*>(s.data());
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(i * 31 + seed);
  return s;
}

/// Whether `s` holds patterned(n, seed); the first differing byte otherwise.
inline ::testing::AssertionResult is_patterned(const c10::Storage& s, size_t n, uint8_t seed) {
  if (s.nbytes() != n) {
    return ::testing::AssertionFailure() << "length " << s.nbytes() << ", expected " << n;
  }
  if (n > 0 && s.device().type() != c10::DeviceType::CPU) {
    return ::testing::AssertionFailure() << "not a CPU storage";
  }
  const auto* p = static_cast<const uint8_t*>(s.data());
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != static_cast<uint8_t>(i * 31 + seed)) {
      return ::testing::AssertionFailure() << "byte " << i << " differs";
    }
  }
  return ::testing::AssertionSuccess();
}

inline rpc::Message message(std::string header, std::string body,
                            std::vector<c10::Storage> s = {}) {
  return rpc::Message{
      .header = std::move(header), .body = std::move(body), .storages = std::move(s)};
}

inline ProcessOptions child_options() {
  ProcessOptions po;
  po.start_method = ranks_start_method();
  return po;
}

// ---- raw TCP peers ------------------------------------------------------------------------------

/// Sends what it can of `bytes` (the member may hang up before all of it is sent; that is
/// fine). Never raises SIGPIPE; gives up after 10 s.
inline void send_garbage(int fd, const std::string& bytes) {
  const auto until = in(Seconds(10));
  size_t off = 0;
  while (off < bytes.size() && std::chrono::steady_clock::now() < until) {
    const ssize_t w =
        ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      off += static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, 100);
      continue;
    }
    return;  // reset or closed by the member
  }
}

/// Whether the peer of `fd` ends the connection within `timeout`; what it sends meanwhile
/// (a challenge, a name) is read and dropped.
inline bool closed_within(int fd, Seconds timeout) {
  const auto until = in(timeout);
  char buf[4096];
  for (;;) {
    const auto left =
        std::chrono::ceil<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    const ssize_t r = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (r == 0) return true;
    if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return true;
  }
}

/// The fixed part of a TCP transport frame (docs/wire_format.md, "RPC transport"):
/// magic, header bytes (u32), body bytes (u64), storages (u32), reserved (u32), little-endian.
inline std::string frame_head(uint64_t header_bytes, uint64_t body_bytes, uint64_t storages,
                              const std::string& magic = "RPC1", uint32_t reserved = 0) {
  std::string out = magic;
  auto put = [&out](uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  put(header_bytes, 4);
  put(body_bytes, 8);
  put(storages, 4);
  put(reserved, 4);
  return out;
}

/// A raw TCP connection to the TCP part of `address` that proved `key` and exchanged names
/// (it calls itself `name`): the next bytes it sends are read as frames. Throws what the
/// handshake throws.
inline UniqueFd handshaken_socket(const std::string& address, const AuthKey& key,
                                  const std::string& name) {
  auto fd = raw_connect(rpc::parse_transport_address(address).tcp);
  const auto deadline = in(Seconds(10));
  auth_connect(fd.get(), key, deadline);
  send_frame(fd.get(), name, deadline);
  (void)recv_frame(fd.get(), kMaxHandshakeFrame, deadline);  // the member's name
  return fd;
}

}  // namespace torchpar::testing
