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
#include <memory>
#include <utility>
#include <vector>

#include "core/atomic_file.h"
#include "core/file_mapping.h"
#include "torchpar/core/error.h"
#include "torchpar/core/fd.h"
#include "torchpar/core/syscall.h"

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

c10::IValue unpickle(const std::string& path, const std::shared_ptr<const FileMapping>& m,
                     bool mmap) {
  caffe2::serialize::PyTorchStreamReader reader(std::make_shared<MappedReader>(m));
  at::DataPtr pickle;
  size_t pickle_size = 0;
  std::tie(pickle, pickle_size) = reader.getRecord("data.pkl");
  const char* bytes = static_cast<const char*>(pickle.get());
  size_t pos = 0;
  auto read = [&](char* buf, size_t n) -> size_t {
    n = std::min(n, pickle_size - pos);
    std::memcpy(buf, bytes + pos, n);
    pos += n;
    return n;
  };
  auto read_record = [&](const std::string& key) -> at::DataPtr {
    const std::string name = "data/" + key;
    if (!mmap) return std::get<0>(reader.getRecord(name));
    const size_t offset = reader.getRecordOffset(name);
    if (offset > m->size())
      throw SerializationError(fmt::format(
          "load_state_dict_file: '{}': record {} starts past the end of the file", path, name));
    return alias_mapping(m, offset);
  };
  torch::jit::Unpickler unpickler(read, /*type_resolver=*/nullptr, /*obj_loader=*/nullptr,
                                  read_record, c10::optional<at::Device>(at::kCPU));
  unpickler.set_version(reader.version());
  return unpickler.parse_ivalue();
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
  c10::IValue root;
  try {
    root = unpickle(path, m, options.mmap);
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
    if (options.mmap && t.storage().nbytes() > 0) {
      // The unpickler sized each storage from the pickle, not from the record: check that it
      // lies inside the file before anything reads it.
      const char* p = static_cast<const char*>(t.storage().data_ptr().get());
      const bool inside = p >= m->data() && p <= m->data() + m->size() &&
                          t.storage().nbytes() <= static_cast<size_t>(m->data() + m->size() - p);
      if (!inside)
        throw SerializationError(
            fmt::format("load_state_dict_file: '{}': tensor '{}' ({} bytes) lies outside the file",
                        path, item.key().toStringRef(), t.storage().nbytes()));
    }
    out.emplace(item.key().toStringRef(), std::move(t));
  }
  return out;
}

void save_state_dict_file(const StateDict& state_dict, const std::string& path) {
  if (path.empty()) throw ValueError("save_state_dict_file: the path is empty");
  const std::vector<char> bytes = torch_save_bytes(path, state_dict);
  detail::write_file_atomically(path, std::string_view(bytes.data(), bytes.size()));
}

}  // namespace torchpar
