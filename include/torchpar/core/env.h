#pragma once
/// The environment variables torchpar reads: one table (name, type, default, meaning) and the
/// typed accessors every read goes through. docs/environment.md lists the same variables; this
/// table is the source (core_test checks that every name in it appears in that page).
///
/// Reads are not cached here: each accessor calls std::getenv. Where a variable is read
/// once per process, the caller keeps the value (docs/environment.md says which).

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace torchpar {

/// How a variable's value is read (which accessor).
enum class EnvType {
  kText,      ///< env_text: any non-empty text (an address, an interface name)
  kPath,      ///< env_value: a path or directory, used as given
  kFlag,      ///< env_flag: "0" or "1"
  kUnsigned,  ///< env_unsigned: a decimal count (bytes)
  kInteger,   ///< env_int: a decimal integer (a rank, a port)
  kRaw,       ///< env_value: read whole by its one reader (the job key in hex, the library's
              ///< own launch records)
};

/// One row of the table.
struct EnvVariable {
  std::string_view name;
  EnvType type;
  /// What holds when it is unset (in words).
  std::string_view default_value;
  std::string_view meaning;
  /// true: torchpar's own (TORCHPAR_*); false: another program's convention that torchpar
  /// follows (torchrun's RANK, POSIX's HOME, CUDA's CUDA_VISIBLE_DEVICES, ...).
  bool ours;
};

/// Every environment variable torchpar (the library and the `torchpar` program) reads, in
/// the order of docs/environment.md.
/// Safety: thread-safe (a constant table).
std::span<const EnvVariable> environment_variables();

/// The row of `name`.
/// Errors: ValueError when `name` is not in the table (a read the table does not list).
/// Safety: thread-safe.
const EnvVariable& environment_variable(std::string_view name);

// The accessors. Each takes a name of the table (ValueError for another name, or for one of
// another EnvType) and reads the environment with std::getenv: do not call them while another
// thread changes the environment (setenv, unsetenv, putenv).

/// The value of `name` (of any EnvType) as set, even when empty; nullopt when unset. How
/// kPath and kRaw variables are read; for the others, a presence check.
std::optional<std::string> env_value(std::string_view name);

/// The value of a kText variable; nullopt when unset or empty.
std::optional<std::string> env_text(std::string_view name);

/// A kFlag variable: "1" true, "0" false; `fallback` when unset or empty.
/// Errors: ValueError naming the variable and its value for anything else.
bool env_flag(std::string_view name, bool fallback);

/// A kUnsigned variable: a whole decimal number in [min, max] (digits only); `fallback`
/// when unset or empty.
/// Errors: ValueError naming the variable and its value when it is not a whole decimal
/// number or lies outside [min, max].
uint64_t env_unsigned(std::string_view name, uint64_t fallback, uint64_t min = 0,
                      uint64_t max = UINT64_MAX);

/// A kInteger variable: a whole decimal number (an optional '-', then digits) in int's
/// range; nullopt when unset or empty.
/// Errors: ValueError naming the variable and its value when it is not one.
/// Source: torch.distributed's env:// rendezvous reads RANK, WORLD_SIZE, MASTER_PORT as int().
std::optional<int> env_int(std::string_view name);

}  // namespace torchpar
