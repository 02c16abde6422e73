#pragma once
/// RAII owner of a file descriptor.

#include <utility>

namespace torchpar {

/// Owns one file descriptor and closes it on destruction (errors from close are
/// ignored there; call `reset()` to close early). Move-only.
/// Safety: not thread-safe; one owner at a time.
class UniqueFd {
 public:
  UniqueFd() noexcept = default;
  explicit UniqueFd(int fd) noexcept : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(std::exchange(other.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const noexcept { return fd_; }
  bool valid() const noexcept { return fd_ >= 0; }
  explicit operator bool() const noexcept { return valid(); }
  /// Gives up ownership without closing.
  int release() noexcept { return std::exchange(fd_, -1); }
  /// Closes the held fd (if any) and takes `fd`.
  void reset(int fd = -1) noexcept;
  /// Duplicates the fd (F_DUPFD_CLOEXEC). Throws SystemError on failure.
  UniqueFd dup() const;

 private:
  int fd_ = -1;
};

}  // namespace torchpar
