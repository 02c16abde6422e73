// The containers of Python clients: dict, list, Namespace, Value, Array and Iterator, on
// pickle values with Python's semantics (keys hashed and compared as Python does for the key
// types of pickle.h; any other key is TypeError "unhashable type").
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "manager/py_objects.h"

namespace torchpar::detail::py {

using pickle::DictItem;
using pickle::KeyEqual;
using pickle::KeyHash;

namespace {

const std::vector<Value>* sequence(const Value& v) {
  if (v.is<pickle::List>()) return &v.as<pickle::List>().items;
  if (v.is<pickle::Tuple>()) return &v.as<pickle::Tuple>().items;
  return nullptr;
}

bool is_number(const Value& v) {
  return v.is<bool>() || v.is<int64_t>() || v.is<double>() || v.is<pickle::BigInt>();
}

double as_double(const Value& v) {
  if (v.is<double>()) return v.as<double>();
  if (v.is<bool>()) return v.as<bool>() ? 1 : 0;
  if (v.is<int64_t>()) return static_cast<double>(v.as<int64_t>());
  // A BigInt is beyond +-2^63: its sign is enough for ordering against int64 and doubles
  // that are not as large (the key helpers compare them exactly for ==).
  return v.as<pickle::BigInt>().bytes.back() & 0x80 ? -HUGE_VAL : HUGE_VAL;
}

/// Python's a < b for numbers, str, bytes, and tuples / lists of those.
bool py_less(const Value& a, const Value& b) {
  if (is_number(a) && is_number(b)) {
    if (a.is<int64_t>() && b.is<int64_t>()) return a.as<int64_t>() < b.as<int64_t>();
    return as_double(a) < as_double(b);
  }
  if (a.is<pickle::Str>() && b.is<pickle::Str>())  // UTF-8 byte order is code point order
    return a.as<pickle::Str>().utf8 < b.as<pickle::Str>().utf8;
  if (a.is<pickle::Bytes>() && b.is<pickle::Bytes>())
    return a.as<pickle::Bytes>().data < b.as<pickle::Bytes>().data;
  const auto* x = sequence(a);
  const auto* y = sequence(b);
  if (x != nullptr && y != nullptr && a.kind() == b.kind()) {
    for (size_t i = 0; i < x->size() && i < y->size(); ++i) {
      if (!py_equal((*x)[i], (*y)[i])) return py_less((*x)[i], (*y)[i]);
    }
    return x->size() < y->size();
  }
  raise("TypeError", fmt::format("'<' not supported between instances of '{}' and '{}'",
                                 a.type_name(), b.type_name()));
}

/// Python's index of `i` in a sequence of `n` (negative from the end); IndexError outside.
size_t position(const Value& i, size_t n, const char* what) {
  int64_t k = to_int(i, "indices");
  if (k < 0) k += static_cast<int64_t>(n);
  if (k < 0 || k >= static_cast<int64_t>(n))
    raise("IndexError", fmt::format("{} index out of range", what));
  return static_cast<size_t>(k);
}

bool is_slice(const Value& v) {
  return v.is<pickle::Object>() && v.as<pickle::Object>().type.module == "builtins" &&
         v.as<pickle::Object>().type.name == "slice";
}

/// The positions slice(start, stop, step) selects in a sequence of `n`, as
/// PySlice_AdjustIndices computes them.
std::vector<size_t> slice_positions(const Value& slice, size_t n) {
  const auto& a = slice.as<pickle::Object>().args;
  const auto get = [&](size_t i) -> std::optional<int64_t> {
    if (i >= a.size() || a[i].is<pickle::None>()) return std::nullopt;
    return to_int(a[i], "slice indices");
  };
  const int64_t step = get(2).value_or(1);
  if (step == 0) raise("ValueError", "slice step cannot be zero");
  const auto len = static_cast<int64_t>(n);
  const auto clamp = [&](std::optional<int64_t> v, int64_t dflt) {
    if (!v) return dflt;
    int64_t x = *v < 0 ? *v + len : *v;
    if (step > 0) return std::clamp<int64_t>(x, 0, len);
    return std::clamp<int64_t>(x, -1, len - 1);
  };
  const int64_t start = clamp(get(0), step > 0 ? 0 : len - 1);
  const int64_t stop = clamp(get(1), step > 0 ? len : -1);
  std::vector<size_t> out;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
    out.push_back(static_cast<size_t>(i));
  return out;
}

/// The items of an iterable argument (list, tuple, set, a dict's keys, str's characters are
/// not supported); TypeError otherwise.
std::vector<Value> items_of(const Value& v) {
  if (const auto* s = sequence(v)) return *s;
  if (v.is<pickle::Set>()) return v.as<pickle::Set>().items;
  if (v.is<pickle::FrozenSet>()) return v.as<pickle::FrozenSet>().items;
  if (v.is<pickle::Dict>()) {
    std::vector<Value> keys;
    for (const auto& it : v.as<pickle::Dict>().items) keys.push_back(it.key);
    return keys;
  }
  if (v.is<pickle::Object>() && v.as<pickle::Object>().type.module == "builtins" &&
      v.as<pickle::Object>().type.name == "range") {  // range(start, stop, step)
    const auto& r = v.as<pickle::Object>().args;
    const int64_t start = r.size() > 1 ? to_int(r[0], "range") : 0;
    const int64_t stop = to_int(r.at(r.size() > 1 ? 1 : 0), "range");
    const int64_t step = r.size() > 2 ? to_int(r[2], "range") : 1;
    if (step == 0) raise("ValueError", "range() arg 3 must not be zero");
    std::vector<Value> out;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      if (out.size() >= (size_t{1} << 22))
        raise("MemoryError", "a range of more than 4 Mi items is refused here");
      out.emplace_back(i);
    }
    return out;
  }
  raise("TypeError", fmt::format("'{}' object is not iterable here", v.type_name()));
}

/// A key's lookup errors as Python's: TypeError for an unhashable key.
template <class F>
auto with_key(F f) {
  try {
    return f();
  } catch (const pickle::UnsupportedKeyError& e) {
    raise("TypeError", fmt::format("unhashable type: '{}'", e.type_name()));
  }
}

// ---- dict ---------------------------------------------------------------------------------

class PyDict final : public PyServed {
 public:
  std::vector<std::string> exposed() const override {
    return {"__contains__", "__delitem__", "__getitem__", "__iter__", "__len__", "__setitem__",
            "clear",        "copy",        "get",         "items",    "keys",    "pop",
            "popitem",      "setdefault",  "update",      "values"};
  }
  std::optional<std::string> proxy_typeid(const std::string& method) const override {
    if (method == "__iter__") return "Iterator";
    return std::nullopt;
  }

  void set(const Value& key, Value value) {
    with_key([&] {
      const auto it = index_.find(key);
      if (it != index_.end()) {
        items_[it->second]->value = std::move(value);
      } else {
        index_.emplace(key, items_.size());
        items_.push_back(DictItem{key, std::move(value)});
      }
      return 0;
    });
  }

  /// The dict's size, for its iterators (they live in other objects, under other locks).
  std::shared_ptr<const std::atomic<int64_t>> size() const { return size_; }

  Value py_call(const std::string& m, std::vector<Value>& a, const pickle::Dict& kw,
                const CallContext& c) override {
    Value result = dict_call(m, a, kw, c);
    size_->store(static_cast<int64_t>(index_.size()));
    return result;
  }

  Value dict_call(const std::string& m, std::vector<Value>& a, const pickle::Dict& kw,
                  const CallContext&) {
    static const Value kNone;
    const auto arg = [&](size_t i, const char* name, const Value* dflt = nullptr) -> const Value& {
      return argument(a, kw, i, name, dflt);
    };
    if (m == "__getitem__") {
      const auto i = find(arg(0, "key"));
      if (!i) throw PyException("builtins", "KeyError", {arg(0, "key")}, arg(0, "key").repr());
      return items_[*i]->value;
    }
    if (m == "__setitem__") {
      set(arg(0, "key"), arg(1, "value"));
      return {};
    }
    if (m == "__contains__") return find(arg(0, "key")).has_value();
    if (m == "__len__") return static_cast<int64_t>(index_.size());
    if (m == "get") {
      const auto i = find(arg(0, "key"));
      return i ? items_[*i]->value : arg(1, "default", &kNone);
    }
    if (m == "__delitem__" || m == "pop") {
      const auto i = find(arg(0, "key"));
      if (!i) {
        if (m == "pop" && (a.size() > 1 || !kw.items.empty())) return arg(1, "default");
        throw PyException("builtins", "KeyError", {arg(0, "key")}, arg(0, "key").repr());
      }
      Value v = std::move(items_[*i]->value);
      erase(*i);
      return m == "pop" ? v : Value();
    }
    if (m == "keys" || m == "values" || m == "items" || m == "__iter__") {
      std::vector<Value> out;
      for (const auto& it : items_) {
        if (!it) continue;
        if (m == "items") {
          out.push_back(Value::tuple({it->key, it->value}));
        } else {
          out.push_back(m == "values" ? it->value : it->key);
        }
      }
      return Value::list(std::move(out));
    }
    if (m == "copy") return value();
    if (m == "clear") {
      items_.clear();
      index_.clear();
      return {};
    }
    if (m == "setdefault") {
      const Value& key = arg(0, "key");
      if (const auto i = find(key)) return items_[*i]->value;
      set(key, arg(1, "default", &kNone));
      return arg(1, "default", &kNone);
    }
    if (m == "popitem") {
      for (size_t i = items_.size(); i-- > 0;) {
        if (!items_[i]) continue;
        Value pair = Value::tuple({items_[i]->key, items_[i]->value});
        erase(i);
        return pair;
      }
      raise("KeyError", "popitem(): dictionary is empty");
    }
    if (m == "update") {
      if (!a.empty()) {
        if (a[0].is<pickle::Dict>()) {
          for (const auto& it : a[0].as<pickle::Dict>().items) set(it.key, it.value);
        } else {
          for (const auto& pair : items_of(a[0])) {
            const auto* kv = sequence(pair);
            if (kv == nullptr || kv->size() != 2)
              raise("ValueError", "dictionary update sequence element has length != 2");
            set((*kv)[0], (*kv)[1]);
          }
        }
      }
      for (const auto& it : kw.items) set(it.key, it.value);
      return {};
    }
    raise("AttributeError", fmt::format("'dict' object has no attribute '{}'", m));
  }

  Value value() const override {
    std::vector<DictItem> out;
    for (const auto& it : items_) {
      if (it) out.push_back(*it);
    }
    return Value::dict(std::move(out));
  }

 private:
  std::optional<size_t> find(const Value& key) const {
    return with_key([&]() -> std::optional<size_t> {
      const auto it = index_.find(key);
      if (it == index_.end()) return std::nullopt;
      return it->second;
    });
  }
  void erase(size_t i) {
    index_.erase(items_[i]->key);
    items_[i].reset();
    if (items_.size() > 32 && index_.size() < items_.size() / 2) {  // compact the holes
      std::vector<std::optional<DictItem>> kept;
      for (auto& it : items_) {
        if (it) kept.push_back(std::move(it));
      }
      items_ = std::move(kept);
      index_.clear();
      for (size_t k = 0; k < items_.size(); ++k) index_.emplace(items_[k]->key, k);
    }
  }

  std::vector<std::optional<DictItem>> items_;  // insertion order; holes where erased
  std::unordered_map<Value, size_t, KeyHash, KeyEqual> index_;
  std::shared_ptr<std::atomic<int64_t>> size_ = std::make_shared<std::atomic<int64_t>>(0);
};

// ---- list and Array ---------------------------------------------------------------------

class PyList final : public PyServed {
 public:
  PyList(std::vector<Value> items, std::string typecode)
      : items_(std::move(items)), typecode_(std::move(typecode)) {}

  std::vector<std::string> exposed() const override {
    if (!typecode_.empty()) return {"__len__", "__getitem__", "__setitem__"};
    return {"__add__", "__contains__", "__delitem__", "__getitem__", "__len__",
            "__mul__", "__reversed__", "__rmul__",    "__setitem__", "append",
            "count",   "extend",       "index",       "insert",      "pop",
            "remove",  "reverse",      "sort",        "__imul__"};
  }

  Value py_call(const std::string& m, std::vector<Value>& a, const pickle::Dict& kw,
                const CallContext&) override {
    const char* what = typecode_.empty() ? "list" : "array";
    const auto arg = [&](size_t i, const char* name, const Value* dflt = nullptr) -> const Value& {
      return argument(a, kw, i, name, dflt);
    };
    if (m == "__len__") return static_cast<int64_t>(items_.size());
    if (m == "__getitem__") {
      if (is_slice(arg(0, "index"))) {
        std::vector<Value> out;
        for (size_t i : slice_positions(arg(0, "index"), items_.size())) out.push_back(items_[i]);
        return Value::list(std::move(out));
      }
      return items_[position(arg(0, "index"), items_.size(), what)];
    }
    if (m == "__setitem__") {
      if (is_slice(arg(0, "index"))) {
        set_slice(arg(0, "index"), items_of(arg(1, "value")));
      } else {
        items_[position(arg(0, "index"), items_.size(), what)] = arg(1, "value");
      }
      return {};
    }
    if (!typecode_.empty()) raise("AttributeError", fmt::format("'array' has no '{}'", m));
    return list_call(m, a, kw);
  }

  Value value() const override {
    if (typecode_.empty()) return Value::list(items_);
    return Value::object("array", "array", {Value::str(typecode_), Value::list(items_)});
  }
  std::string repr() const override {
    const std::string list = Value::list(items_).repr();
    return typecode_.empty() ? list : fmt::format("array('{}', {})", typecode_, list);
  }

 private:
  /// The methods a list has and an Array has not.
  Value list_call(const std::string& m, std::vector<Value>& a, const pickle::Dict& kw) {
    const auto arg = [&](size_t i, const char* name, const Value* dflt = nullptr) -> const Value& {
      return argument(a, kw, i, name, dflt);
    };
    if (m == "append") {
      items_.push_back(arg(0, "object"));
      return {};
    }
    if (m == "extend") {
      auto more = items_of(arg(0, "iterable"));
      items_.insert(items_.end(), more.begin(), more.end());
      return {};
    }
    if (m == "__contains__") return find(arg(0, "value"), 0, items_.size()).has_value();
    if (m == "count") {
      return static_cast<int64_t>(std::count_if(
          items_.begin(), items_.end(), [&](const Value& v) { return py_equal(v, a.at(0)); }));
    }
    if (m == "index") {
      const auto n = static_cast<int64_t>(items_.size());
      const auto bound = [&](size_t i, int64_t dflt) {
        if (a.size() <= i) return dflt;
        int64_t k = to_int(a[i], "index bounds");
        if (k < 0) k += n;
        return std::clamp<int64_t>(k, 0, n);
      };
      const auto i =
          find(arg(0, "value"), static_cast<size_t>(bound(1, 0)), static_cast<size_t>(bound(2, n)));
      if (!i) raise("ValueError", fmt::format("{} is not in list", arg(0, "value").repr()));
      return static_cast<int64_t>(*i);
    }
    if (m == "insert") {
      auto k = to_int(arg(0, "index"), "index");
      const auto n = static_cast<int64_t>(items_.size());
      if (k < 0) k = std::max<int64_t>(0, k + n);
      items_.insert(items_.begin() + std::min(k, n), arg(1, "object"));
      return {};
    }
    if (m == "pop") {
      if (items_.empty()) raise("IndexError", "pop from empty list");
      static const Value kLast = int64_t{-1};
      const size_t i = position(arg(0, "index", &kLast), items_.size(), "pop");
      Value v = std::move(items_[i]);
      items_.erase(items_.begin() + static_cast<std::ptrdiff_t>(i));
      return v;
    }
    if (m == "remove") {
      const auto i = find(arg(0, "value"), 0, items_.size());
      if (!i) raise("ValueError", "list.remove(x): x not in list");
      items_.erase(items_.begin() + static_cast<std::ptrdiff_t>(*i));
      return {};
    }
    return list_edit(m, a, kw);
  }

  /// The methods that take items out or reorder them.
  Value list_edit(const std::string& m, std::vector<Value>& a, const pickle::Dict& kw) {
    const auto arg = [&](size_t i, const char* name, const Value* dflt = nullptr) -> const Value& {
      return argument(a, kw, i, name, dflt);
    };
    if (m == "__delitem__") {
      if (is_slice(arg(0, "index"))) {
        auto gone = slice_positions(arg(0, "index"), items_.size());
        std::sort(gone.rbegin(), gone.rend());
        for (size_t i : gone) items_.erase(items_.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        const size_t i = position(arg(0, "index"), items_.size(), "list");
        items_.erase(items_.begin() + static_cast<std::ptrdiff_t>(i));
      }
      return {};
    }
    if (m == "reverse") {
      std::reverse(items_.begin(), items_.end());
      return {};
    }
    if (m == "__reversed__") {  // a list_reverseiterator on the client: reversed(list)
      return Value::object("builtins", "reversed", {value()});
    }
    if (m == "sort") {
      for (const auto& it : kw.items) {
        const auto& name = it.key.as<pickle::Str>().utf8;
        if (name == "key" && !it.value.is<pickle::None>())
          raise("TypeError", "sort(key=...) needs a function, which this server cannot call");
      }
      static const Value kFalse = false;
      const bool reverse = truthy(argument({}, kw, 0, "reverse", &kFalse));
      std::stable_sort(items_.begin(), items_.end(), [&](const Value& x, const Value& y) {
        return reverse ? py_less(y, x) : py_less(x, y);
      });
      return {};
    }
    if (m == "__add__") {
      auto out = items_;
      auto more = items_of(arg(0, "other"));
      out.insert(out.end(), more.begin(), more.end());
      return Value::list(std::move(out));
    }
    if (m == "__mul__" || m == "__rmul__" || m == "__imul__") {
      const int64_t times = to_int(arg(0, "n"), "can't multiply sequence by non-int");
      std::vector<Value> out;
      for (int64_t t = 0; t < times; ++t) out.insert(out.end(), items_.begin(), items_.end());
      if (m != "__imul__") return Value::list(std::move(out));
      items_ = std::move(out);
      return {};
    }
    raise("AttributeError", fmt::format("'list' object has no attribute '{}'", m));
  }

  std::optional<size_t> find(const Value& v, size_t from, size_t to) const {
    for (size_t i = from; i < to && i < items_.size(); ++i) {
      if (py_equal(items_[i], v)) return i;
    }
    return std::nullopt;
  }
  void set_slice(const Value& slice, std::vector<Value> values) {
    const auto& sa = slice.as<pickle::Object>().args;
    const bool simple = sa.size() < 3 || sa[2].is<pickle::None>() ||
                        (sa[2].is<int64_t>() && sa[2].as<int64_t>() == 1);
    auto pos = slice_positions(slice, items_.size());
    if (!simple || !typecode_.empty()) {
      if (pos.size() != values.size())
        raise("ValueError", fmt::format("attempt to assign sequence of size {} to slice of size {}",
                                        values.size(), pos.size()));
      for (size_t i = 0; i < pos.size(); ++i) items_[pos[i]] = std::move(values[i]);
      return;
    }
    // A contiguous slice takes any number of items.
    size_t start = pos.empty() ? 0 : pos.front();
    if (pos.empty()) {
      const auto n = static_cast<int64_t>(items_.size());
      int64_t s = sa.empty() || sa[0].is<pickle::None>() ? 0 : to_int(sa[0], "slice indices");
      if (s < 0) s += n;
      start = static_cast<size_t>(std::clamp<int64_t>(s, 0, n));
    }
    items_.erase(items_.begin() + static_cast<std::ptrdiff_t>(start),
                 items_.begin() + static_cast<std::ptrdiff_t>(start + pos.size()));
    items_.insert(items_.begin() + static_cast<std::ptrdiff_t>(start), values.begin(),
                  values.end());
  }

  std::vector<Value> items_;
  std::string typecode_;  // "": a list; else an Array of this typecode (fixed length)
};

// ---- Namespace and Value ------------------------------------------------------------------

class PyNamespace final : public PyServed {
 public:
  explicit PyNamespace(const pickle::Dict& kwds) {
    for (const auto& it : kwds.items) attrs_[it.key.as<pickle::Str>().utf8] = it.value;
  }
  std::vector<std::string> exposed() const override {
    return {"__getattribute__", "__setattr__", "__delattr__"};
  }
  Value py_call(const std::string& m, std::vector<Value>& a, const pickle::Dict& kw,
                const CallContext&) override {
    const Value& name_value = argument(a, kw, 0, "name");
    if (!name_value.is<pickle::Str>()) raise("TypeError", "attribute name must be string");
    const std::string& name = name_value.as<pickle::Str>().utf8;
    if (m == "__setattr__") {
      attrs_[name] = argument(a, kw, 1, "value");
      return {};
    }
    const auto it = attrs_.find(name);
    if (it == attrs_.end())
      raise("AttributeError", fmt::format("'Namespace' object has no attribute '{}'", name));
    if (m == "__delattr__") {
      attrs_.erase(it);
      return {};
    }
    return it->second;  // __getattribute__
  }
  Value value() const override {
    std::vector<DictItem> state;
    for (const auto& [k, v] : attrs_) state.push_back({Value::str(k), v});
    return Value::object("multiprocessing.managers", "Namespace", {}, Value::dict(std::move(state)),
                         /*new_object=*/true);
  }
  std::string repr() const override {
    std::vector<std::string> parts;
    for (const auto& [k, v] : attrs_) {  // std::map: sorted, as Namespace.__repr__ sorts
      if (!k.empty() && k[0] != '_') parts.push_back(k + "=" + v.repr());
    }
    return fmt::format("Namespace({})", fmt::join(parts, ", "));
  }

 private:
  std::map<std::string, Value> attrs_;
};

class PyValue final : public PyServed {
 public:
  PyValue(Value typecode, Value value) : typecode_(std::move(typecode)), value_(std::move(value)) {}
  std::vector<std::string> exposed() const override { return {"get", "set"}; }
  Value py_call(const std::string& m, std::vector<Value>& a, const pickle::Dict& kw,
                const CallContext&) override {
    if (m == "get") return value_;
    value_ = argument(a, kw, 0, "value");  // set
    return {};
  }
  Value value() const override {
    return Value::object(
        "multiprocessing.managers", "Value", {},
        Value::dict({{Value::str("_typecode"), typecode_}, {Value::str("_value"), value_}}),
        /*new_object=*/true);
  }
  std::string repr() const override {
    return fmt::format("Value({}, {})", typecode_.repr(), value_.repr());
  }

 private:
  Value typecode_;
  Value value_;
};

// ---- Iterator -----------------------------------------------------------------------------

class PyIterator final : public PyServed {
 public:
  PyIterator(std::vector<Value> items, std::shared_ptr<const std::atomic<int64_t>> size)
      : items_(std::move(items)), size_(std::move(size)), initial_(size_ ? size_->load() : 0) {}
  std::vector<std::string> exposed() const override {
    return {"__next__", "send", "throw", "close"};
  }
  Value py_call(const std::string& m, std::vector<Value>&, const pickle::Dict&,
                const CallContext&) override {
    if (m == "close") {
      next_ = items_.size();
      return {};
    }
    if (m == "throw") raise("TypeError", "a served iterator takes no exceptions");
    if (size_ && size_->load() != initial_)  // as a dict iterator checks its dict
      raise("RuntimeError", "dictionary changed size during iteration");
    if (next_ >= items_.size()) throw PyException("builtins", "StopIteration", {}, "StopIteration");
    return std::move(items_[next_++]);  // __next__ and send (a list iterator ignores sent values)
  }
  std::string repr() const override { return "<iterator>"; }

 private:
  std::vector<Value> items_;
  std::shared_ptr<const std::atomic<int64_t>> size_;  // the dict's, or null
  int64_t initial_ = 0;
  size_t next_ = 0;
};

}  // namespace

bool py_equal(const Value& a, const Value& b) {
  if (pickle::is_key_type(a) && pickle::is_key_type(b)) return pickle::key_equal(a, b);
  const auto* x = sequence(a);
  const auto* y = sequence(b);
  if (x != nullptr && y != nullptr) {
    if (a.kind() != b.kind() || x->size() != y->size()) return false;
    for (size_t i = 0; i < x->size(); ++i) {
      if (!py_equal((*x)[i], (*y)[i])) return false;
    }
    return true;
  }
  if (a.is<pickle::Dict>() && b.is<pickle::Dict>()) {
    const auto& p = a.as<pickle::Dict>().items;
    const auto& q = b.as<pickle::Dict>().items;
    if (p.size() != q.size()) return false;
    for (const auto& it : p) {
      const auto match = std::find_if(q.begin(), q.end(),
                                      [&](const DictItem& o) { return py_equal(o.key, it.key); });
      if (match == q.end() || !py_equal(match->value, it.value)) return false;
    }
    return true;
  }
  return a == b;
}

std::unique_ptr<PyServed> make_py_iterator(std::vector<Value> items, const PyServed* source) {
  const auto* dict = dynamic_cast<const PyDict*>(source);
  return std::make_unique<PyIterator>(std::move(items), dict ? dict->size() : nullptr);
}

std::unique_ptr<PyServed> make_py_object(const std::string& type_id, std::vector<Value> args,
                                         const pickle::Dict& kwds) {
  if (type_id == "dict") {
    auto d = std::make_unique<PyDict>();
    std::vector<Value> none;
    d->py_call("update", args, kwds, CallContext{});
    return d;
  }
  if (type_id == "list") {
    return std::make_unique<PyList>(args.empty() ? std::vector<Value>{} : items_of(args[0]), "");
  }
  if (type_id == "Namespace") return std::make_unique<PyNamespace>(kwds);
  if (type_id == "Value") {
    return std::make_unique<PyValue>(argument(args, kwds, 0, "typecode"),
                                     argument(args, kwds, 1, "value"));
  }
  if (type_id == "Array") {
    const Value& code = argument(args, kwds, 0, "typecode");
    if (!code.is<pickle::Str>()) raise("TypeError", "array typecode must be a str");
    const Value& seq = argument(args, kwds, 1, "sequence");
    std::vector<Value> items;
    if (seq.is<int64_t>()) {
      items.assign(static_cast<size_t>(std::max<int64_t>(0, seq.as<int64_t>())), Value(int64_t{0}));
    } else {
      items = items_of(seq);
    }
    return std::make_unique<PyList>(std::move(items), code.as<pickle::Str>().utf8);
  }
  if (auto sync = make_py_sync(type_id, args, kwds)) return sync;
  raise("ValueError", fmt::format("unknown typeid '{}' (this server serves SyncManager's: dict, "
                                  "list, Namespace, Value, Array, Queue, JoinableQueue, Lock, "
                                  "RLock, Semaphore, BoundedSemaphore, Condition, Event, Barrier)",
                                  type_id));
}

}  // namespace torchpar::detail::py
