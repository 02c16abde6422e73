#include "torchpar/server/ordered_server.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <exception>

#include "server/flat_buffer.h"

namespace torchpar::detail {

OrderedStore::OrderedStore(std::string server_name, int64_t version_depth)
    : name_(std::move(server_name)), depth_(version_depth) {}

void OrderedStore::check_open() const {
  if (closed_) throw ClosedError(fmt::format("ordered server '{}': closed", name_));
}

bool OrderedStore::push(const std::string& key, std::shared_ptr<const void> value, int64_t version,
                        std::optional<int64_t> prev_version) {
  std::vector<Entry> evicted;  // freed after the lock is released
  std::lock_guard<std::mutex> g(mu_);
  check_open();
  auto it = chains_.find(key);
  if (it == chains_.end()) {
    chains_[key].push_back(Entry{version, std::move(value)});
    return true;
  }
  auto& chain = it->second;
  if (!prev_version || chain.back().version != *prev_version) return false;
  // A version still stored is replaced and becomes the newest (machin's OrderedDict kept
  // its old position, so "newest" could be an older entry).
  auto same = std::find_if(chain.begin(), chain.end(),
                           [&](const Entry& e) { return e.version == version; });
  if (same != chain.end()) {
    evicted.push_back(std::move(*same));
    chain.erase(same);
  }
  chain.push_back(Entry{version, std::move(value)});
  while (static_cast<int64_t>(chain.size()) > depth_) {
    evicted.push_back(std::move(chain.front()));
    chain.erase(chain.begin());
  }
  return true;
}

std::optional<std::pair<std::shared_ptr<const void>, int64_t>> OrderedStore::pull(
    const std::string& key, std::optional<int64_t> version) const {
  std::lock_guard<std::mutex> g(mu_);
  check_open();
  auto it = chains_.find(key);
  if (it == chains_.end()) return std::nullopt;
  const auto& chain = it->second;
  if (!version) return std::make_pair(chain.back().value, chain.back().version);
  for (const auto& e : chain) {
    if (e.version == *version) return std::make_pair(e.value, e.version);
  }
  return std::nullopt;
}

void OrderedStore::close() {
  std::map<std::string, std::vector<Entry>> dropped;
  std::lock_guard<std::mutex> g(mu_);
  closed_ = true;
  dropped.swap(chains_);
}

namespace {

bool fits_shared(const at::Tensor& t) {
  return !t.defined() || (t.layout() == at::kStrided && !t.is_quantized() && t.has_storage());
}

at::ScalarType own_type(const at::Tensor& t) { return t.scalar_type(); }

// The fallback: a private copy on the CPU.
at::Tensor cpu_copy(const at::Tensor& t) {
  if (!t.defined()) return t;
  return t.device().is_cpu() ? t.detach().clone() : t.detach().to(at::kCPU);
}

StateDict cpu_copy(const StateDict& tensors) {
  StateDict out;
  for (const auto& [k, t] : tensors) out.emplace(k, cpu_copy(t));
  return out;
}

}  // namespace

StateDict shared_copy(const StateDict& tensors) {
  bool any_bytes = false;
  for (const auto& [k, t] : tensors) {
    if (!fits_shared(t)) return cpu_copy(tensors);
    any_bytes = any_bytes || (t.defined() && t.numel() > 0);
  }
  if (!any_bytes) return cpu_copy(tensors);
  at::Tensor flat;
  try {
    flat = empty_shared({flat_bytes(tensors, own_type)}, at::kByte);
  } catch (const ShmError&) {  // shared memory is short: a private copy is still a copy
    return cpu_copy(tensors);
  }
  return copy_into_flat(flat, tensors, own_type);
}

at::Tensor shared_copy(const at::Tensor& tensor) {
  if (!tensor.defined() || !fits_shared(tensor) || tensor.numel() == 0) return cpu_copy(tensor);
  at::Tensor out;
  try {
    out = empty_shared(tensor.sizes(), at::TensorOptions().dtype(tensor.scalar_type()));
  } catch (const ShmError&) {
    return cpu_copy(tensor);
  }
  out.copy_(tensor.detach());
  return out;
}

std::string ordered_push_service(const std::string& server_name) {
  return server_name + "/_push_service";
}
std::string ordered_pull_service(const std::string& server_name) {
  return server_name + "/_pull_service";
}

namespace {

// Deregisters this member's services of a server, collecting the first error in `first`.
void forget_services(RpcGroup& group, const std::vector<std::string>& keys,
                     std::exception_ptr* first) {
  for (const auto& key : keys) {
    try {
      group.deregister_service(key);
    } catch (...) {
      if (first && !*first) *first = std::current_exception();
    }
  }
}

}  // namespace

std::shared_ptr<OrderedStore> open_ordered_server(
    const std::string& server_name, RpcGroup& group, int64_t version_depth,
    const std::type_info& value_type,
    const std::function<void(const std::shared_ptr<OrderedStore>&, bool push)>& register_service) {
  if (server_name.empty()) throw ValueError("OrderedServerSimpleImpl: empty server name");
  if (version_depth < 1) {
    throw ValueError(fmt::format(
        "OrderedServerSimpleImpl '{}': version_depth must be >= 1 (versions kept per key), got {}",
        server_name, version_depth));
  }
  auto store = std::make_shared<OrderedStore>(server_name, version_depth);
  std::vector<std::string> registered;  // only these are undone: a taken name stays its owner's
  try {
    register_service(store, true);
    registered.push_back(ordered_push_service(server_name));
    register_service(store, false);
    registered.push_back(ordered_pull_service(server_name));
    group.pair(server_name,
               OrderedServerInfo{group.get_cur_name(), version_depth, value_type.name(), store});
  } catch (...) {
    forget_services(group, registered, nullptr);
    throw;
  }
  return store;
}

void close_ordered_server(const std::string& server_name, RpcGroup& group,
                          const std::shared_ptr<OrderedStore>& store, bool report) {
  std::exception_ptr first;
  try {
    group.unpair(server_name);
  } catch (...) {
    first = std::current_exception();
  }
  forget_services(group, {ordered_push_service(server_name), ordered_pull_service(server_name)},
                  &first);
  store->close();
  if (report && first) std::rethrow_exception(first);
}

OrderedServerLocation resolve_ordered_server(RpcGroup& group, const std::string& server_name,
                                             const std::type_info& value_type, Timeout timeout) {
  auto ref = group.get_paired<OrderedServerInfo>(server_name);
  OrderedServerLocation where;
  where.host = ref.owner();
  OrderedServerInfo info;
  if (ref.is_owner()) {
    auto mine = group.local_paired<OrderedServerInfo>(server_name);
    info = *mine;
    where.local = mine->store;
  } else {
    info = ref.to_here(timeout);
  }
  if (info.value_type != value_type.name()) {
    throw ValueError(fmt::format(
        "ordered server '{}' on member '{}' holds values of type {}, not {}", server_name,
        where.host, c10::demangle(info.value_type.c_str()), c10::demangle(value_type.name())));
  }
  return where;
}

void rethrow_server_call_error(const std::string& subject, const char* what,
                               const std::string& member) {
  try {
    throw;
  } catch (const RpcPeerLostError& e) {
    throw RpcPeerLostError(e.member(), fmt::format("{}: {} failed, member '{}' is unreachable ({})",
                                                   subject, what, e.member(), e.what()));
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format("{}: {} to member '{}' did not end in time ({})", subject, what,
                                   member.empty() ? "?" : member, e.what()));
  }
}

}  // namespace torchpar::detail
