#include "torchpar/core/auth.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/auth_channel.h"
#include "torchpar/core/env.h"
#include "torchpar/core/error.h"
#include "torchpar/core/fd.h"
#include "torchpar/core/syscall.h"

namespace torchpar {
namespace {

constexpr std::string_view kChallenge = "#CHALLENGE#";
constexpr std::string_view kWelcome = "#WELCOME#";
constexpr std::string_view kFailure = "#FAILURE#";
constexpr size_t kMessageLength = 40;    // CPython 3.12 MESSAGE_LENGTH
constexpr size_t kMd5OnlyLength = 20;    // a legacy (Python <= 3.11) challenge
constexpr size_t kMd5DigestLength = 16;  // a legacy answer
constexpr std::array<std::string_view, 5> kAllowedDigests = {"md5", "sha256", "sha384", "sha3_256",
                                                             "sha3_384"};
constexpr size_t kMaxDigestName = 8;  // the longest allowed name

/// Waits until `fd` is ready for `events` or the deadline passes (TimeoutError).
void wait_ready(int fd, short events, AuthDeadline deadline, std::string_view what) {
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      throw TimeoutError(fmt::format("{}: the peer did not {} in time", what,
                                     events == POLLIN ? "send" : "receive"));
    }
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count() + 1, 1 << 30)));
    if (r > 0) return;
    if (r < 0 && errno != EINTR) detail::throw_system_error("poll", errno, what);
  }
}

/// Which digest a challenge or answer uses, and its payload (CPython's
/// _get_digest_name_and_payload). An empty name means legacy HMAC-MD5 without prefix.
std::pair<std::string, std::string_view> digest_and_payload(std::string_view msg) {
  if (msg.size() == kMd5OnlyLength || msg.size() == kMd5DigestLength) return {"", msg};
  if (!msg.empty() && msg[0] == '{') {
    const auto curly = msg.substr(0, kMaxDigestName + 2).find('}', 1);
    if (curly != std::string_view::npos) {
      const auto name = msg.substr(1, curly - 1);
      if (std::find(kAllowedDigests.begin(), kAllowedDigests.end(), name) !=
          kAllowedDigests.end()) {
        return {std::string(name), msg.substr(curly + 1)};
      }
    }
  }
  throw AuthenticationError(fmt::format(
      "authentication: unsupported message length ({} bytes), missing digest prefix, or "
      "unsupported digest",
      msg.size()));
}

/// HMAC(key, msg) with the named digest (OpenSSL spells sha3_256 "sha3-256").
std::string hmac(const AuthKey& key, std::string_view msg, std::string name) {
  std::replace(name.begin(), name.end(), '_', '-');
  const EVP_MD* md = EVP_get_digestbyname(name.c_str());
  if (!md) throw AuthenticationError(fmt::format("authentication: digest {} unsupported", name));
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  static const unsigned char kEmpty = 0;
  if (!HMAC(md, key.empty() ? &kEmpty : key.data(), static_cast<int>(key.size()),
            reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), out, &len)) {
    throw AuthenticationError(fmt::format("authentication: HMAC-{} failed in libcrypto", name));
  }
  return std::string(reinterpret_cast<char*>(out), len);
}

/// CPython's _create_response: legacy challenges get a bare HMAC-MD5.
std::string create_response(const AuthKey& key, std::string_view message) {
  const auto [name, payload] = digest_and_payload(message);
  (void)payload;
  if (name.empty()) return hmac(key, message, "md5");
  return "{" + name + "}" + hmac(key, message, name);
}

/// CPython's _verify_challenge (constant-time comparison).
void verify_response(const AuthKey& key, std::string_view message, std::string_view response,
                     const AuthOptions& options) {
  auto [name, mac] = digest_and_payload(response);
  if (name.empty()) {
    if (!options.allow_legacy_md5) {
      throw AuthenticationError(
          "authentication: legacy bare HMAC-MD5 answer from a Python <= 3.11 peer: set "
          "allow_legacy_md5 to accept it");
    }
    name = "md5";
  }
  const std::string expected = hmac(key, message, name);
  if (expected.size() != mac.size()) {
    throw AuthenticationError(fmt::format("authentication: expected {} of length {}, got {}", name,
                                          expected.size(), mac.size()));
  }
  if (CRYPTO_memcmp(expected.data(), mac.data(), mac.size()) != 0) {
    throw AuthenticationError(
        "authentication: digest received was wrong (the peer has another key)");
  }
}

}  // namespace

namespace detail {

std::string frame_header(uint64_t n) {
  std::string out;
  auto put_be = [&out](uint64_t v, int bytes) {
    for (int i = bytes - 1; i >= 0; --i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  if (n > 0x7fffffff) {
    put_be(0xffffffffu, 4);  // -1: a 64-bit length follows
    put_be(n, 8);
  } else {
    put_be(n, 4);
  }
  return out;
}

void send_all(int fd, const void* data, size_t n, AuthDeadline deadline, std::string_view what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      p += w;
      n -= static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      wait_ready(fd, POLLOUT, deadline, what);
      continue;
    }
    if (errno == EPIPE || errno == ECONNRESET) {
      throw ClosedError(
          fmt::format("{}: the peer closed the connection ({})", what, std::strerror(errno)));
    }
    throw_system_error("send", errno, what);
  }
}

void recv_all(int fd, void* data, size_t n, AuthDeadline deadline, std::string_view what) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
      continue;
    }
    if (r == 0) throw ClosedError(fmt::format("{}: the peer closed the connection", what));
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      wait_ready(fd, POLLIN, deadline, what);
      continue;
    }
    if (errno == ECONNRESET) {
      throw ClosedError(fmt::format("{}: the peer reset the connection", what));
    }
    throw_system_error("recv", errno, what);
  }
}

}  // namespace detail

void send_frame(int fd, std::string_view bytes, AuthDeadline deadline) {
  std::string buf = detail::frame_header(bytes.size());
  buf.append(bytes);
  detail::send_all(fd, buf.data(), buf.size(), deadline, "authentication");
}

std::string recv_frame(int fd, size_t max_bytes, AuthDeadline deadline) {
  unsigned char hdr[4];
  detail::recv_all(fd, hdr, 4, deadline, "authentication");
  const int32_t n = static_cast<int32_t>((uint32_t{hdr[0]} << 24) | (uint32_t{hdr[1]} << 16) |
                                         (uint32_t{hdr[2]} << 8) | uint32_t{hdr[3]});
  // Negative lengths (-1 announces a 64-bit length in CPython) and long ones are refused
  // before anything is allocated.
  if (n < 0 || static_cast<size_t>(n) > max_bytes) {
    throw AuthenticationError(fmt::format(
        "authentication: bad message length {} (at most {} bytes accepted)", n, max_bytes));
  }
  std::string out(static_cast<size_t>(n), '\0');
  detail::recv_all(fd, out.data(), out.size(), deadline, "authentication");
  return out;
}

namespace {

/// multiprocessing.connection's framing on a stream socket: the handshake of auth.h.
class FdChannel final : public detail::AuthChannel {
 public:
  explicit FdChannel(int fd) : fd_(fd) {}
  void send(std::string_view bytes, AuthDeadline deadline) override {
    send_frame(fd_, bytes, deadline);
  }
  std::string recv(size_t max_bytes, AuthDeadline deadline) override {
    return recv_frame(fd_, max_bytes, deadline);
  }

 private:
  int fd_;
};

}  // namespace

namespace detail {

void deliver_challenge(AuthChannel& channel, const AuthKey& key, AuthDeadline deadline,
                       AuthOptions options) {
  const AuthKey random = random_authkey(kMessageLength);
  std::string message = "{sha256}";
  message.append(reinterpret_cast<const char*>(random.data()), random.size());
  channel.send(std::string(kChallenge) + message, deadline);
  const std::string response = channel.recv(kMaxHandshakeFrame, deadline);
  try {
    verify_response(key, message, response, options);
  } catch (const AuthenticationError&) {
    try {
      channel.send(kFailure, deadline);
    } catch (const Error&) {  // the peer may be gone already: the refusal stands
    }
    throw;
  }
  channel.send(kWelcome, deadline);
}

void answer_challenge(AuthChannel& channel, const AuthKey& key, AuthDeadline deadline,
                      AuthOptions options) {
  const std::string msg = channel.recv(kMaxHandshakeFrame, deadline);
  if (msg.compare(0, kChallenge.size(), kChallenge) != 0) {
    throw AuthenticationError("authentication: protocol error, expected a challenge");
  }
  const std::string_view message = std::string_view(msg).substr(kChallenge.size());
  if (message.size() < kMd5OnlyLength) {
    throw AuthenticationError(
        fmt::format("authentication: challenge too short: {} bytes", message.size()));
  }
  if (digest_and_payload(message).first.empty() && !options.allow_legacy_md5) {
    throw AuthenticationError(
        "authentication: legacy HMAC-MD5 challenge from a Python <= 3.11 peer: set "
        "allow_legacy_md5 to answer it");
  }
  channel.send(create_response(key, message), deadline);
  const std::string reply = channel.recv(kMaxHandshakeFrame, deadline);
  if (reply != kWelcome) {
    throw AuthenticationError(
        "authentication: the peer rejected our key (digest sent was rejected)");
  }
}

void auth_accept(AuthChannel& channel, const AuthKey& key, AuthDeadline deadline,
                 AuthOptions options) {
  deliver_challenge(channel, key, deadline, options);
  answer_challenge(channel, key, deadline, options);
}

void auth_connect(AuthChannel& channel, const AuthKey& key, AuthDeadline deadline,
                  AuthOptions options) {
  answer_challenge(channel, key, deadline, options);
  deliver_challenge(channel, key, deadline, options);
}

}  // namespace detail

void deliver_challenge(int fd, const AuthKey& key, AuthDeadline deadline, AuthOptions options) {
  FdChannel channel(fd);
  detail::deliver_challenge(channel, key, deadline, options);
}

void answer_challenge(int fd, const AuthKey& key, AuthDeadline deadline, AuthOptions options) {
  FdChannel channel(fd);
  detail::answer_challenge(channel, key, deadline, options);
}

void auth_accept(int fd, const AuthKey& key, AuthDeadline deadline, AuthOptions options) {
  FdChannel channel(fd);
  detail::auth_accept(channel, key, deadline, options);
}

void auth_connect(int fd, const AuthKey& key, AuthDeadline deadline, AuthOptions options) {
  FdChannel channel(fd);
  detail::auth_connect(channel, key, deadline, options);
}

AuthKey random_authkey(size_t n) {
  AuthKey out(n);
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::getrandom(out.data() + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      detail::throw_system_error("getrandom", errno, "random_authkey");
    }
    got += static_cast<size_t>(r);
  }
  return out;
}

std::string to_hex(const AuthKey& key) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s;
  s.reserve(key.size() * 2);
  for (uint8_t b : key) {
    s.push_back(kDigits[b >> 4]);
    s.push_back(kDigits[b & 15]);
  }
  return s;
}

AuthKey from_hex(std::string_view hex) {
  auto digit = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    throw Error(fmt::format("from_hex: '{}' is not a hex digit", c));
  };
  if (hex.size() % 2 != 0) throw Error("from_hex: odd number of hex digits");
  AuthKey out(hex.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<uint8_t>(digit(hex[2 * i]) * 16 + digit(hex[2 * i + 1]));
  }
  return out;
}

std::string default_authkey_path() {
  std::string base;
  if (const auto x = env_value("XDG_CACHE_HOME"); x && x->starts_with('/')) {
    base = *x;
  } else if (const auto h = env_value("HOME"); h && !h->empty()) {
    base = *h + "/.cache";
  } else {
    throw Error(
        "default_authkey: neither TORCHPAR_AUTHKEY nor HOME is set: set TORCHPAR_AUTHKEY to the "
        "job's key in hex (the same on every rank)");
  }
  return base + "/torchpar/authkey";
}

namespace {

/// Refuses a key file or directory another user owns or others may read.
void check_private(const std::string& path, const struct stat& st, bool dir) {
  if (st.st_uid != ::geteuid() || (st.st_mode & 077) != 0 ||
      (dir ? !S_ISDIR(st.st_mode) : !S_ISREG(st.st_mode))) {
    throw Error(fmt::format(
        "default_authkey: {} {} is not private (owner uid {}, mode {:o}; need this user's {} "
        "with mode {}): fix it or set TORCHPAR_AUTHKEY",
        dir ? "directory" : "key file", path, st.st_uid, st.st_mode & 07777,
        dir ? "directory" : "regular file", dir ? "0700" : "0600"));
  }
}

AuthKey read_key_file(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!fd) detail::throw_system_error("open", errno, path);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) detail::throw_system_error("fstat", errno, path);
  check_private(path, st, false);
  AuthKey key(64);
  ssize_t n;
  do {
    n = ::read(fd.get(), key.data(), key.size());
  } while (n < 0 && errno == EINTR);
  if (n < 0) detail::throw_system_error("read", errno, path);
  if (n < 16) {
    throw Error(
        fmt::format("default_authkey: key file {} holds {} bytes; expected at least 16 "
                    "(delete it to make a new one)",
                    path, n));
  }
  key.resize(static_cast<size_t>(n));
  return key;
}

void make_private_dir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    detail::throw_system_error("mkdir", errno, dir);
  }
}

}  // namespace

std::optional<AuthKey> authkey_from_env() {
  const std::optional<std::string> value = env_value(kAuthKeyEnv);
  if (!value) return std::nullopt;
  const std::string_view hex(*value);
  // The messages name positions, never characters: the value is the job's secret.
  if (hex.empty()) {
    throw ValueError(
        fmt::format("{} is set but empty: it must be the job's key in hex "
                    "(e.g. 64 hex digits for 32 bytes)",
                    kAuthKeyEnv));
  }
  const auto bad = std::find_if_not(hex.begin(), hex.end(), [](char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
  });
  if (bad != hex.end()) {
    throw ValueError(
        fmt::format("{} must be the job's key in hex: character {} of {} is not "
                    "a hex digit",
                    kAuthKeyEnv, bad - hex.begin() + 1, hex.size()));
  }
  if (hex.size() % 2 != 0) {
    throw ValueError(fmt::format("{} must be the job's key in hex: {} digits, an odd number",
                                 kAuthKeyEnv, hex.size()));
  }
  return from_hex(hex);
}

AuthKey default_authkey() {
  if (const auto hex = env_value(kAuthKeyEnv); hex && !hex->empty()) return *authkey_from_env();
  const std::string path = default_authkey_path();
  const std::string dir = path.substr(0, path.rfind('/'));
  make_private_dir(dir.substr(0, dir.rfind('/')));  // ~/.cache may be missing
  make_private_dir(dir);
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) detail::throw_system_error("lstat", errno, dir);
  check_private(dir, st, true);
  if (::lstat(path.c_str(), &st) == 0) return read_key_file(path);
  // Write the key to a private temporary name, then link it into place: a reader never sees
  // a partial file, and of two processes racing, the first link wins and both use its key.
  const AuthKey key = random_authkey(32);
  const std::string tmp = fmt::format("{}.{}.tmp", path, ::getpid());
  {
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!fd) detail::throw_system_error("open", errno, tmp);
    if (::write(fd.get(), key.data(), key.size()) != static_cast<ssize_t>(key.size()) ||
        ::fsync(fd.get()) != 0) {
      const int err = errno;
      ::unlink(tmp.c_str());
      detail::throw_system_error("write", err, tmp);
    }
  }
  const int rc = ::link(tmp.c_str(), path.c_str());
  const int err = errno;
  ::unlink(tmp.c_str());
  if (rc != 0 && err != EEXIST) detail::throw_system_error("link", err, path);
  return read_key_file(path);
}

}  // namespace torchpar
