#pragma once
// Test support: raw TCP sockets to a torchpar address, to send what no Client would
// (no handshake, no framing).

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <cstdint>
#include <string>

#include "torchpar/core/fd.h"

namespace torchpar::testing {

/// A raw TCP connection to a "127.0.0.1:port" address (no handshake, no framing).
inline UniqueFd raw_connect(const std::string& address) {
  const auto colon = address.rfind(':');
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  EXPECT_EQ(::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a), 0) << address;
  return fd;
}

/// Sends all of `bytes` on `fd` in one send (a failure otherwise).
inline void send_raw(int fd, const std::string& bytes) {
  ASSERT_EQ(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(bytes.size()));
}

}  // namespace torchpar::testing
