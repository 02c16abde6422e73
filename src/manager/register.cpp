// Registered manager types (torchpar/manager/register.h): the process-global registry, the
// client-side type checks, and the served object that runs a registered type's members in
// the server.

#include "torchpar/manager/register.h"

#include <c10/util/Type.h>
#include <fmt/format.h>

#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "manager/server.h"
#include "torchpar/core/error.h"

namespace torchpar::detail {
namespace {

std::mutex g_registry_mu;
std::unordered_map<std::string, std::shared_ptr<const ManagedTypeInfo>>& registry() {
  // Never freed: registrations run during static initialization and may be looked up
  // during static destruction (a proxy's last call).
  static auto* m = new std::unordered_map<std::string, std::shared_ptr<const ManagedTypeInfo>>();
  return *m;
}

std::string name_of(const std::type_index& t) {
  return t == typeid(void) ? std::string("void") : c10::demangle(t.name());
}

std::string exposed_list(const ManagedTypeInfo& info) {
  std::string out;
  for (const auto& [name, method] : info.methods) {
    if (!out.empty()) out += ", ";
    out += name;
  }
  return out.empty() ? std::string("none") : out;
}

/// One object of a registered type in the server.
class ServedRegistered final : public ServedObject {
 public:
  ServedRegistered(std::shared_ptr<const ManagedTypeInfo> info, std::shared_ptr<void> object)
      : info_(std::move(info)), object_(std::move(object)) {}

  std::string call(const std::string& method, const std::string& args,
                   const CallContext& /*context*/) override {
    auto it = info_->methods.find(method);
    if (it == info_->methods.end()) {
      throw ServedError("AttributeError",
                        fmt::format("the manager's '{}' exposes no method '{}' (exposed: {})",
                                    info_->type_id, method, exposed_list(*info_)));
    }
    try {
      return it->second.call(object_.get(), args);
    } catch (const std::exception&) {
      throw;  // the server reports its demangled type and message
    } catch (...) {
      // Anything else (`throw 42`) would end the connection's thread: report it instead.
      throw ServedError("UnknownError",
                        fmt::format("'{}'.{} threw an exception that is no std::exception",
                                    info_->type_id, method));
    }
  }

  bool serialized() const override { return !info_->thread_safe; }

 private:
  std::shared_ptr<const ManagedTypeInfo> info_;  // as registered when the object was made
  std::shared_ptr<void> object_;
};

}  // namespace

void publish_managed_type(std::shared_ptr<const ManagedTypeInfo> info) {
  std::lock_guard<std::mutex> g(g_registry_mu);
  registry()[info->type_id] = std::move(info);
}

std::shared_ptr<const ManagedTypeInfo> find_managed_type(const std::string& type_id) {
  std::lock_guard<std::mutex> g(g_registry_mu);
  auto it = registry().find(type_id);
  return it == registry().end() ? nullptr : it->second;
}

namespace {

/// The registration of `type_id` when it is registered here for `cpp_type`; nullptr when it
/// is not registered here. ValueError when it is registered for another type.
std::shared_ptr<const ManagedTypeInfo> registered_for(const std::string& type_id,
                                                      const std::type_info& cpp_type) {
  auto info = find_managed_type(type_id);
  if (info && info->cpp_type != std::type_index(cpp_type)) {
    throw ValueError(fmt::format("manager typeid '{}' is registered for {}, not {}", type_id,
                                 info->cpp_name, c10::demangle(cpp_type.name())));
  }
  return info;
}

}  // namespace

void check_managed_init(const std::string& type_id, const std::type_info& cpp_type,
                        const std::type_info& args) {
  auto info = registered_for(type_id, cpp_type);
  if (!info || !info->make) return;  // the server says what it knows
  if (info->init_args != std::type_index(args)) {
    throw ValueError(fmt::format("Manager::make('{}'): {} is made from {}, not from {}", type_id,
                                 info->cpp_name, name_of(info->init_args),
                                 name_of(std::type_index(args))));
  }
}

void check_managed_call(const std::string& type_id, const std::type_info& cpp_type,
                        const std::string& method, const std::type_info& args,
                        const std::type_info& result) {
  auto info = registered_for(type_id, cpp_type);
  if (!info) return;
  auto it = info->methods.find(method);
  if (it == info->methods.end()) return;  // the server raises AttributeError
  const ManagedTypeInfo::Method& m = it->second;
  if (m.args != std::type_index(args) || m.result != std::type_index(result)) {
    throw ValueError(
        fmt::format("Proxy<{}>::call: '{}'.{} takes {} and returns {}; called with {} for {}",
                    info->cpp_name, type_id, method, name_of(m.args), name_of(m.result),
                    name_of(std::type_index(args)), name_of(std::type_index(result))));
  }
}

std::unique_ptr<ServedObject> make_served_registered(const std::string& type_id,
                                                     const std::string& args) {
  auto info = find_managed_type(type_id);
  if (!info) return nullptr;
  if (!info->make) {
    throw ServedError("TypeError",
                      fmt::format("the manager's '{}' ({}) has no constructor registered: call "
                                  "init<A...>() on its registration",
                                  type_id, info->cpp_name));
  }
  std::shared_ptr<void> object;
  try {
    object = info->make(args);
  } catch (const std::exception&) {
    throw;
  } catch (...) {
    throw ServedError("UnknownError",
                      fmt::format("the constructor of '{}' threw an exception that is no "
                                  "std::exception",
                                  type_id));
  }
  return std::make_unique<ServedRegistered>(std::move(info), std::move(object));
}

}  // namespace torchpar::detail
