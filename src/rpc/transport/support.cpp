#include "rpc/transport/support.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "torchpar/core/auth.h"
#include "torchpar/core/error.h"

namespace torchpar::rpc {

void release_reader_thread() noexcept {
  auto& reader = detail::current_reader();
  if (auto* r = reader) {
    reader = nullptr;
    r->release();
  }
}

}  // namespace torchpar::rpc

namespace torchpar::rpc::detail {

ReaderHandoff*& current_reader() noexcept {
  static thread_local ReaderHandoff* reader = nullptr;
  return reader;
}

void log_line(const std::string& line) noexcept {
  std::fprintf(stderr, "torchpar: %s\n", line.c_str());
  std::fflush(stderr);
}

std::string printable(std::string_view text) {
  std::string out(text.substr(0, 64));
  for (char& c : out) {
    if (c < 0x20 || c > 0x7e) c = '?';
  }
  if (text.size() > 64) out += "...";
  return out;
}

void check_options(const TransportOptions& options) {
  if (options.authkey.empty()) {
    throw ValueError("rpc transport: the authkey is empty (every connection proves the key)");
  }
  if (options.name.empty() || options.name.size() > kMaxHandshakeFrame) {
    throw ValueError(fmt::format("rpc transport: the name must hold 1 to {} bytes, not {}",
                                 kMaxHandshakeFrame, options.name.size()));
  }
}

void check_storages(const Message& msg) {
  for (size_t i = 0; i < msg.storages.size(); ++i) {
    const auto& s = msg.storages[i];
    if (!s) throw ValueError(fmt::format("rpc transport: storage {} is undefined", i));
    if (s.device().type() != c10::DeviceType::CPU) {
      throw ValueError(fmt::format("rpc transport: storage {} is on {}; only CPU storages travel",
                                   i, s.device().str()));
    }
  }
}

torchpar::detail::SocketAddress bind_address(const TransportOptions& options) {
  std::string host = options.bind_host;
  if (host.find(':') != std::string::npos && host.front() != '[') host = "[" + host + "]";
  const auto parsed = torchpar::detail::parse_socket_address(host + ":0");
  if (parsed.kind != torchpar::detail::SocketAddress::Kind::kTcp) {
    throw ValueError(fmt::format("rpc transport: bind_host \"{}\" is not a host or IP address",
                                 printable(options.bind_host)));
  }
  return parsed;
}

torchpar::detail::SocketAddress parse_tcp_address(std::string_view address) {
  constexpr std::string_view kScheme = "tcp://";
  const std::string_view rest =
      address.substr(0, kScheme.size()) == kScheme ? address.substr(kScheme.size()) : "";
  if (rest.empty()) {
    throw ValueError(fmt::format("rpc transport: address \"{}\" is not \"tcp://<ip>:<port>\"",
                                 printable(address)));
  }
  torchpar::detail::SocketAddress parsed;
  try {
    parsed = torchpar::detail::parse_socket_address(rest);
  } catch (const ValueError&) {
    parsed.kind = torchpar::detail::SocketAddress::Kind::kUnixPath;  // refused below
  }
  unsigned char buf[sizeof(in6_addr)];
  if (parsed.kind != torchpar::detail::SocketAddress::Kind::kTcp || parsed.port == 0 ||
      ::inet_pton(parsed.ipv6 ? AF_INET6 : AF_INET, parsed.host.c_str(), buf) != 1) {
    throw ValueError(fmt::format(
        "rpc transport: address \"{}\" is not \"tcp://<ip>:<port>\" (an IP address, not a "
        "name, and a port)",
        printable(address)));
  }
  return parsed;
}

bool is_shm_url(std::string_view url) {
  constexpr std::string_view kScheme = "shm://";
  if (url.substr(0, kScheme.size()) != kScheme) return false;
  const std::string_view name = url.substr(kScheme.size());
  return !name.empty() && name.size() <= 107 && std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '.' ||
           c == '_' || c == '-';
  });
}

// ---- TaskThreads ------------------------------------------------------------------------------

void TaskThreads::start(std::function<void()> task) {
  std::list<std::thread> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it : finished_) done.splice(done.end(), running_, it);
    finished_.clear();
    running_.emplace_back();
    const auto it = std::prev(running_.end());
    try {
      *it = std::thread([this, it, task = std::move(task)] {
        task();
        std::lock_guard<std::mutex> l(mu_);
        if (!joining_) finished_.push_back(it);
      });
    } catch (...) {
      running_.erase(it);
      throw;
    }
  }
  for (auto& t : done) t.join();  // they have returned or are returning
}

void TaskThreads::join_all() {
  std::list<std::thread> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    joining_ = true;
    all.swap(running_);
    finished_.clear();
  }
  for (auto& t : all) {
    // A handler run inline on one of these threads may close the transport (user code);
    // that thread returns on its own.
    if (t.get_id() == std::this_thread::get_id()) {
      t.detach();
    } else {
      t.join();
    }
  }
}

// ---- Dispatcher -------------------------------------------------------------------------------

Dispatcher::Dispatcher(std::string name, TransportHandlers handlers)
    : name_(std::move(name)), handlers_(std::move(handlers)) {}

Dispatcher::~Dispatcher() {
  stop();
  if (thread_.joinable()) {
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();
    } else {
      thread_.join();
    }
  }
}

void Dispatcher::start() {
  thread_ = std::thread([this] { loop(); });
}

void Dispatcher::post_message(const std::string& peer, Message msg) {
  post(Event{.peer = peer, .message = std::move(msg), .why = {}});
}

void Dispatcher::post_lost(const std::string& peer, const std::string& why) {
  post(Event{.peer = peer, .message = std::nullopt, .why = why});
}

void Dispatcher::post(Event event) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    events_.push_back(std::move(event));
  }
  cv_.notify_one();
}

void Dispatcher::stop() {
  std::deque<Event> dropped;  // destroyed unlocked: messages own storages
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    dropped.swap(events_);
  }
  cv_.notify_all();
}

void Dispatcher::join() {
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void Dispatcher::deliver(const std::string& peer, Message msg) noexcept {
  try {
    if (handlers_.on_message) handlers_.on_message(peer, std::move(msg));
  } catch (const std::exception& e) {
    log_line(
        fmt::format("rpc transport {}: a handler threw (ignored): {}", printable(name_), e.what()));
  } catch (...) {
    log_line(fmt::format("rpc transport {}: a handler threw (ignored)", printable(name_)));
  }
}

void Dispatcher::lost(const std::string& peer, const std::string& why) noexcept {
  try {
    if (handlers_.on_peer_lost) handlers_.on_peer_lost(peer, why);
  } catch (const std::exception& e) {
    log_line(
        fmt::format("rpc transport {}: a handler threw (ignored): {}", printable(name_), e.what()));
  } catch (...) {
    log_line(fmt::format("rpc transport {}: a handler threw (ignored)", printable(name_)));
  }
}

void Dispatcher::loop() {
  for (;;) {
    Event event;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopped_ || !events_.empty(); });
      if (stopped_) return;
      event = std::move(events_.front());
      events_.pop_front();
    }
    if (event.message) {
      deliver(event.peer, std::move(*event.message));
    } else {
      lost(event.peer, event.why);
    }
  }
}

}  // namespace torchpar::rpc::detail
