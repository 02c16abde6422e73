#pragma once
// Python's pickle format, for the values Python's multiprocessing.managers protocol carries
// (requests `(ident, methodname, args, kwds)`, answers `('#RETURN' | '#ERROR' | ..., value)`,
// Token, RemoteError, builtin exceptions). A foreign server cannot run Python code, so a
// pickle decodes into a value model (Value) and never into objects: a class named by GLOBAL
// or STACK_GLOBAL must be on an allow-list and stays a name, a REDUCE / NEWOBJ / BUILD on it
// an Object that keeps the class, its arguments and its state, and encodes back to the same
// opcodes. No LibTorch. Public for the C++ side of objects shared with Python clients
// (torchpar/manager/python.h: PythonProxy, PythonDictProxy), whose items are these values.
//
// Read:    protocols 0 to 5. Every opcode of protocols 2-5 that builds data, plus the text
//          opcodes of protocols 0/1 (INT, LONG, FLOAT, STRING, UNICODE, GET, PUT, LIST, DICT,
//          TUPLE, APPEND, SETITEM, POP, POP_MARK, DUP). Refused, with a PickleError naming the
//          opcode: PERSID / BINPERSID (persistent ids), EXT1/2/4 (copyreg's extension
//          registry), INST / OBJ (protocol 0/1 instances), NEWOBJ_EX, NEXT_BUFFER and
//          READONLY_BUFFER (out-of-band buffers), and any unknown opcode.
// Written: protocols 2 to 5 (4 by default, CPython 3.8-3.13's default; 3.14 sends 5), in
//          one FRAME from protocol 4 on, without memo (nothing is shared or recursive).
//
// Source:  CPython 3.11 Lib/pickle.py, Lib/pickletools.py (the opcodes),
//          Lib/multiprocessing/managers.py (Token, RemoteError, the proxies).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_set>
#include <variant>
#include <vector>

#include "torchpar/core/error.h"

namespace torchpar::pickle {

/// A pickle that cannot be decoded (truncated, malformed, hostile, a global outside the
/// allow-list, over a limit) or a value that cannot be encoded. `what()` names the problem
/// and, for decoding, the opcode and its byte offset. Nothing is leaked; the input is not
/// changed. (Python: pickle.UnpicklingError / PicklingError.)
class PickleError : public torchpar::ValueError {
 public:
  /// An encoding error, or a decoding error not tied to an opcode.
  explicit PickleError(const std::string& message);
  /// A decoding error at opcode `opcode` (its byte, -1 for the end of the input) at byte
  /// `offset` of the input.
  PickleError(const std::string& message, int opcode, size_t offset);
  /// The offset of the opcode, or SIZE_MAX when not tied to one.
  size_t offset() const noexcept { return offset_; }

 private:
  size_t offset_ = SIZE_MAX;
};

/// A value used as a dict key or set element whose type the key helpers do not support
/// (list, dict, set, frozenset, bytearray, a global or an object): Python would call its
/// __hash__ / __eq__, which a foreign server cannot. `type_name()` is its Python type name
/// ("list", "KeyError"). For list, dict, set and bytearray Python itself raises
/// TypeError("unhashable type: 'list'").
class UnsupportedKeyError : public torchpar::ValueError {
 public:
  explicit UnsupportedKeyError(std::string type_name);
  const std::string& type_name() const noexcept { return type_name_; }

 private:
  std::string type_name_;
};

class Value;
struct DictItem;

/// Python's None.
struct None {};
/// An int outside int64: its two's-complement little-endian bytes, as few as carry the sign
/// (LONG1 / LONG4's form). A BigInt never holds a value that fits int64 (Value's factories
/// and the decoder normalize), so equal ints always have the same representation.
struct BigInt {
  std::string bytes;
};
/// A str, as UTF-8 (lone surrogates kept as their 3-byte forms, as Python's
/// 'surrogatepass' writes them).
struct Str {
  std::string utf8;
};
struct Bytes {
  std::string data;
};
struct ByteArray {
  std::string data;
};
struct Tuple {
  std::vector<Value> items;
};
struct List {
  std::vector<Value> items;
};
/// A dict; items in insertion order, keys unique under key_equal (when they are key types).
struct Dict {
  std::vector<DictItem> items;
};
/// A set / frozenset; elements in the order the pickle gave them, unique under key_equal
/// (when they are key types).
struct Set {
  std::vector<Value> items;
};
struct FrozenSet {
  std::vector<Value> items;
};
/// A module-level name: a class or function (GLOBAL / STACK_GLOBAL), e.g.
/// {"builtins", "KeyError"}, {"multiprocessing.managers", "Token"}.
struct Global {
  std::string module;
  std::string name;
};
/// An object Python builds by calling a global: `type(*args)` (REDUCE), or
/// `type.__new__(type, *args)` (NEWOBJ, `new_object`), then `__setstate__(state)` or a
/// `__dict__` update (BUILD, when `state` is set). KeyError('k') is {builtins.KeyError,
/// ('k',)}; a Token is {multiprocessing.managers.Token, (), new_object, state (typeid,
/// address, id)}.
struct Object {
  Global type;
  std::vector<Value> args;
  bool new_object = false;
  std::shared_ptr<const Value> state;  // null: no BUILD
};

/// One pickled value. A value type (copies are deep, except Object::state, which is
/// immutable and shared); compare with == (same kinds, same contents, floats bit for bit)
/// or, for Python's key semantics, key_equal.
/// Safety: as std::vector: concurrent reads are safe, writes need exclusive access.
class Value {
 public:
  /// The alternatives, in Kind's order.
  using Data = std::variant<None, bool, int64_t, BigInt, double, Str, Bytes, ByteArray, Tuple, List,
                            Dict, Set, FrozenSet, Global, Object>;
  enum class Kind : uint8_t {
    kNone,
    kBool,
    kInt,
    kBigInt,
    kFloat,
    kStr,
    kBytes,
    kByteArray,
    kTuple,
    kList,
    kDict,
    kSet,
    kFrozenSet,
    kGlobal,
    kObject
  };

  Value() = default;           // None
  Value(None) {}               // NOLINT(google-explicit-constructor): values convert as in Python
  Value(bool b) : data_(b) {}  // NOLINT(google-explicit-constructor)
  Value(int i) : data_(int64_t{i}) {}  // NOLINT(google-explicit-constructor)
  Value(int64_t i) : data_(i) {}       // NOLINT(google-explicit-constructor)
  Value(double d) : data_(d) {}        // NOLINT(google-explicit-constructor)
  /// Requires: `b` normalized and outside int64 (Value::integer makes one from any bytes).
  explicit Value(BigInt b) : data_(std::move(b)) {}
  Value(Str s) : data_(std::move(s)) {}        // NOLINT(google-explicit-constructor)
  Value(Bytes b) : data_(std::move(b)) {}      // NOLINT(google-explicit-constructor)
  Value(ByteArray b) : data_(std::move(b)) {}  // NOLINT(google-explicit-constructor)
  Value(Tuple t) : data_(std::move(t)) {}      // NOLINT(google-explicit-constructor)
  Value(List l) : data_(std::move(l)) {}       // NOLINT(google-explicit-constructor)
  Value(Dict d);                               // NOLINT(google-explicit-constructor)
  Value(Set s) : data_(std::move(s)) {}        // NOLINT(google-explicit-constructor)
  Value(FrozenSet s) : data_(std::move(s)) {}  // NOLINT(google-explicit-constructor)
  Value(Global g) : data_(std::move(g)) {}     // NOLINT(google-explicit-constructor)
  Value(Object o) : data_(std::move(o)) {}     // NOLINT(google-explicit-constructor)
  Value(const char*) = delete;                 // say Value::str("...") or Value::bytes("...")
  Value(const Value&);
  Value(Value&&) noexcept;
  Value& operator=(const Value&);
  Value& operator=(Value&&) noexcept;
  ~Value();

  /// Factories. `integer` takes two's-complement little-endian bytes of any length and
  /// gives an int64 value when it fits, else a normalized BigInt; `integer_from_decimal`
  /// takes "[-+]digits" (PickleError otherwise).
  static Value str(std::string utf8) { return Value(Str{std::move(utf8)}); }
  static Value bytes(std::string data) { return Value(Bytes{std::move(data)}); }
  static Value bytearray(std::string data) { return Value(ByteArray{std::move(data)}); }
  static Value integer(std::string_view le_bytes);
  static Value integer_from_decimal(std::string_view digits);
  static Value tuple(std::vector<Value> items) { return Value(Tuple{std::move(items)}); }
  static Value list(std::vector<Value> items) { return Value(List{std::move(items)}); }
  static Value dict(std::vector<DictItem> items);
  static Value set(std::vector<Value> items) { return Value(Set{std::move(items)}); }
  static Value frozenset(std::vector<Value> items) { return Value(FrozenSet{std::move(items)}); }
  static Value global(std::string module, std::string name) {
    return Value(Global{std::move(module), std::move(name)});
  }
  /// `module.name(*args)` (REDUCE) with an optional BUILD state: an exception instance,
  /// RemoteError(text), ...
  static Value object(std::string module, std::string name, std::vector<Value> args,
                      std::optional<Value> state = std::nullopt, bool new_object = false);

  Kind kind() const noexcept { return static_cast<Kind>(data_.index()); }
  const Data& data() const noexcept { return data_; }
  Data& data() noexcept { return data_; }
  template <class T>
  bool is() const noexcept {
    return std::holds_alternative<T>(data_);
  }
  /// The alternative T; torchpar::ValueError naming both types when it holds another.
  template <class T>
  const T& as() const {
    if (const T* p = std::get_if<T>(&data_)) return *p;
    throw_wrong_kind(index_of<T>());
  }
  template <class T>
  T& as() {
    if (T* p = std::get_if<T>(&data_)) return *p;
    throw_wrong_kind(index_of<T>());
  }

  /// Python's type name: "NoneType", "int" (int64 and BigInt), "str", "tuple", "type" for
  /// a Global, the class name for an Object ("KeyError", "Token").
  std::string type_name() const;
  /// Python's repr for the builtin types (floats as Python prints them, BigInts in
  /// decimal); an Object as `Name(args...)` plus ` <state repr>` after a BUILD, a Global as
  /// `<class 'module.name'>`.
  std::string repr() const;

  /// Structural equality: the same alternative and equal contents, floats bit for bit, dict
  /// items and set elements in the same order. (1 == 1.0 here is false; see key_equal.)
  friend bool operator==(const Value& a, const Value& b);

 private:
  template <class T, class... Ts>
  static constexpr size_t index_in(std::variant<Ts...>*) {
    size_t i = 0;
    (void)((std::is_same_v<T, Ts> || (++i, false)) || ...);
    return i;
  }
  template <class T>
  static constexpr size_t index_of() {
    return index_in<T>(static_cast<Data*>(nullptr));
  }
  [[noreturn]] void throw_wrong_kind(size_t wanted) const;
  Data data_;
};

struct DictItem {
  Value key;
  Value value;
};

inline Value::Value(const Value&) = default;
inline Value::Value(Value&&) noexcept = default;
inline Value& Value::operator=(const Value&) = default;
inline Value& Value::operator=(Value&&) noexcept = default;
inline Value::~Value() = default;
inline Value::Value(Dict d) : data_(std::move(d)) {}

/// The globals a decoder accepts, as (module, qualified name) pairs.
/// Safety: const methods are thread-safe.
class GlobalAllowList {
 public:
  GlobalAllowList() = default;
  GlobalAllowList(std::initializer_list<std::pair<std::string_view, std::string_view>> names);
  void add(std::string_view module, std::string_view name);
  bool contains(std::string_view module, std::string_view name) const;

  /// What the manager protocol needs: from builtins, set, frozenset, bytes, bytearray,
  /// slice, complex, range and the builtin exception classes (BaseException and its
  /// standard subclasses); _codecs.encode (protocol 2's bytes); _queue.Empty, queue.Full,
  /// threading.BrokenBarrierError; multiprocessing's TimeoutError, AuthenticationError,
  /// ProcessError, BufferTooShort; from multiprocessing.managers Token, RemoteError,
  /// Namespace, Value, RebuildProxy, AutoProxy and the proxy classes (BaseProxy,
  /// DictProxy, ListProxy, ... , IteratorProxy); array's array and _array_reconstructor.
  static const GlobalAllowList& defaults();

 private:
  std::unordered_set<std::string> names_;  // "module name"
};

/// Limits of one decode; over any of them decoding stops with a PickleError naming it.
struct DecodeOptions {
  /// Nesting of containers and objects in the result (the decoder recurses once per
  /// level, ~200 bytes of stack each). Python's own pickler cannot nest deeper than ~1000.
  size_t max_depth = 1000;
  /// Values in the result, counting each reference of a memo entry (GET) as a copy of it,
  /// so that a small pickle cannot expand into a huge tree. The decoder's working memory
  /// is at most ~40 bytes x 2 x max_elements besides the result.
  size_t max_elements = size_t{1} << 22;
  /// Bytes of str / bytes / bytearray / int data in the result (memo copies included).
  size_t max_bytes = size_t{1} << 30;
  /// The largest memo index PUT / MEMOIZE may use (the memo is a vector of 4-byte entries).
  size_t max_memo = size_t{1} << 22;
  /// The globals GLOBAL / STACK_GLOBAL may name; nullptr: GlobalAllowList::defaults(). Not
  /// owned; must outlive the call.
  const GlobalAllowList* globals = nullptr;
};

/// Decodes one pickle from `bytes` (any protocol 0-5; bytes after its STOP are ignored, as
/// Python's pickle.loads ignores them).
///
/// Result:  dicts and sets are deduplicated under key_equal as Python's would be (the first
///          key kept, the last value); those with a key outside the key types are kept as
///          given. builtins.set / frozenset / bytearray / bytes and _codecs.encode calls
///          (protocol 2's forms) become Set, FrozenSet, ByteArray and Bytes; protocol 2's
///          module names (__builtin__, exceptions, copy_reg, Queue) are read as Python 3's.
///          A memo entry referenced twice (Python: one object, shared) is copied.
/// Errors:  PickleError naming the opcode and offset: truncated input, malformed opcode
///          arguments, invalid UTF-8 in a str, stack underflow, MARK mismatches, a memo
///          index never PUT, a global outside the allow-list ("global os.system is not
///          allowed"), a recursive structure (an object containing itself), any limit of
///          `options` exceeded. Never allocates more than the input and the limits imply.
/// Safety:  thread-safe (no shared state).
/// Source:  Python's pickle.loads (pickle.py's _Unpickler.load_* methods).
Value decode(std::string_view bytes, const DecodeOptions& options = {});

/// Encodes `value` as a pickle of `protocol` (2 to 5) that CPython's pickle.loads reads
/// back to an equal value of the same types.
///
/// Errors:  PickleError for a protocol outside 2..5, nesting deeper than 10000, a str over
///          4 GiB below protocol 4.
/// Safety:  thread-safe.
/// Source:  Python's pickle.dumps (pickle.py's _Pickler.save_* methods), without memo.
std::string encode(const Value& value, int protocol = 4);

// ---- Python's key semantics -----------------------------------------------------------------
//
// A foreign server can compare and hash keys only for the types whose __eq__ / __hash__ it
// knows. Supported (the "key types"): None, bool, int (int64 and BigInt), float, str,
// bytes, and tuples of key types. Numbers compare by value across types, exactly as in
// Python (1 == 1.0 == True, 2**100 == 2.0**100, 2**53 + 1 != 2.0**53) and hash alike;
// str and bytes are distinct (b'a' != 'a'); tuples compare elementwise. A NaN key equals
// nothing (as two distinct NaN objects in Python). Every other type (list, dict, set,
// frozenset, bytearray, a global, an object) raises UnsupportedKeyError naming it.

/// True if `v` is a key type (tuples: all their elements, recursively).
bool is_key_type(const Value& v) noexcept;

/// Python's hash for numbers, bool and tuples of them (hash(1) == hash(1.0) == hash(True),
/// hash(2**100) and hash(1.5) equal CPython 3.11's on 64-bit); for None, str and bytes a
/// fixed hash of our own (CPython randomizes its str and bytes hashes per process).
/// Errors: UnsupportedKeyError for a non-key type.
int64_t key_hash(const Value& v);

/// Python's `a == b` for key types. Errors: UnsupportedKeyError if either is not one.
bool key_equal(const Value& a, const Value& b);

/// For std::unordered_map<Value, T, KeyHash, KeyEqual>: Python dict semantics for key types
/// (inserting or looking up any other type throws UnsupportedKeyError).
struct KeyHash {
  size_t operator()(const Value& v) const { return static_cast<size_t>(key_hash(v)); }
};
struct KeyEqual {
  bool operator()(const Value& a, const Value& b) const { return key_equal(a, b); }
};

}  // namespace torchpar::pickle
