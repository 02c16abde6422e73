// create_transport: our TCP transport for every peer, TensorPipe's shm transport alone for
// peers of this host (transport.h). Address format: docs/wire_format.md, "RPC transport".

#include "rpc/transport/transport.h"

#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <utility>

#include "core/host_identity.h"
#include "rpc/transport/support.h"
#include "rpc/transport/tcp/factory.h"
#include "rpc/transport/tensorpipe/factory.h"
#include "torchpar/core/error.h"

namespace torchpar::rpc {
namespace {

using detail::log_line;
using detail::printable;

constexpr std::string_view kShmField = ";shm=";
constexpr std::string_view kHostField = ";host=";
/// The soft RLIMIT_NOFILE (RLIM_INFINITY as the largest value; 0 if unreadable).
uint64_t open_files_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return 0;
  return limit.rlim_cur == RLIM_INFINITY ? UINT64_MAX : static_cast<uint64_t>(limit.rlim_cur);
}

/// TCP to every peer; TensorPipe shm to those whose address has this host's identity.
///
/// Threads: those of its two transports; each runs its own handlers (see TransportHandlers).
/// Lifetime: close() closes both; the destructor too (the members' destructors).
class CompositeTransport final : public Transport {
 public:
  CompositeTransport(TransportOptions options, TransportHandlers handlers) {
    const std::string name = options.name;
    std::string host;
    if (options.shm) {
      host = torchpar::detail::this_host().token();
      if (host.empty()) {
        log_line(fmt::format(
            "rpc transport {}: cannot read this host's boot id or network namespace; shared "
            "memory is off, every peer goes over TCP",
            printable(name)));
      } else if (const uint64_t files = open_files_limit(); files < kMinFilesForShm) {
        // TensorPipe throws on its loop thread (std::terminate) when a memfd_create fails.
        log_line(fmt::format(
            "rpc transport {}: the open-files limit (RLIMIT_NOFILE, ulimit -n) is {}, under the "
            "{} TensorPipe's shm transport needs (it aborts the process when it runs out); "
            "shared memory is off, every peer goes over TCP",
            printable(name), files, kMinFilesForShm));
        host.clear();
      }
    }
    tcp_ = create_tcp_transport(options, handlers);
    address_ = tcp_->address();
    if (host.empty()) return;
    try {
      shm_ = detail::create_tensorpipe_shm_transport(std::move(options), std::move(handlers));
    } catch (const SystemError& e) {
      log_line(fmt::format(
          "rpc transport {}: TensorPipe's shm transport is unusable here ({}); every peer goes "
          "over TCP",
          printable(name), e.what()));
      return;
    }
    host_ = std::move(host);
    address_ += fmt::format("{}{}{}{}", kShmField, shm_->address(), kHostField, host_);
  }

  std::string address() const override { return address_; }

  void send(const std::string& peer, const std::string& address, Message msg,
            std::chrono::steady_clock::time_point deadline) override {
    const TransportAddress to = parse_transport_address(address);
    // Both ends see both addresses, so both make the same choice.
    if (shm_ && !to.shm.empty() && to.host == host_) {
      shm_->send(peer, to.shm, std::move(msg), deadline);
    } else {
      tcp_->send(peer, to.tcp, std::move(msg), deadline);
    }
  }

  // With TensorPipe's shm path a reply may come through its loop thread, which does not.
  bool reader_spins() const override { return !shm_ && tcp_->reader_spins(); }

  void close() override {
    std::exception_ptr first;
    for (Transport* t : {tcp_.get(), shm_.get()}) {
      if (!t) continue;
      try {
        t->close();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }

 private:
  std::unique_ptr<Transport> tcp_;
  std::unique_ptr<Transport> shm_;  // null: shm off or unusable
  std::string host_;                // this host's identity when shm_ is set
  std::string address_;
};

}  // namespace

TransportAddress parse_transport_address(std::string_view address) {
  auto refuse = [&](std::string_view why) {
    return ValueError(fmt::format(
        "rpc transport: address \"{}\" is not \"tcp://<ip>:<port>[;shm=shm://<name>;host=<id>]\" "
        "({})",
        printable(address), why));
  };
  TransportAddress out;
  const size_t fields = address.find(';');
  out.tcp = std::string(address.substr(0, fields));
  detail::parse_tcp_address(out.tcp);  // ValueError naming the address
  if (fields == std::string_view::npos) return out;
  std::string_view rest = address.substr(fields);
  if (rest.substr(0, kShmField.size()) != kShmField) {
    throw refuse("the TCP address is followed by something other than \";shm=\"");
  }
  rest.remove_prefix(kShmField.size());
  const size_t host_at = rest.find(kHostField);
  if (host_at == std::string_view::npos) throw refuse("\";shm=\" without \";host=\"");
  out.shm = std::string(rest.substr(0, host_at));
  out.host = std::string(rest.substr(host_at + kHostField.size()));
  if (!detail::is_shm_url(out.shm)) throw refuse("the shm field is not \"shm://<name>\"");
  if (!torchpar::detail::is_host_token(out.host))
    throw refuse("the host field is not a host identity");
  return out;
}

std::unique_ptr<Transport> create_transport(TransportOptions options, TransportHandlers handlers) {
  return std::make_unique<CompositeTransport>(std::move(options), std::move(handlers));
}

}  // namespace torchpar::rpc
