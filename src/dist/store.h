#pragma once
// The authenticated rendezvous store of a World: a small key-value server hosted by rank 0
// and a client implementing c10d::Store (so ProcessGroupGloo and PrefixStore work on it).
//
// Why not c10d's TCPStore: in LibTorch 1.13 it listens on every interface, has no
// authentication, serves all clients from one thread (a client that sends one byte and
// stalls delays everyone), allocates whatever length a client announces, and its
// watch-key thread spins on a closed socket when the server dies. This store binds the
// address it is given, runs the job's key handshake (torchpar/core/auth.h) before anything
// else on every connection, serves each connection on its own thread, caps key and value
// lengths before allocating, and reports a lost server as RankLostError naming rank 0.
//
// Wire format (after the handshake), both directions: u32 big-endian length of the rest,
// then the message. Request: u8 command, fields; reply: u8 status (0 ok, 1 timed out,
// 2 refused + message), fields. Strings are u32 length + bytes; integers i64 big-endian.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "torchpar/core/auth.h"
#include "torchpar/core/fd.h"

namespace torchpar::detail {

inline constexpr size_t kStoreMaxKeyBytes = 4096;
inline constexpr size_t kStoreMaxValueBytes = 16 << 20;
inline constexpr size_t kStoreMaxKeys = 4096;  // per check / wait

/// Listens on `bind_addr`:`port` (numeric or a host name; "0.0.0.0" or "::" only when the
/// caller asks for every interface) and serves authenticated clients until destroyed.
/// Errors (constructor): torchpar::Error naming the address when it cannot listen there.
/// Safety: the destructor closes every connection and joins every thread.
class StoreServer {
 public:
  StoreServer(const std::string& bind_addr, int port, AuthKey key,
              std::chrono::milliseconds handshake_timeout);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  /// The port listened on (the kernel's pick when constructed with port 0).
  int port() const { return port_; }

 private:
  struct Conn {
    UniqueFd fd;
    std::thread thread;
    std::atomic<bool> done{false};
  };
  void accept_loop();
  void serve(Conn* c);
  /// Handles one request; false ends the connection (protocol violation). `ephemeral`
  /// collects the keys this connection set with set_ephemeral (erased when it ends).
  bool handle(int fd, const std::string& req, std::vector<std::string>* ephemeral);
  /// Under mu_: every key of `ks` exists.
  bool all_present(const std::vector<std::string>& ks) const;
  /// Waits under `lk` (on mu_) until every key exists; false on timeout or shutdown.
  bool wait_keys(std::unique_lock<std::mutex>& lk, const std::vector<std::string>& ks,
                 int64_t timeout_ms);
  /// Adds `delta` to the integer at `k` (missing: 0); the new value.
  int64_t add_to(const std::string& k, int64_t delta);
  /// c10d's compareSet on `k`; the reply's body (the value now, or `expected` for a
  /// missing key left missing).
  std::string compare_set(const std::string& k, std::string_view expected,
                          std::string_view desired);
  void reap(bool all);

  AuthKey key_;
  std::chrono::milliseconds handshake_timeout_;
  int port_ = 0;
  UniqueFd listen_fd_;
  UniqueFd wake_fd_;
  std::thread acceptor_;
  std::atomic<bool> stop_{false};
  std::atomic<int> handshaking_{0};

  std::mutex conns_mu_;
  std::list<std::unique_ptr<Conn>> conns_;

  std::mutex mu_;  // guards data_
  std::condition_variable cv_;
  std::map<std::string, std::vector<uint8_t>> data_;
};

/// One connection to a StoreServer, as a c10d::Store. Every call is bounded: operations by
/// the store's timeout, wait() by its argument, and both by a StoreDeadline of the calling
/// thread. Errors: TimeoutError; RankLostError(0, ...) once the server is gone (then every
/// later call fails fast); torchpar::Error for keys or values over the caps;
/// AuthenticationError (constructor) when the server has another key.
/// A call that a StoreDeadline ends before its reply came leaves the connection usable: the
/// late reply is read and dropped by the next call (a stopped rank 0 that resumes serves on).
/// Safety: thread-safe (calls are serialised on the one connection).
class StoreClient final : public c10d::Store {
 public:
  /// Connects (retrying while nothing listens yet) and authenticates, within `timeout`.
  /// `host_role` names the server's host in messages ("hosted by rank 0").
  StoreClient(const std::string& addr, int port, const AuthKey& key,
              std::chrono::milliseconds timeout, const std::string& host_role = "hosted by rank 0");
  ~StoreClient() override;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  /// Waits (up to the store's timeout) for the key, as c10d's stores do.
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  /// set(), and the server erases the key when this connection ends (the client's process
  /// died, or closed it): ZooKeeper's ephemeral nodes; an elastic agent's liveness. At most
  /// kStoreMaxKeys per connection (more ends the connection).
  void set_ephemeral(const std::string& key, const std::vector<uint8_t>& value);
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  /// set and set_ephemeral: command `cmd` with a key and a value (caps checked).
  void put(uint8_t cmd, const std::string& key, const std::vector<uint8_t>& value,
           const char* what);
  /// Sends one request, returns the reply's fields (status checked).
  std::string call(const std::string& req, std::chrono::milliseconds wait_ms, const char* what);

  std::string where_;  // "the store at host:port (hosted by rank 0)"
  std::mutex mu_;
  UniqueFd fd_;
  std::string broken_;  // why the connection is unusable, once it is
  int unread_ = 0;      // replies of calls a StoreDeadline ended: the next call drops them
};

/// Bounds every StoreClient call the constructing thread starts while this object lives:
/// each gives up at `deadline` at the latest (TimeoutError; the connection stays usable).
/// Nested ones take the earliest deadline. For error paths that must not wait on rank 0's
/// store past their own limit (a SIGSTOPped rank 0 answers nothing and closes nothing).
/// Other c10d stores (TCPStore in python_compatible mode, FileStore) ignore it.
/// Safety: thread-local; construct and destroy on one thread, in LIFO order.
class StoreDeadline {
 public:
  explicit StoreDeadline(std::chrono::steady_clock::time_point deadline);
  ~StoreDeadline();
  StoreDeadline(const StoreDeadline&) = delete;
  StoreDeadline& operator=(const StoreDeadline&) = delete;

 private:
  std::chrono::steady_clock::time_point previous_;
};

/// The store barrier: waits until the counter `key` (store.add(key, 0)) reaches `count`.
/// Polls every 2 ms (c10d stores have no wait-for-value); `keep_waiting`, when given, is
/// asked every poll and ends the wait early by returning false.
/// Returns: true when the count was reached; false at `deadline` or when keep_waiting said
/// stop. Errors: the store's (RankLostError when rank 0 is gone).
bool store_wait_count(c10d::Store& store, const std::string& key, int64_t count,
                      std::chrono::steady_clock::time_point deadline,
                      const std::function<bool()>& keep_waiting = nullptr);

/// One round of a store barrier: this rank arrives (adds 1 to the counter `key`), then
/// waits with store_wait_count until `count` ranks arrived. Every barrier of the dist layer
/// (a group's shm attach, the python_compatible default group, the World's leave) is one.
/// Returns and errors as store_wait_count.
bool store_barrier(c10d::Store& store, const std::string& key, int64_t count,
                   std::chrono::steady_clock::time_point deadline,
                   const std::function<bool()>& keep_waiting = nullptr);

/// Waits until every key of `keys` is set, all within one `deadline` (the store's own
/// blocking wait, key by key, each for what is left of the time).
/// Returns: -1 when every key is set; else the index of the first key still missing at
/// the deadline. Errors: RankLostError when the store's host is gone.
int store_wait_keys(c10d::Store& store, const std::vector<std::string>& keys,
                    std::chrono::steady_clock::time_point deadline);

/// store_wait_keys without the store's blocking wait: asks check() every 2 ms, so a wait never
/// holds a client that serves one request at a time (StoreClient) and other threads of the
/// process keep using it meanwhile (the RPC layer's address lookups and group joins).
/// Returns and errors as store_wait_keys.
int store_poll_keys(c10d::Store& store, const std::vector<std::string>& keys,
                    std::chrono::steady_clock::time_point deadline);

/// Store values are bytes: these spell a string as one and back.
inline std::vector<uint8_t> store_bytes(const std::string& s) { return {s.begin(), s.end()}; }
inline std::string store_string(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

}  // namespace torchpar::detail
