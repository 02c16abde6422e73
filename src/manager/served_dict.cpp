// The manager's built-in "dict": what DictProxy<K, V> talks to. Keys and values stay the
// payload bytes the proxy sent; two keys are the same key when their bytes are equal.

#include <fmt/format.h>

#include <iterator>
#include <list>
#include <optional>
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

class ServedDict final : public ServedObject {
 public:
  std::string call(const std::string& method, const std::string& args,
                   const CallContext& /*context*/) override {
    if (method == "get") {
      const auto [key] = served_decode<std::tuple<Bytes>>(args);
      auto it = index_.find(key);
      return served_encode(it == index_.end() ? std::optional<Bytes>()
                                              : std::optional(it->second->second));
    }
    if (method == "set") {
      auto [key, value] = served_decode<std::tuple<Bytes, Bytes>>(args);
      set(std::move(key), std::move(value));
      return {};
    }
    if (method == "pop") {
      const auto [key] = served_decode<std::tuple<Bytes>>(args);
      auto it = index_.find(key);
      if (it == index_.end()) throw ServedError("KeyError", "pop: the dict holds no such key");
      Bytes value = std::move(it->second->second);
      items_.erase(it->second);
      index_.erase(it);
      return served_encode(value);
    }
    if (method == "contains") {
      const auto [key] = served_decode<std::tuple<Bytes>>(args);
      return served_encode(index_.count(key) > 0);
    }
    if (method == "keys") {
      std::vector<Bytes> keys;
      keys.reserve(items_.size());
      for (const auto& kv : items_) keys.push_back(kv.first);
      return served_encode(keys);
    }
    if (method == "items") {
      return served_encode(std::vector<std::pair<Bytes, Bytes>>(items_.begin(), items_.end()));
    }
    if (method == "values") {
      std::vector<Bytes> values;
      values.reserve(items_.size());
      for (const auto& kv : items_) values.push_back(kv.second);
      return served_encode(values);
    }
    if (method == "popitem") {  // the last inserted item (Python 3.7+: LIFO)
      if (items_.empty()) throw ServedError("KeyError", "popitem(): dictionary is empty");
      std::pair<Bytes, Bytes> last = std::move(items_.back());
      index_.erase(last.first);
      items_.pop_back();
      return served_encode(last);
    }
    if (method == "setdefault") {
      auto [key, value] = served_decode<std::tuple<Bytes, Bytes>>(args);
      auto it = index_.find(key);
      if (it != index_.end()) return served_encode(it->second->second);
      Bytes inserted = value;
      set(std::move(key), std::move(value));
      return served_encode(inserted);
    }
    if (method == "size") return served_encode(static_cast<uint64_t>(items_.size()));
    if (method == "update") {
      auto [pairs] = served_decode<std::tuple<std::vector<std::pair<Bytes, Bytes>>>>(args);
      for (auto& [k, v] : pairs) set(std::move(k), std::move(v));
      return {};
    }
    if (method == "clear") {
      index_.clear();
      items_.clear();
      return {};
    }
    throw ServedError("AttributeError",
                      fmt::format("method '{}' of 'dict' is not exposed by the manager", method));
  }

 private:
  void set(Bytes key, Bytes value) {
    auto it = index_.find(key);
    if (it != index_.end()) {
      it->second->second = std::move(value);  // an existing key keeps its place (Python)
      return;
    }
    items_.emplace_back(key, std::move(value));
    index_.emplace(std::move(key), std::prev(items_.end()));
  }

  std::list<std::pair<Bytes, Bytes>> items_;  // insertion order
  std::unordered_map<Bytes, std::list<std::pair<Bytes, Bytes>>::iterator> index_;
};

}  // namespace

std::unique_ptr<ServedObject> make_served_dict(const std::string& /*args: none*/) {
  return std::make_unique<ServedDict>();
}

}  // namespace torchpar::detail
