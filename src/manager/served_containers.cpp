// The manager's built-in "list", "Namespace", "Value" and "Array": what ListProxy<T>,
// NamespaceProxy, ValueProxy<T> and ArrayProxy<T> talk to. As the dict, they keep the payload
// bytes the proxy sent and never decode a value; a method returning one value answers with
// that value's bytes as they are (they are the payload of the result).

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <list>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "manager/server.h"
#include "torchpar/serialize/serialize.h"

namespace torchpar::detail {
namespace {

using Bytes = std::string;

[[noreturn]] void not_exposed(const std::string& method, const char* type_id) {
  throw ServedError("AttributeError", fmt::format("method '{}' of '{}' is not exposed by the "
                                                  "manager",
                                                  method, type_id));
}

/// `index` as Python resolves a subscript of a sequence of `size` items (negative counts
/// from the end); throws IndexError with `message` when it falls outside.
size_t checked_index(int64_t index, size_t size, const char* message) {
  const auto n = static_cast<int64_t>(size);
  if (index < 0) index += n;
  if (index < 0 || index >= n) throw ServedError("IndexError", message);
  return static_cast<size_t>(index);
}

/// The items of a create request for "list" and "Array": a tuple of the items' bytes ("" for
/// none, as a list made without arguments).
std::vector<Bytes> initial_items(const std::string& args) {
  if (args.empty()) return {};
  auto [items] = served_decode<std::tuple<std::vector<Bytes>>>(args);
  return std::move(items);
}

class ServedList final : public ServedObject {
 public:
  explicit ServedList(std::vector<Bytes> items) : items_(std::move(items)) {}

  std::string call(const std::string& method, const std::string& args,
                   const CallContext& /*context*/) override {
    if (method == "get") {
      const auto [index] = served_decode<std::tuple<int64_t>>(args);
      return items_[checked_index(index, items_.size(), "list index out of range")];
    }
    if (method == "set") {
      auto [index, value] = served_decode<std::tuple<int64_t, Bytes>>(args);
      items_[checked_index(index, items_.size(), "list assignment index out of range")] =
          std::move(value);
      return {};
    }
    if (method == "append") {
      auto [value] = served_decode<std::tuple<Bytes>>(args);
      items_.push_back(std::move(value));
      return {};
    }
    if (method == "extend") {
      auto [values] = served_decode<std::tuple<std::vector<Bytes>>>(args);
      items_.insert(items_.end(), std::make_move_iterator(values.begin()),
                    std::make_move_iterator(values.end()));
      return {};
    }
    if (method == "insert") {
      auto [index, value] = served_decode<std::tuple<int64_t, Bytes>>(args);
      // Python clamps: insert never fails, an index past either end inserts at that end.
      const auto n = static_cast<int64_t>(items_.size());
      if (index < 0) index = std::max<int64_t>(index + n, 0);
      index = std::min(index, n);
      items_.insert(items_.begin() + index, std::move(value));
      return {};
    }
    if (method == "pop") {
      const auto [index] = served_decode<std::tuple<int64_t>>(args);
      if (items_.empty()) throw ServedError("IndexError", "pop from empty list");
      const size_t i = checked_index(index, items_.size(), "pop index out of range");
      Bytes value = std::move(items_[i]);
      items_.erase(items_.begin() + static_cast<std::ptrdiff_t>(i));
      return value;
    }
    if (method == "size") return served_encode(static_cast<uint64_t>(items_.size()));
    if (method == "items") return served_encode(items_);
    if (method == "clear") {
      items_.clear();
      return {};
    }
    not_exposed(method, "list");
  }

 private:
  std::vector<Bytes> items_;
};

class ServedNamespace final : public ServedObject {
 public:
  std::string call(const std::string& method, const std::string& args,
                   const CallContext& /*context*/) override {
    if (method == "get") {
      const auto [name] = served_decode<std::tuple<std::string>>(args);
      return find(name)->second;
    }
    if (method == "set") {
      auto [name, value] = served_decode<std::tuple<std::string, Bytes>>(args);
      auto it = index_.find(name);
      if (it != index_.end()) {
        it->second->second = std::move(value);  // a known name keeps its place (Python)
      } else {
        items_.emplace_back(name, std::move(value));
        index_.emplace(std::move(name), std::prev(items_.end()));
      }
      return {};
    }
    if (method == "has") {
      const auto [name] = served_decode<std::tuple<std::string>>(args);
      return served_encode(index_.count(name) > 0);
    }
    if (method == "del") {
      const auto [name] = served_decode<std::tuple<std::string>>(args);
      items_.erase(find(name));
      index_.erase(name);
      return {};
    }
    if (method == "names") {
      std::vector<std::string> names;
      names.reserve(items_.size());
      for (const auto& item : items_) names.push_back(item.first);
      return served_encode(names);
    }
    not_exposed(method, "Namespace");
  }

 private:
  using Items = std::list<std::pair<std::string, Bytes>>;

  Items::iterator find(const std::string& name) {
    auto it = index_.find(name);
    if (it == index_.end()) {
      throw ServedError("AttributeError",
                        fmt::format("'Namespace' object has no attribute '{}'", name));
    }
    return it->second;
  }

  Items items_;  // in the order the names were first set, as a Python object's __dict__
  std::unordered_map<std::string, Items::iterator> index_;
};

class ServedValue final : public ServedObject {
 public:
  explicit ServedValue(Bytes value) : value_(std::move(value)) {}

  std::string call(const std::string& method, const std::string& args,
                   const CallContext& /*context*/) override {
    if (method == "get") return value_;
    if (method == "set") {
      auto [value] = served_decode<std::tuple<Bytes>>(args);
      value_ = std::move(value);
      return {};
    }
    not_exposed(method, "Value");
  }

 private:
  Bytes value_;
};

class ServedArray final : public ServedObject {
 public:
  explicit ServedArray(std::vector<Bytes> items) : items_(std::move(items)) {}

  std::string call(const std::string& method, const std::string& args,
                   const CallContext& /*context*/) override {
    if (method == "get") {
      const auto [index] = served_decode<std::tuple<int64_t>>(args);
      return items_[checked_index(index, items_.size(), "array index out of range")];
    }
    if (method == "set") {
      auto [index, value] = served_decode<std::tuple<int64_t, Bytes>>(args);
      items_[checked_index(index, items_.size(), "array assignment index out of range")] =
          std::move(value);
      return {};
    }
    if (method == "size") return served_encode(static_cast<uint64_t>(items_.size()));
    if (method == "items") return served_encode(items_);
    not_exposed(method, "Array");
  }

 private:
  std::vector<Bytes> items_;  // its length is fixed at creation, as Python's Array
};

}  // namespace

std::unique_ptr<ServedObject> make_served_list(const std::string& args) {
  return std::make_unique<ServedList>(initial_items(args));
}

std::unique_ptr<ServedObject> make_served_namespace(const std::string& /*args: none*/) {
  return std::make_unique<ServedNamespace>();
}

std::unique_ptr<ServedObject> make_served_value(const std::string& args) {
  if (args.empty()) throw ServedError("TypeError", "Value needs an initial value");
  auto [value] = served_decode<std::tuple<Bytes>>(args);
  return std::make_unique<ServedValue>(std::move(value));
}

std::unique_ptr<ServedObject> make_served_array(const std::string& args) {
  return std::make_unique<ServedArray>(initial_items(args));
}

}  // namespace torchpar::detail
