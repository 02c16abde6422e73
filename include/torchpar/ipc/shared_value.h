#pragma once
/// Value<T> and Array<T>: trivially copyable data in shared memory, with an optional
/// process-shared lock (Python's multiprocessing.Value / Array).

#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

#include "torchpar/ipc/detail/shared_page.h"
#include "torchpar/ipc/synchronize.h"
#include "torchpar/serialize/archive.h"

namespace torchpar {

namespace detail {
// The optional lock of Value / Array on the wire: a flag, then the lock.
inline void save_optional_lock(OutputArchive& ar, const std::optional<Lock>& lock) {
  const bool has_lock = lock.has_value();
  ar(has_lock);
  if (has_lock) ar(*lock);
}
inline void load_optional_lock(InputArchive& ar, std::optional<Lock>& lock) {
  bool has_lock = false;
  ar(has_lock);
  if (!has_lock) {
    lock.reset();
    return;
  }
  lock.emplace();
  ar(*lock);
}
}  // namespace detail

/// One T in shared memory. Copies (and children it is passed to) see the same T.
/// Safety: get/set are plain loads and stores; hold get_lock() around read-modify-write
///         (`v.get_lock().acquire(); v.set(v.get() + 1); v.get_lock().release();`).
/// Errors: get_lock() throws torchpar::Error when created with lock=false.
/// Source: multiprocessing.Value(typecode, value, lock=True).
template <class T>
class Value {
  static_assert(std::is_trivially_copyable_v<T>, "Value<T> needs a trivially copyable T");

 public:
  explicit Value(T initial = T{}, bool lock = true)
      : page_(detail::SharedPage::create(sizeof(T), "torchpar-value")) {
    std::memcpy(page_->data(), &initial, sizeof(T));
    if (lock) lock_ = RLock();
  }
  T get() const {
    T v;
    std::memcpy(&v, page_->data(), sizeof(T));
    return v;
  }
  void set(const T& v) { std::memcpy(page_->data(), &v, sizeof(T)); }
  /// The shared object itself (for atomics: std::atomic_ref<T>(*v.get_obj())).
  T* get_obj() const { return static_cast<T*>(page_->data()); }
  Lock& get_lock() {
    if (!lock_) throw Error("this Value was created with lock=false");
    return *lock_;
  }

  void save(detail::OutputArchive& ar) const {
    detail::SharedPage::save(ar, page_);
    detail::save_optional_lock(ar, lock_);
  }
  void load(detail::InputArchive& ar) {
    page_ = detail::SharedPage::load(ar, sizeof(T));
    detail::load_optional_lock(ar, lock_);
  }

 private:
  std::shared_ptr<detail::SharedPage> page_;
  std::optional<Lock> lock_;
};

/// `size` Ts in shared memory, zero-initialized or copied from `init`.
/// Safety and errors as Value. Source: multiprocessing.Array(typecode, size_or_init, lock=True).
template <class T>
class Array {
  static_assert(std::is_trivially_copyable_v<T>, "Array<T> needs a trivially copyable T");

 public:
  explicit Array(size_t size = 0, bool lock = true)
      : page_(detail::SharedPage::create(sizeof(uint64_t) + std::max<size_t>(size, 1) * sizeof(T),
                                         "torchpar-array")) {
    *static_cast<uint64_t*>(page_->data()) = size;
    if (lock) lock_ = RLock();
  }
  explicit Array(const std::vector<T>& init, bool lock = true) : Array(init.size(), lock) {
    if (!init.empty()) std::memcpy(data(), init.data(), init.size() * sizeof(T));
  }
  size_t size() const { return static_cast<size_t>(*static_cast<const uint64_t*>(page_->data())); }
  T* data() const {
    return reinterpret_cast<T*>(static_cast<char*>(page_->data()) + sizeof(uint64_t));
  }
  T& operator[](size_t i) const { return data()[i]; }
  std::span<T> span() const { return {data(), size()}; }
  std::vector<T> to_vector() const { return std::vector<T>(data(), data() + size()); }
  Lock& get_lock() {
    if (!lock_) throw Error("this Array was created with lock=false");
    return *lock_;
  }

  void save(detail::OutputArchive& ar) const {
    detail::SharedPage::save(ar, page_);
    detail::save_optional_lock(ar, lock_);
  }
  void load(detail::InputArchive& ar) {
    page_ = detail::SharedPage::load(ar, sizeof(uint64_t));
    if (size() > (page_->size() - sizeof(uint64_t)) / sizeof(T))
      throw SerializationError("Array size exceeds its shared object");
    detail::load_optional_lock(ar, lock_);
  }

 private:
  std::shared_ptr<detail::SharedPage> page_;
  std::optional<Lock> lock_;
};

}  // namespace torchpar
