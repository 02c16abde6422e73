// The pickle decoder's STOP pass (see pickle_impl.h): the node graph the opcodes built
// becomes a Value tree.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "manager/pickle_impl.h"

namespace torchpar::pickle::impl {

namespace {

using K = Value::Kind;

class TreeBuilder {
 public:
  TreeBuilder(Arena& a, const DecodeOptions& o, size_t stop_offset)
      : a_(a), o_(o), stop_offset_(stop_offset) {}

  void count_bytes(size_t n) {
    out_bytes_ += n;
    if (out_bytes_ > o_.max_bytes)
      fail(fmt::format("the result holds more than max_bytes ({}) bytes", o_.max_bytes));
  }

  std::vector<Value> build_all(const std::vector<uint32_t>& ids, size_t depth) {
    std::vector<Value> out;
    out.reserve(ids.size());
    for (uint32_t id : ids) out.push_back(build(id, depth));
    return out;
  }

  Value build(uint32_t id, size_t depth) {
    if (depth > o_.max_depth) fail(fmt::format("nested deeper than max_depth ({})", o_.max_depth));
    if (++out_elements_ > o_.max_elements)
      fail(fmt::format("the result holds more than max_elements ({}) values", o_.max_elements));
    const Node n = a_.nodes[id];
    switch (n.kind) {
      case K::kNone:
        return Value();
      case K::kBool:
        return Value(n.u.i != 0);
      case K::kInt:
        return Value(n.u.i);
      case K::kFloat:
        return Value(n.u.f);
      case K::kBigInt:
        count_bytes(n.s.size());
        return Value(BigInt{std::string(n.s)});
      case K::kStr:
        count_bytes(n.s.size());
        return Value::str(std::string(n.s));
      case K::kBytes:
        count_bytes(n.s.size());
        return Value::bytes(std::string(n.s));
      case K::kByteArray:
        count_bytes(n.s.size());
        return Value::bytearray(std::string(n.s));
      case K::kGlobal: {
        const auto& [module, name] = a_.globals[n.u.kids];
        return Value::global(std::string(module), std::string(name));
      }
      default:
        break;
    }
    if (n.visiting) fail("a recursive structure (an object containing itself) is not supported");
    a_.nodes[id].visiting = true;
    const std::vector<uint32_t>& kids = a_.kids[n.u.kids];
    Value out;
    switch (n.kind) {
      case K::kTuple:
        out = Value::tuple(build_all(kids, depth + 1));
        break;
      case K::kList:
        out = Value::list(build_all(kids, depth + 1));
        break;
      case K::kSet:
      case K::kFrozenSet: {
        std::vector<Value> items = build_all(kids, depth + 1);
        dedupe_keys(items, nullptr);
        out = n.kind == K::kSet ? Value::set(std::move(items)) : Value::frozenset(std::move(items));
        break;
      }
      case K::kDict: {
        std::vector<Value> keys;
        std::vector<Value> values;
        keys.reserve(kids.size() / 2);
        values.reserve(kids.size() / 2);
        for (size_t i = 0; i + 1 < kids.size(); i += 2) {
          keys.push_back(build(kids[i], depth + 1));
          values.push_back(build(kids[i + 1], depth + 1));
        }
        dedupe_keys(keys, &values);
        std::vector<DictItem> items;
        items.reserve(keys.size());
        for (size_t i = 0; i < keys.size(); ++i)
          items.push_back({std::move(keys[i]), std::move(values[i])});
        out = Value::dict(std::move(items));
        break;
      }
      case K::kObject: {
        const auto& [module, name] = a_.globals[a_.nodes[kids[0]].u.kids];
        Object o;
        o.type = Global{std::string(module), std::string(name)};
        o.args = build_all(a_.kids[a_.nodes[kids[1]].u.kids], depth + 1);
        o.new_object = n.new_object;
        if (kids.size() > 2) o.state = std::make_shared<const Value>(build(kids[2], depth + 1));
        out = Value(std::move(o));
        break;
      }
      default:
        fail("internal: unexpected node");
    }
    a_.nodes[id].visiting = false;
    return out;
  }

 private:
  [[noreturn]] void fail(const std::string& message) const {
    throw PickleError(message, '.', stop_offset_);
  }

  Arena& a_;
  const DecodeOptions& o_;
  size_t stop_offset_;
  size_t out_elements_ = 0;
  size_t out_bytes_ = 0;
};

}  // namespace

Value build_tree(Arena& arena, uint32_t root, const DecodeOptions& options, size_t stop_offset) {
  return TreeBuilder(arena, options, stop_offset).build(root, 0);
}

}  // namespace torchpar::pickle::impl
