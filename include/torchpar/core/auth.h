#pragma once
/// Connection authentication with a shared job key: Python multiprocessing.connection's
/// handshake (CPython 3.12's deliver_challenge / answer_challenge), so Python's own
/// multiprocessing.connection.Client and Listener with the same `authkey` interoperate.
///
/// Wire format (multiprocessing.connection framing): every message is a 4-byte big-endian
/// signed length, then that many bytes. The server sends
/// `#CHALLENGE#{sha256}` + 40 random bytes; the client answers `{sha256}` + HMAC-SHA256(key,
/// `{sha256}` + the 40 bytes) (the MAC covers the digest prefix, so it cannot be
/// downgraded); the server replies `#WELCOME#` or `#FAILURE#`. Then the roles swap (mutual).
/// Answers may name another of CPython's digests (md5, sha256, sha384, sha3_256, sha3_384).
/// The legacy form of Python <= 3.11 (a 20-byte challenge without a digest prefix, answered
/// with a bare 16-byte HMAC-MD5, which a man in the middle could downgrade to) is refused by
/// default with AuthenticationError ("legacy HMAC-MD5 ... set allow_legacy_md5"); with
/// AuthOptions::allow_legacy_md5 it is accepted and answered, as CPython 3.12 does. HMACs
/// come from OpenSSL's libcrypto. Handshake frames over 256 bytes and reads past the
/// deadline end the handshake.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace torchpar {

/// Bytes of the shared secret of a job (Python: multiprocessing's authkey, a bytes object).
/// A byte vector that is also built from text, as Python users write `authkey=b"secret"`:
/// `AuthKey k = "secret";` or `AuthKey(std::string(...))` holds the string's bytes (no
/// terminating NUL). Every API taking an AuthKey takes a string the same way.
struct AuthKey : std::vector<uint8_t> {
  using std::vector<uint8_t>::vector;
  AuthKey() = default;
  AuthKey(std::vector<uint8_t> bytes) : std::vector<uint8_t>(std::move(bytes)) {}  // NOLINT
  AuthKey(std::string_view text)                                                   // NOLINT
      : std::vector<uint8_t>(text.begin(), text.end()) {}
  AuthKey(const std::string& text) : AuthKey(std::string_view(text)) {}  // NOLINT
  AuthKey(const char* text) : AuthKey(std::string_view(text)) {}         // NOLINT
};

/// Absolute deadline of a handshake or socket read/write.
using AuthDeadline = std::chrono::steady_clock::time_point;

/// Longest handshake message accepted (CPython: recv_bytes(256)).
inline constexpr size_t kMaxHandshakeFrame = 256;

/// Options of a handshake.
struct AuthOptions {
  /// Accept and answer the legacy HMAC-MD5 form of Python <= 3.11 (Debian 12's python3):
  /// needed to talk to those Pythons' multiprocessing.connection, never between torchpar
  /// processes (they speak {sha256}).
  bool allow_legacy_md5 = false;
};

/// Server side of the mutual handshake on a connected stream socket `fd` (the order of
/// Python's Listener.accept): challenges the peer, then answers the peer's challenge.
///
/// Errors:  AuthenticationError when the peer proves a different key (it was sent
///          `#FAILURE#`), when it refuses our answer, or on a protocol violation (a frame
///          over 256 bytes, not a challenge; a legacy HMAC-MD5 challenge or answer without
///          options.allow_legacy_md5); TimeoutError past `deadline`; ClosedError when
///          the peer closes; SystemError on socket errors. The socket is then unusable:
///          close it.
/// Safety:  blocking, bounded by `deadline`; one handshake per fd at a time; thread-safe
///          otherwise (no shared state). Never raises SIGPIPE (MSG_NOSIGNAL).
/// Source:  CPython Lib/multiprocessing/connection.py, Listener.accept.
void auth_accept(int fd, const AuthKey& key, AuthDeadline deadline, AuthOptions options = {});

/// Client side of the mutual handshake (the order of Python's Client): answers the
/// server's challenge, then challenges the server. Errors and safety as auth_accept.
/// Source:  CPython Lib/multiprocessing/connection.py, Client.
void auth_connect(int fd, const AuthKey& key, AuthDeadline deadline, AuthOptions options = {});

/// One half of the handshake: sends a challenge and checks the answer (sends `#WELCOME#`
/// or `#FAILURE#`). Source: multiprocessing.connection.deliver_challenge.
void deliver_challenge(int fd, const AuthKey& key, AuthDeadline deadline, AuthOptions options = {});

/// The other half: answers a challenge, expects `#WELCOME#`.
/// Source: multiprocessing.connection.answer_challenge.
void answer_challenge(int fd, const AuthKey& key, AuthDeadline deadline, AuthOptions options = {});

/// Sends one multiprocessing.connection frame (detail::frame_header, then the bytes).
/// Errors: TimeoutError past `deadline`, ClosedError if the peer closed, SystemError.
void send_frame(int fd, std::string_view bytes, AuthDeadline deadline);

/// Receives one frame of at most `max_bytes` bytes; a longer length ends the read with
/// AuthenticationError (nothing is allocated for it). Errors as send_frame.
std::string recv_frame(int fd, size_t max_bytes, AuthDeadline deadline);

/// `n` bytes from the system's CSPRNG (getrandom). Errors: SystemError.
AuthKey random_authkey(size_t n = 32);

/// Lower-case hex of `key`, and back. from_hex throws torchpar::Error on odd length or a
/// character that is not a hex digit.
std::string to_hex(const AuthKey& key);
AuthKey from_hex(std::string_view hex);

/// Name of the environment variable that carries the job's key in hex (`torchpar run` sets
/// it for its ranks: 32 fresh random bytes per job).
inline constexpr const char* kAuthKeyEnv = "TORCHPAR_AUTHKEY";

/// The job's key from TORCHPAR_AUTHKEY (hex, either case), or nullopt when the variable is
/// not set at all. Never looks at the per-user key file (RPC uses this: it refuses to start
/// without a job key, see World::create_rpc_group).
///
/// Errors:  ValueError when the variable is set but empty, of odd length, or holds a
///          character that is not a hex digit; the message names the variable and the
///          position, never the value (it is a secret).
/// Safety:  reads the environment (std::getenv): do not call it while another thread
///          changes the environment.
std::optional<AuthKey> authkey_from_env();

/// The key of this job when none is given explicitly:
///   1. TORCHPAR_AUTHKEY (hex), as `torchpar run` sets it for its ranks (a fresh random key
///      per job);
///   2. else the per-user key file `${XDG_CACHE_HOME:-$HOME/.cache}/torchpar/authkey`
///      (32 random bytes, created on first use with mode 0600 in a directory of mode 0700;
///      a file or directory that others can read, or that another user owns, is refused).
///      Every process of this user on this host (and on hosts sharing the home directory)
///      gets the same key; ranks on hosts without a shared home need TORCHPAR_AUTHKEY.
/// An empty TORCHPAR_AUTHKEY counts as unset here (the Manager and the World's store keep
/// that fallback; RPC does not, see authkey_from_env).
/// Errors:  torchpar::Error naming the variable or file and why: ValueError for a
///          TORCHPAR_AUTHKEY that is not hex; Error for an unsafe mode or no HOME.
/// Safety:  thread- and process-safe (the file is created atomically).
AuthKey default_authkey();

/// Path of the per-user key file default_authkey() uses (it may not exist yet).
std::string default_authkey_path();

namespace detail {
/// The multiprocessing.connection header of an `n`-byte frame: the 4-byte big-endian signed
/// length, or when `n` is over 0x7fffffff, the length -1 then the 8-byte big-endian length
/// (CPython's Connection._send_bytes). 4 or 12 bytes.
std::string frame_header(uint64_t n);
/// Writes all `n` bytes to the stream socket `fd` (MSG_NOSIGNAL), waiting with poll until
/// `deadline`. Errors: TimeoutError, ClosedError (peer gone: EPIPE/ECONNRESET), SystemError.
/// `what` names the connection in messages.
void send_all(int fd, const void* data, size_t n, AuthDeadline deadline, std::string_view what);
/// Reads exactly `n` bytes. Errors as send_all; ClosedError on end of stream.
void recv_all(int fd, void* data, size_t n, AuthDeadline deadline, std::string_view what);
}  // namespace detail

}  // namespace torchpar
