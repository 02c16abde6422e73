// The pickle decoder (see pickle.h). Two passes: the opcodes run on a stack machine over an
// arena of nodes (containers hold node indices, so a memo entry and the stack share one
// object, as in Python, and an APPENDS after a PUT is seen through GET); at STOP the root
// node becomes a Value tree, checking depth, cycles and the size of the expanded result.
#include <algorithm>
#include <charconv>
#include <cstring>
#include <deque>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "manager/pickle_impl.h"
#include "torchpar/manager/pickle.h"

namespace torchpar::pickle {

namespace {

using namespace impl;  // NOLINT(google-build-using-namespace): the opcode names
using K = Value::Kind;

constexpr uint32_t kNoEntry = UINT32_MAX;

class Decoder {
 public:
  Decoder(std::string_view in, const DecodeOptions& o)
      : in_(in), o_(o), allowed_(o.globals != nullptr ? *o.globals : GlobalAllowList::defaults()) {}

  Value run() {
    while (true) {
      op_pos_ = pos_;
      op_ = -1;
      if (pos_ >= in_.size()) fail("the input ended before STOP");
      op_ = static_cast<uint8_t>(in_[pos_++]);
      if (op_ == kSTOP) break;
      step();
    }
    const uint32_t root = pop();
    return build_tree(a_, root, o_, op_pos_);
  }

 private:
  [[noreturn]] void fail(const std::string& message) const {
    throw PickleError(message, op_, op_pos_);
  }

  // ---- reading the input ----

  std::string_view take(uint64_t n) {
    if (n > in_.size() - pos_)
      fail(fmt::format("truncated: {} bytes needed, {} left", n, in_.size() - pos_));
    std::string_view v = in_.substr(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return v;
  }
  uint64_t read_le(size_t n) {
    std::string_view b = take(n);
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v |= uint64_t{static_cast<uint8_t>(b[i])} << (8 * i);
    return v;
  }
  /// A length argument: checked against the input left and max_bytes before anything is
  /// allocated.
  std::string_view take_counted(uint64_t n) {
    if (n > o_.max_bytes)
      fail(fmt::format("a length of {} is over max_bytes ({})", n, o_.max_bytes));
    return take(n);
  }
  /// The text up to the next newline (protocol 0's arguments), without it.
  std::string_view line() {
    const size_t nl = in_.find('\n', pos_);
    if (nl == std::string_view::npos) fail("truncated: no newline after the argument");
    std::string_view v = in_.substr(pos_, nl - pos_);
    pos_ = nl + 1;
    return v;
  }
  std::string_view own(std::string s) {
    owned_.push_back(std::move(s));
    return owned_.back();
  }

  // ---- the arena and the stack ----

  void charge(size_t n) {
    arena_size_ += n;
    if (arena_size_ > 2 * o_.max_elements)
      fail(fmt::format("more than max_elements ({}) values", o_.max_elements));
  }
  uint32_t node(K kind) {
    charge(1);
    Node n;
    n.kind = kind;
    a_.nodes.push_back(n);
    return static_cast<uint32_t>(a_.nodes.size() - 1);
  }
  uint32_t container(K kind, std::vector<uint32_t> kids) {
    charge(kids.size());
    const uint32_t id = node(kind);
    a_.nodes[id].u.kids = static_cast<uint32_t>(a_.kids.size());
    a_.kids.push_back(std::move(kids));
    return id;
  }
  uint32_t text(K kind, std::string_view s) {
    const uint32_t id = node(kind);
    a_.nodes[id].s = s;
    return id;
  }
  void push(uint32_t id) {
    if (stack_.size() >= o_.max_elements)
      fail(fmt::format("more than max_elements ({}) values on the stack", o_.max_elements));
    stack_.push_back(id);
  }
  size_t base() const { return marks_.empty() ? 0 : marks_.back(); }
  void need(size_t n) const {
    if (stack_.size() - base() < n)
      fail(marks_.empty() || stack_.size() >= n
               ? fmt::format("stack underflow: {} values needed{}", n,
                             marks_.empty() ? "" : " above the MARK")
               : fmt::format("stack underflow: {} values needed", n));
  }
  uint32_t pop() {
    need(1);
    const uint32_t id = stack_.back();
    stack_.pop_back();
    return id;
  }
  uint32_t top() {
    need(1);
    return stack_.back();
  }
  std::vector<uint32_t> pop_mark() {
    if (marks_.empty()) fail("no MARK to pop to");
    const size_t at = marks_.back();
    marks_.pop_back();
    std::vector<uint32_t> items(stack_.begin() + static_cast<std::ptrdiff_t>(at), stack_.end());
    stack_.resize(at);
    return items;
  }
  std::vector<uint32_t>& kids_of(uint32_t id, K kind, const char* what) {
    if (a_.nodes[id].kind != kind)
      fail(fmt::format("{} needs a {} below, not a {}", what, kind_name(kind),
                       kind_name(a_.nodes[id].kind)));
    return a_.kids[a_.nodes[id].u.kids];
  }
  static const char* kind_name(K k) {
    static const char* const names[] = {"None", "bool",  "int",       "int",    "float",
                                        "str",  "bytes", "bytearray", "tuple",  "list",
                                        "dict", "set",   "frozenset", "global", "object"};
    return names[static_cast<size_t>(k)];
  }
  void extend(std::vector<uint32_t>& into, const std::vector<uint32_t>& items) {
    charge(items.size());
    into.insert(into.end(), items.begin(), items.end());
  }

  // ---- memo ----

  void put(uint64_t index) {
    if (index >= o_.max_memo)
      fail(fmt::format("memo index {} is over max_memo ({})", index, o_.max_memo));
    const uint32_t id = top();
    if (index >= memo_.size()) memo_.resize(static_cast<size_t>(index) + 1, kNoEntry);
    if (memo_[index] == kNoEntry) ++memo_count_;
    memo_[index] = id;
  }
  void get(uint64_t index) {
    if (index >= memo_.size() || memo_[index] == kNoEntry)
      fail(fmt::format("memo index {} was never stored", index));
    push(memo_[index]);
  }
  uint64_t decimal_line() {
    std::string_view t = line();
    uint64_t v = 0;
    auto r = std::from_chars(t.data(), t.data() + t.size(), v);
    if (r.ec != std::errc() || r.ptr != t.data() + t.size() || t.empty())
      fail(fmt::format("'{}' is not a memo index", printable(t)));
    return v;
  }

  // ---- globals ----

  uint32_t global(std::string_view module, std::string_view name) {
    if (proto_ < 3) {  // Python 2 names, as pickle.py's fix_imports maps them
      if (module == "__builtin__" || module == "exceptions")
        module = "builtins";
      else if (module == "copy_reg")
        module = "copyreg";
      else if (module == "Queue")
        module = "queue";
    }
    if (!allowed_.contains(module, name))
      fail(fmt::format("global {}.{} is not allowed", printable(module), printable(name)));
    const uint32_t id = node(K::kGlobal);
    a_.nodes[id].u.kids = static_cast<uint32_t>(a_.globals.size());
    a_.globals.emplace_back(module, name);
    return id;
  }

  /// REDUCE / NEWOBJ: builtins.set(...) and protocol 2's bytes and bytearray become data;
  /// anything else an object node.
  uint32_t call(uint32_t callable, uint32_t args, bool new_object) {
    const char* what = new_object ? "NEWOBJ" : "REDUCE";
    if (a_.nodes[callable].kind != K::kGlobal)
      fail(fmt::format("{} needs a global, not a {}", what, kind_name(a_.nodes[callable].kind)));
    const std::vector<uint32_t> a = kids_of(args, K::kTuple, what);
    if (!new_object) {
      const auto [module, name] = a_.globals[a_.nodes[callable].u.kids];
      const auto kind_at = [&](size_t i) { return a_.nodes[a[i]].kind; };
      if (module == "builtins" && (name == "set" || name == "frozenset")) {
        const K kind = name == "set" ? K::kSet : K::kFrozenSet;
        if (a.empty()) return container(kind, {});
        if (a.size() == 1 && (kind_at(0) == K::kList || kind_at(0) == K::kTuple ||
                              kind_at(0) == K::kSet || kind_at(0) == K::kFrozenSet))
          return container(kind, a_.kids[a_.nodes[a[0]].u.kids]);
      } else if (module == "builtins" && (name == "bytes" || name == "bytearray")) {
        const K kind = name == "bytes" ? K::kBytes : K::kByteArray;
        if (a.empty()) return text(kind, {});
        if (a.size() == 1 && (kind_at(0) == K::kBytes || kind_at(0) == K::kByteArray))
          return text(kind, a_.nodes[a[0]].s);
      } else if (module == "_codecs" && name == "encode" && a.size() == 2 &&
                 kind_at(0) == K::kStr && kind_at(1) == K::kStr &&
                 (a_.nodes[a[1]].s == "latin1" || a_.nodes[a[1]].s == "latin-1")) {
        return text(K::kBytes, latin1_of(a_.nodes[a[0]].s));
      }
    }
    const uint32_t id = container(K::kObject, {callable, args});
    a_.nodes[id].new_object = new_object;
    return id;
  }

  std::string_view latin1_of(std::string_view utf8) {
    std::optional<std::string> out = latin1_of_utf8(utf8);
    if (!out) fail("_codecs.encode(..., 'latin1') of a character past U+00FF");
    return own(std::move(*out));
  }
  /// STRING's argument, read as ASCII (Python 3's default encoding for protocol 0-2 strs).
  std::string_view string_literal(std::string_view t) {
    std::string error;
    std::optional<std::string> out = python2_string_literal(t, &error);
    if (!out) fail(error);
    return ascii_str(own(std::move(*out)));
  }
  std::string_view ascii_str(std::string_view s) {
    for (char ch : s)
      if (static_cast<uint8_t>(ch) >= 0x80) fail("a protocol 0-2 str that is not ASCII");
    return s;
  }
  std::string_view raw_unicode(std::string_view t) {
    std::optional<std::string> out = raw_unicode_escape(t);
    if (!out) fail("a malformed \\u escape in UNICODE");
    return own(std::move(*out));
  }
  uint32_t integer(std::string_view text_value) {
    Value v;
    if (!integer_from_decimal(text_value, &v))
      fail(fmt::format("'{}' is not an integer", printable(text_value)));
    return integer_node(v);
  }
  uint32_t integer_le(std::string_view bytes) {
    return integer_node(integer_from_le(std::string(bytes)));
  }
  uint32_t integer_node(const Value& v) {
    if (const auto* i = std::get_if<int64_t>(&v.data())) {
      const uint32_t id = node(K::kInt);
      a_.nodes[id].u.i = *i;
      return id;
    }
    const std::string& b = std::get<BigInt>(v.data()).bytes;
    return text(K::kBigInt, own(b));
  }
  uint32_t int_node(int64_t v) {
    const uint32_t id = node(K::kInt);
    a_.nodes[id].u.i = v;
    return id;
  }
  uint32_t str_node(std::string_view s) {
    if (!valid_utf8(s)) fail("a str that is not valid UTF-8");
    return text(K::kStr, s);
  }

  // ---- one opcode ----

  void step() {
    if (!step_stack() && !step_number() && !step_string() && !step_container() && !step_object())
      refuse();
  }

  /// MARK, POP, DUP, the memo, PROTO and FRAME. False if op_ is none of them.
  bool step_stack() {
    switch (op_) {
      case kPROTO: {
        const auto p = static_cast<int>(read_le(1));
        if (p > 5) fail(fmt::format("unsupported pickle protocol {}", p));
        proto_ = p;
        break;
      }
      case kFRAME: {
        const uint64_t n = read_le(8);
        if (n > in_.size() - pos_) fail(fmt::format("a frame of {} bytes past the input", n));
        break;
      }
      case kMARK:
        if (marks_.size() >= o_.max_depth + 16)
          fail(fmt::format("more than {} open MARKs (max_depth)", o_.max_depth + 16));
        marks_.push_back(stack_.size());
        break;
      case kPOP:
        if (stack_.size() > base()) {
          stack_.pop_back();
        } else {
          pop_mark();
        }
        break;
      case kPOP_MARK:
        pop_mark();
        break;
      case kDUP:
        push(top());
        break;
      case kMEMOIZE:
        put(memo_count_);
        break;
      case kPUT:
        put(decimal_line());
        break;
      case kBINPUT:
        put(read_le(1));
        break;
      case kLONG_BINPUT:
        put(read_le(4));
        break;
      case kGET:
        get(decimal_line());
        break;
      case kBINGET:
        get(read_le(1));
        break;
      case kLONG_BINGET:
        get(read_le(4));
        break;
      default:
        return false;
    }
    return true;
  }

  /// None, bools, ints and floats. False if op_ is none of them.
  bool step_number() {
    switch (op_) {
      case kNONE:
        push(node(K::kNone));
        break;
      case kNEWTRUE:
      case kNEWFALSE: {
        const uint32_t id = node(K::kBool);
        a_.nodes[id].u.i = op_ == kNEWTRUE;
        push(id);
        break;
      }
      case kINT: {
        std::string_view t = line();
        if (t == "00" || t == "01") {
          const uint32_t id = node(K::kBool);
          a_.nodes[id].u.i = t == "01";
          push(id);
        } else {
          push(integer(t));
        }
        break;
      }
      case kLONG: {
        std::string_view t = line();
        if (!t.empty() && t.back() == 'L') t.remove_suffix(1);
        push(integer(t));
        break;
      }
      case kBININT:
        push(int_node(static_cast<int32_t>(static_cast<uint32_t>(read_le(4)))));
        break;
      case kBININT1:
        push(int_node(static_cast<int64_t>(read_le(1))));
        break;
      case kBININT2:
        push(int_node(static_cast<int64_t>(read_le(2))));
        break;
      case kLONG1:
        push(integer_le(take_counted(read_le(1))));
        break;
      case kLONG4: {
        const auto n = static_cast<int32_t>(static_cast<uint32_t>(read_le(4)));
        if (n < 0) fail("LONG4 with a negative length");
        push(integer_le(take_counted(static_cast<uint64_t>(n))));
        break;
      }
      case kFLOAT: {
        std::string_view t = line();
        double d = 0;
        auto r = std::from_chars(t.data(), t.data() + t.size(), d);
        if (r.ec != std::errc() || r.ptr != t.data() + t.size())
          fail(fmt::format("'{}' is not a float", printable(t)));
        const uint32_t id = node(K::kFloat);
        a_.nodes[id].u.f = d;
        push(id);
        break;
      }
      case kBINFLOAT: {
        std::string_view b = take(8);
        uint64_t bits = 0;
        for (char ch : b) bits = (bits << 8) | static_cast<uint8_t>(ch);
        const uint32_t id = node(K::kFloat);
        std::memcpy(&a_.nodes[id].u.f, &bits, 8);
        push(id);
        break;
      }
      default:
        return false;
    }
    return true;
  }

  /// str, bytes and bytearray. False if op_ is none of them.
  bool step_string() {
    switch (op_) {
      case kSTRING:
        push(text(K::kStr, string_literal(line())));
        break;
      case kBINSTRING: {
        const auto n = static_cast<int32_t>(static_cast<uint32_t>(read_le(4)));
        if (n < 0) fail("BINSTRING with a negative length");
        push(text(K::kStr, ascii_str(take_counted(static_cast<uint64_t>(n)))));
        break;
      }
      case kSHORT_BINSTRING:
        push(text(K::kStr, ascii_str(take_counted(read_le(1)))));
        break;
      case kUNICODE:
        push(text(K::kStr, raw_unicode(line())));
        break;
      case kSHORT_BINUNICODE:
        push(str_node(take_counted(read_le(1))));
        break;
      case kBINUNICODE:
        push(str_node(take_counted(read_le(4))));
        break;
      case kBINUNICODE8:
        push(str_node(take_counted(read_le(8))));
        break;
      case kSHORT_BINBYTES:
        push(text(K::kBytes, take_counted(read_le(1))));
        break;
      case kBINBYTES:
        push(text(K::kBytes, take_counted(read_le(4))));
        break;
      case kBINBYTES8:
        push(text(K::kBytes, take_counted(read_le(8))));
        break;
      case kBYTEARRAY8:
        push(text(K::kByteArray, take_counted(read_le(8))));
        break;
      default:
        return false;
    }
    return true;
  }

  /// tuples, lists, dicts and sets. False if op_ is none of them.
  bool step_container() {
    switch (op_) {
      case kEMPTY_TUPLE:
        push(container(K::kTuple, {}));
        break;
      case kTUPLE1:
      case kTUPLE2:
      case kTUPLE3: {
        const size_t n = static_cast<size_t>(op_ - kTUPLE1 + 1);
        need(n);
        std::vector<uint32_t> items(stack_.end() - static_cast<std::ptrdiff_t>(n), stack_.end());
        stack_.resize(stack_.size() - n);
        push(container(K::kTuple, std::move(items)));
        break;
      }
      case kTUPLE:
        push(container(K::kTuple, pop_mark()));
        break;
      case kEMPTY_LIST:
        push(container(K::kList, {}));
        break;
      case kLIST:
        push(container(K::kList, pop_mark()));
        break;
      case kEMPTY_DICT:
        push(container(K::kDict, {}));
        break;
      case kDICT: {
        std::vector<uint32_t> items = pop_mark();
        if (items.size() % 2 != 0) fail("DICT with an odd number of items");
        push(container(K::kDict, std::move(items)));
        break;
      }
      case kEMPTY_SET:
        push(container(K::kSet, {}));
        break;
      case kFROZENSET:
        push(container(K::kFrozenSet, pop_mark()));
        break;
      case kAPPEND: {
        const uint32_t v = pop();
        extend(kids_of(top(), K::kList, "APPEND"), {v});
        break;
      }
      case kAPPENDS: {
        std::vector<uint32_t> items = pop_mark();
        extend(kids_of(top(), K::kList, "APPENDS"), items);
        break;
      }
      case kSETITEM: {
        const uint32_t v = pop();
        const uint32_t k = pop();
        extend(kids_of(top(), K::kDict, "SETITEM"), {k, v});
        break;
      }
      case kSETITEMS: {
        std::vector<uint32_t> items = pop_mark();
        if (items.size() % 2 != 0) fail("SETITEMS with an odd number of items");
        extend(kids_of(top(), K::kDict, "SETITEMS"), items);
        break;
      }
      case kADDITEMS: {
        std::vector<uint32_t> items = pop_mark();
        extend(kids_of(top(), K::kSet, "ADDITEMS"), items);
        break;
      }
      default:
        return false;
    }
    return true;
  }

  /// globals and the calls on them. False if op_ is none of them.
  bool step_object() {
    switch (op_) {
      case kGLOBAL: {
        std::string_view module = line();
        std::string_view name = line();
        push(global(module, name));
        break;
      }
      case kSTACK_GLOBAL: {
        const uint32_t name = pop();
        const uint32_t module = pop();
        if (a_.nodes[module].kind != K::kStr || a_.nodes[name].kind != K::kStr)
          fail("STACK_GLOBAL needs two strs");
        push(global(a_.nodes[module].s, a_.nodes[name].s));
        break;
      }
      case kREDUCE:
      case kNEWOBJ: {
        const uint32_t args = pop();
        const uint32_t callable = pop();
        push(call(callable, args, op_ == kNEWOBJ));
        break;
      }
      case kBUILD: {
        const uint32_t state = pop();
        const uint32_t target = top();
        std::vector<uint32_t>& kids = kids_of(target, K::kObject, "BUILD");
        if (kids.size() != 2) fail("BUILD on an object that already has a state");
        extend(kids, {state});
        break;
      }
      default:
        return false;
    }
    return true;
  }

  [[noreturn]] void refuse() {
    switch (op_) {
      case kPERSID:
      case kBINPERSID:
        fail("persistent ids are not supported");
      case kEXT1:
      case kEXT2:
      case kEXT4:
        fail("copyreg's extension registry is not supported");
      case kINST:
      case kOBJ:
        fail("protocol 0/1 instances are not supported");
      case kNEWOBJ_EX:
        fail("NEWOBJ_EX (keyword arguments to __new__) is not supported");
      case kNEXT_BUFFER:
      case kREADONLY_BUFFER:
        fail("out-of-band buffers are not supported");
      default:
        fail("unknown opcode");
    }
  }

  std::string_view in_;
  size_t pos_ = 0;
  size_t op_pos_ = 0;
  int op_ = -1;
  const DecodeOptions& o_;
  const GlobalAllowList& allowed_;
  int proto_ = 0;

  Arena a_;
  std::deque<std::string> owned_;
  std::vector<uint32_t> stack_;
  std::vector<size_t> marks_;
  std::vector<uint32_t> memo_;
  size_t memo_count_ = 0;
  size_t arena_size_ = 0;
};

}  // namespace

Value decode(std::string_view bytes, const DecodeOptions& options) {
  return Decoder(bytes, options).run();
}

}  // namespace torchpar::pickle
