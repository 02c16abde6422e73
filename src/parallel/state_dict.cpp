#include "torchpar/parallel/state_dict.h"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/jit/serialization/unpickler.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "core/atomic_file.h"
#include "core/file_mapping.h"
#include "torchpar/core/error.h"
#include "torchpar/core/fd.h"
#include "torchpar/core/syscall.h"
#include "torchpar/shm/handle.h"

namespace torchpar {
namespace {

using detail::FileMapping;

/// PyTorchStreamReader reads the zip directory and the pickle through the mapping too, so the
/// file is opened once and every record comes from the same bytes.
class MappedReader final : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit MappedReader(std::shared_ptr<const FileMapping> m) : m_(std::move(m)) {}
  size_t size() const override { return m_->size(); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= m_->size()) return 0;
    n = std::min<size_t>(n, m_->size() - static_cast<size_t>(pos));
    std::memcpy(buf, m_->data() + pos, n);
    return n;
  }

 private:
  std::shared_ptr<const FileMapping> m_;
};

void release_mapping(void* ctx) { delete static_cast<std::shared_ptr<const FileMapping>*>(ctx); }

/// A storage's bytes aliasing the mapping at `offset`; it keeps the mapping alive.
at::DataPtr alias_mapping(const std::shared_ptr<const FileMapping>& m, size_t offset) {
  return at::DataPtr(m->data() + offset, new std::shared_ptr<const FileMapping>(m),
                     &release_mapping, at::Device(at::kCPU));
}

// ---- the view check ----------------------------------------------------------------------------
// LibTorch's unpickler builds each tensor from the pickle's (storage, offset, sizes, strides)
// without a check (Unpickler::rebuildTensor: set_storage_offset, set_sizes_and_strides), and
// set_sizes_and_strides silently replaces a negative stride by a contiguous one. So the pickle
// is read once more beforehand by the scan below, which follows the stack and memo of the
// opcodes torch.save and LibTorch write, keeps only ints, strings, tuples, globals, storages
// and tensors, and checks each tensor's view as the file states it, naming its key. Anything
// it does not follow ends the scan (the unpickler then judges the file); load_state_dict_file
// checks every tensor built again (view_problem), so no view reaches the caller unchecked.

struct PickleNode;
using PickleValue = std::shared_ptr<const PickleNode>;

struct PickleNode {
  enum class Kind { kOther, kInt, kString, kTuple, kGlobal, kStorage, kTensor };
  Kind kind = Kind::kOther;
  int64_t i = 0;                          // kInt; kStorage: its element count
  std::string s{};                        // kString; kGlobal "module.name"; kTensor: its problem
  std::vector<PickleValue> items{};       // kTuple
  std::optional<at::ScalarType> dtype{};  // kGlobal of a torch.<Type>Storage; kStorage
};

PickleValue make_node(PickleNode n) { return std::make_shared<const PickleNode>(std::move(n)); }

/// The dtype of a storage class global ("torch.FloatStorage"), as the unpickler maps it.
std::optional<at::ScalarType> storage_dtype(const std::string& global) {
#define TORCHPAR_STORAGE_DTYPE(_, name) \
  if (global == "torch." #name "Storage") return c10::k##name;
  AT_FORALL_SCALAR_TYPES_WITH_COMPLEX_AND_QINTS(TORCHPAR_STORAGE_DTYPE)
#undef TORCHPAR_STORAGE_DTYPE
  return std::nullopt;
}

/// What is wrong with a view of `dtype` over `storage_nbytes`, or "" when it fits.
std::string view_problem(at::ScalarType dtype, const std::vector<int64_t>& sizes,
                         const std::vector<int64_t>& strides, int64_t offset,
                         uint64_t storage_nbytes) {
  try {
    detail::check_view_fits(dtype, sizes, strides, offset, storage_nbytes);
  } catch (const SerializationError& e) {
    const std::string what = e.what();
    if (what.find("needs more than") != std::string::npos) return what;  // names them already
    return fmt::format("{} (sizes [{}], strides [{}], storage offset {}, storage of {} bytes)",
                       what, fmt::join(sizes, ", "), fmt::join(strides, ", "), offset,
                       storage_nbytes);
  }
  return {};
}

class ViewScan {
 public:
  ViewScan(std::string path, const char* bytes, size_t size)
      : path_(std::move(path)), p_(bytes), end_(bytes + size) {}

  /// Throws SerializationError (naming the key when there is one) for the first tensor whose
  /// view does not fit its storage; returns when every tensor it followed fits.
  void run() {
    while (step()) {
    }
    if (!unkeyed_problem_.empty())
      throw SerializationError(
          fmt::format("load_state_dict_file: '{}': a tensor (under no string key) has a view "
                      "that does not fit its storage: {}",
                      path_, unkeyed_problem_));
  }

 private:
  using Kind = PickleNode::Kind;

  bool take(size_t n, const char** out) {
    if (static_cast<size_t>(end_ - p_) < n) return false;
    *out = p_;
    p_ += n;
    return true;
  }
  template <class T>
  bool take_le(T* v) {
    const char* b = nullptr;
    if (!take(sizeof(T), &b)) return false;
    std::memcpy(v, b, sizeof(T));  // x86-64 and aarch64 (Linux) are little-endian, as pickles
    return true;
  }
  bool take_line(std::string* out) {
    const void* nl = std::memchr(p_, '\n', static_cast<size_t>(end_ - p_));
    if (nl == nullptr) return false;
    out->assign(p_, static_cast<const char*>(nl));
    p_ = static_cast<const char*>(nl) + 1;
    return true;
  }
  bool push_int(int64_t v) {
    stack_.push_back(make_node({.kind = Kind::kInt, .i = v}));
    return true;
  }
  bool push_other() {
    stack_.push_back(other_);
    return true;
  }
  bool pop(PickleValue* v) {
    if (stack_.empty()) return false;
    *v = std::move(stack_.back());
    stack_.pop_back();
    return true;
  }
  /// The values above the last mark, removed from the stack with the mark.
  bool pop_mark(std::vector<PickleValue>* out) {
    if (marks_.empty() || marks_.back() > stack_.size()) return false;
    const auto start = static_cast<std::ptrdiff_t>(marks_.back());
    marks_.pop_back();
    out->assign(std::make_move_iterator(stack_.begin() + start),
                std::make_move_iterator(stack_.end()));
    stack_.erase(stack_.begin() + start, stack_.end());
    return true;
  }
  bool push_tuple(std::vector<PickleValue> items) {
    stack_.push_back(make_node({.kind = Kind::kTuple, .items = std::move(items)}));
    return true;
  }
  bool tuple_of(size_t n) {
    if (stack_.size() < n) return false;
    std::vector<PickleValue> items(std::make_move_iterator(stack_.end() - n),
                                   std::make_move_iterator(stack_.end()));
    stack_.resize(stack_.size() - n);
    return push_tuple(std::move(items));
  }
  bool put(uint32_t id) {
    if (stack_.empty()) return false;
    memo_[id] = stack_.back();
    return true;
  }
  bool get(uint32_t id) {
    const auto it = memo_.find(id);
    if (it == memo_.end()) return false;
    stack_.push_back(it->second);
    return true;
  }

  /// Dict entries key0, value0, key1, ...: a bad tensor under a string key is reported here.
  void entries(const PickleValue* kv, size_t n) {
    for (size_t k = 0; k + 1 < n; k += 2) {
      const PickleNode& v = *kv[k + 1];
      if (v.kind != Kind::kTensor || v.s.empty()) continue;
      if (kv[k]->kind == Kind::kString)
        throw SerializationError(
            fmt::format("load_state_dict_file: '{}': tensor '{}' has a view that does not fit its "
                        "storage: {}",
                        path_, kv[k]->s, v.s));
    }
  }

  static std::optional<std::vector<int64_t>> ints(const PickleValue& v) {
    if (v->kind != Kind::kTuple) return std::nullopt;
    std::vector<int64_t> out;
    for (const auto& e : v->items) {
      if (e->kind != Kind::kInt) return std::nullopt;
      out.push_back(e->i);
    }
    return out;
  }

  /// _rebuild_tensor_v2(storage, storage_offset, size, stride, ...) as the unpickler reads it.
  PickleValue rebuild(const PickleValue& args) {
    if (args->kind != Kind::kTuple || args->items.size() < 4) return other_;
    const auto& a = args->items;
    const auto sizes = ints(a[2]);
    const auto strides = ints(a[3]);
    if (a[0]->kind != Kind::kStorage || a[1]->kind != Kind::kInt || !sizes || !strides)
      return other_;
    const at::ScalarType dtype = *a[0]->dtype;
    const int64_t numel = a[0]->i;
    std::string problem;
    uint64_t nbytes = 0;
    if (numel < 0 ||
        __builtin_mul_overflow(static_cast<uint64_t>(numel), c10::elementSize(dtype), &nbytes))
      problem = fmt::format("its storage claims {} elements", numel);
    else
      problem = view_problem(dtype, *sizes, *strides, a[1]->i, nbytes);
    if (!problem.empty() && unkeyed_problem_.empty()) unkeyed_problem_ = problem;
    return make_node({.kind = Kind::kTensor, .s = std::move(problem)});
  }

  PickleValue reduce(const PickleValue& callable, const PickleValue& args) {
    if (callable->kind != Kind::kGlobal) return other_;
    const std::string& g = callable->s;
    if (g == "torch._utils._rebuild_tensor_v2" || g == "torch._utils._rebuild_qtensor")
      return rebuild(args);
    // (func, type, func's args, state): a tensor subclass or one with Python attributes.
    if (g == "torch._tensor._rebuild_from_type_v2" && args->kind == Kind::kTuple &&
        args->items.size() >= 3 && args->items[0]->kind == Kind::kGlobal &&
        args->items[0]->s == "torch._utils._rebuild_tensor_v2")
      return rebuild(args->items[2]);
    return other_;
  }

  /// One opcode; false at STOP or where the scan stops following. The opcodes come in
  /// four families, each read by its own part (nullopt: not one of its opcodes).
  bool step() {
    const char* op = nullptr;
    if (!take(1, &op)) return false;
    const auto c = static_cast<unsigned char>(*op);
    if (auto r = value_op(c)) return *r;
    if (auto r = container_op(c)) return *r;
    if (auto r = memo_op(c)) return *r;
    if (auto r = object_op(c)) return *r;
    return false;  // an opcode LibTorch's unpickler does not read either
  }

  /// Framing, stack marks and scalar values.
  std::optional<bool> value_op(unsigned char op) {
    switch (op) {
      case 0x80: {  // PROTO
        const char* v = nullptr;
        return take(1, &v);
      }
      case '.':  // STOP
        return false;
      case '(':  // MARK
        marks_.push_back(stack_.size());
        return true;
      case '0': {  // POP
        PickleValue v;
        return pop(&v);
      }
      case '1': {  // POP_MARK
        std::vector<PickleValue> v;
        return pop_mark(&v);
      }
      case 'K': {  // BININT1
        uint8_t v = 0;
        return take_le(&v) && push_int(v);
      }
      case 'M': {  // BININT2
        uint16_t v = 0;
        return take_le(&v) && push_int(v);
      }
      case 'J': {  // BININT
        int32_t v = 0;
        return take_le(&v) && push_int(v);
      }
      case 0x8a: {  // LONG1: n bytes, little-endian two's complement
        uint8_t n = 0;
        const char* b = nullptr;
        if (!take_le(&n) || n == 0 || n > 8 || !take(n, &b)) return false;
        uint64_t u = 0;
        for (int k = n - 1; k >= 0; --k) u = (u << 8) | static_cast<unsigned char>(b[k]);
        if (n < 8 && (static_cast<unsigned char>(b[n - 1]) & 0x80)) u |= ~uint64_t{0} << (8 * n);
        return push_int(static_cast<int64_t>(u));
      }
      case 'X': {  // BINUNICODE
        uint32_t n = 0;
        const char* b = nullptr;
        if (!take_le(&n) || !take(n, &b)) return false;
        stack_.push_back(make_node({.kind = Kind::kString, .s = std::string(b, n)}));
        return true;
      }
      case 'G': {  // BINFLOAT
        const char* b = nullptr;
        return take(8, &b) && push_other();
      }
      case 'N':   // NONE
      case 0x88:  // NEWTRUE
      case 0x89:  // NEWFALSE
        return push_other();
      default:
        return std::nullopt;
    }
  }

  /// Tuples, lists and dicts (a dict's entries feed the key scan: entries()).
  std::optional<bool> container_op(unsigned char op) {
    switch (op) {
      case '}':  // EMPTY_DICT
      case ']':  // EMPTY_LIST
        return push_other();
      case ')':  // EMPTY_TUPLE
        return push_tuple({});
      case 't': {  // TUPLE
        std::vector<PickleValue> v;
        return pop_mark(&v) && push_tuple(std::move(v));
      }
      case 0x85:  // TUPLE1
        return tuple_of(1);
      case 0x86:  // TUPLE2
        return tuple_of(2);
      case 0x87:  // TUPLE3
        return tuple_of(3);
      case 'l':    // LIST
      case 'd': {  // DICT
        std::vector<PickleValue> v;
        if (!pop_mark(&v)) return false;
        if (op == 'd') entries(v.data(), v.size());
        return push_other();
      }
      case 'e':    // APPENDS
      case 'u': {  // SETITEMS
        std::vector<PickleValue> v;
        if (!pop_mark(&v) || stack_.empty()) return false;
        if (op == 'u') entries(v.data(), v.size());
        return true;
      }
      case 'a': {  // APPEND
        PickleValue v;
        return pop(&v) && !stack_.empty();
      }
      case 's': {  // SETITEM
        if (stack_.size() < 3) return false;
        entries(&stack_[stack_.size() - 2], 2);
        stack_.resize(stack_.size() - 2);
        return true;
      }
      default:
        return std::nullopt;
    }
  }

  /// The memo: values stored and fetched again by id.
  std::optional<bool> memo_op(unsigned char op) {
    switch (op) {
      case 'q': {  // BINPUT
        uint8_t id = 0;
        return take_le(&id) && put(id);
      }
      case 'r': {  // LONG_BINPUT
        uint32_t id = 0;
        return take_le(&id) && put(id);
      }
      case 'h': {  // BINGET
        uint8_t id = 0;
        return take_le(&id) && get(id);
      }
      case 'j': {  // LONG_BINGET
        uint32_t id = 0;
        return take_le(&id) && get(id);
      }
      default:
        return std::nullopt;
    }
  }

  /// Globals, object construction (where tensors are rebuilt: reduce()) and storages.
  std::optional<bool> object_op(unsigned char op) {
    switch (op) {
      case 'c': {  // GLOBAL: "module\\nname\\n"
        std::string module, name;
        if (!take_line(&module) || !take_line(&name)) return false;
        std::string g = module + "." + name;
        auto dtype = storage_dtype(g);
        stack_.push_back(make_node({.kind = Kind::kGlobal, .s = std::move(g), .dtype = dtype}));
        return true;
      }
      case 0x81: {  // NEWOBJ: the unpickler drops the argument tuple and keeps the class
        PickleValue v;
        return pop(&v);
      }
      case 'R':    // REDUCE
      case 'b': {  // BUILD (the unpickler treats both alike)
        PickleValue args, callable;
        if (!pop(&args) || !pop(&callable)) return false;
        stack_.push_back(reduce(callable, args));
        return true;
      }
      case 'Q': {  // BINPERSID: ("storage", torch.<Type>Storage, key, device, numel)
        PickleValue id;
        if (!pop(&id)) return false;
        const auto& a = id->items;
        if (id->kind == Kind::kTuple && a.size() >= 5 && a[1]->kind == Kind::kGlobal &&
            a[1]->dtype && a[4]->kind == Kind::kInt) {
          stack_.push_back(make_node({.kind = Kind::kStorage, .i = a[4]->i, .dtype = a[1]->dtype}));
          return true;
        }
        return push_other();
      }
      default:
        return std::nullopt;
    }
  }

  std::string path_;
  const char* p_;
  const char* end_;
  std::vector<PickleValue> stack_;
  std::vector<size_t> marks_;
  std::map<uint32_t, PickleValue> memo_;
  std::string unkeyed_problem_;
  const PickleValue other_ = make_node({});
};

/// The unpickled root, and the bytes each storage record read into memory has (mmap false).
struct Unpickled {
  c10::IValue root;
  std::map<const void*, size_t> record_bytes;
};

Unpickled unpickle(const std::string& path, const std::shared_ptr<const FileMapping>& m,
                   bool mmap) {
  caffe2::serialize::PyTorchStreamReader reader(std::make_shared<MappedReader>(m));
  at::DataPtr pickle;
  size_t pickle_size = 0;
  std::tie(pickle, pickle_size) = reader.getRecord("data.pkl");
  const char* bytes = static_cast<const char*>(pickle.get());
  ViewScan(path, bytes, pickle_size).run();
  Unpickled out;
  size_t pos = 0;
  auto read = [&](char* buf, size_t n) -> size_t {
    n = std::min(n, pickle_size - pos);
    std::memcpy(buf, bytes + pos, n);
    pos += n;
    return n;
  };
  auto read_record = [&](const std::string& key) -> at::DataPtr {
    const std::string name = "data/" + key;
    if (!mmap) {
      auto [data, n] = reader.getRecord(name);
      out.record_bytes[data.get()] = n;
      return std::move(data);
    }
    const size_t offset = reader.getRecordOffset(name);
    if (offset > m->size())
      throw SerializationError(fmt::format(
          "load_state_dict_file: '{}': record {} starts past the end of the file", path, name));
    return alias_mapping(m, offset);
  };
  torch::jit::Unpickler unpickler(read, /*type_resolver=*/nullptr, /*obj_loader=*/nullptr,
                                  read_record, c10::optional<at::Device>(at::kCPU));
  unpickler.set_version(reader.version());
  out.root = unpickler.parse_ivalue();
  return out;
}

/// `t` as save_state_dict_file stores it: detached, on the CPU, contiguous and alone in its
/// storage (the pickler writes a tensor's whole storage).
at::Tensor storable(const std::string& path, const std::string& name, const at::Tensor& t) {
  if (!t.defined() || t.layout() != at::kStrided)
    throw ValueError(fmt::format(
        "save_state_dict_file: '{}': entry '{}' is {}; only defined, strided (dense) tensors are "
        "saved",
        path, name,
        t.defined() ? fmt::format("a {} tensor", c10::toString(t.layout()))
                    : std::string("an undefined tensor")));
  at::Tensor own = t.detach().cpu();
  const bool alone =
      own.is_contiguous() && own.storage_offset() == 0 && own.storage().nbytes() == own.nbytes();
  return alone ? own : own.clone(at::MemoryFormat::Contiguous);
}

/// The bytes torch.save writes for a dict of str -> tensor: a zip ("archive/data.pkl",
/// "archive/data/<i>" per storage, "archive/version").
std::vector<char> torch_save_bytes(const std::string& path, const StateDict& state_dict) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& [name, t] : state_dict) dict.insert(name, storable(path, name, t));
  std::vector<char> pickle;
  torch::jit::Pickler pickler(
      [&](const char* p, size_t n) { pickle.insert(pickle.end(), p, p + n); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(c10::IValue(dict));
  pickler.stop();
  std::vector<char> zip;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* p, size_t n) {
    const char* bytes = static_cast<const char*>(p);
    zip.insert(zip.end(), bytes, bytes + n);
    return n;
  });
  torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(), pickler.tensorData(),
                                     writer);
  writer.writeEndOfFile();
  return zip;
}

}  // namespace

StateDict load_state_dict_file(const std::string& path, const LoadStateDictOptions& options) {
  const auto m = FileMapping::map(path, "load_state_dict_file");
  Unpickled u;
  try {
    u = unpickle(path, m, options.mmap);
  } catch (const Error&) {
    throw;
  } catch (const c10::Error& e) {
    throw SerializationError(fmt::format(
        "load_state_dict_file: '{}' is not a torch.save archive of a plain dict of tensors that "
        "LibTorch's unpickler reads (save dict(model.state_dict()), not the OrderedDict; a dict "
        "of 1, 1001, 2001, ... entries needs one more, as Python writes its last entry with "
        "SETITEM, unknown to LibTorch 1.13): {}",
        path, e.what_without_backtrace()));
  }
  const c10::IValue& root = u.root;
  if (!root.isGenericDict())
    throw SerializationError(fmt::format(
        "load_state_dict_file: '{}' holds a {}, not a dict of tensors", path, root.tagKind()));
  StateDict out;
  for (const auto& item : root.toGenericDict()) {
    if (!item.key().isString() || !item.value().isTensor())
      throw SerializationError(fmt::format(
          "load_state_dict_file: '{}' holds a {} -> {} entry; only string -> tensor entries are "
          "read",
          path, item.key().tagKind(), item.value().tagKind()));
    at::Tensor t = item.value().toTensor();
    const std::string& key = item.key().toStringRef();
    if (!options.mmap && t.storage().nbytes() > 0) {
      const auto it = u.record_bytes.find(t.storage().data());
      if (it == u.record_bytes.end() || t.storage().nbytes() > it->second)
        throw SerializationError(fmt::format(
            "load_state_dict_file: '{}': tensor '{}' claims a storage of {} bytes, more than its "
            "record holds",
            path, key, t.storage().nbytes()));
    }
    if (options.mmap && t.storage().nbytes() > 0) {
      // The unpickler sized each storage from the pickle, not from the record: check that it
      // lies inside the file before anything reads it.
      const char* p = static_cast<const char*>(t.storage().data_ptr().get());
      const bool inside = p >= m->data() && p <= m->data() + m->size() &&
                          t.storage().nbytes() <= static_cast<size_t>(m->data() + m->size() - p);
      if (!inside)
        throw SerializationError(
            fmt::format("load_state_dict_file: '{}': tensor '{}' ({} bytes) lies outside the file",
                        path, key, t.storage().nbytes()));
    }
    // Again on what was built (the scan may have stopped early; this cannot see a negative
    // stride, which the unpickler replaced).
    const std::string problem = view_problem(t.scalar_type(), t.sizes().vec(), t.strides().vec(),
                                             t.storage_offset(), t.storage().nbytes());
    if (!problem.empty())
      throw SerializationError(fmt::format(
          "load_state_dict_file: '{}': tensor '{}' has a view that does not fit its storage: {}",
          path, key, problem));
    out.emplace(key, std::move(t));
  }
  return out;
}

void save_state_dict_file(const StateDict& state_dict, const std::string& path) {
  if (path.empty()) throw ValueError("save_state_dict_file: the path is empty");
  const std::vector<char> bytes = torch_save_bytes(path, state_dict);
  detail::write_file_atomically(path, std::string_view(bytes.data(), bytes.size()));
}

}  // namespace torchpar
