#pragma once
/// Process: one child process running a target (Python's multiprocessing.Process).

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "torchpar/core/timeout.h"
#include "torchpar/process/start_method.h"
#include "torchpar/serialize/serialize.h"

namespace torchpar {

/// Options of a Process.
struct ProcessOptions {
  std::string name{};                         ///< "Process-<n>" when empty
  bool daemon = false;                        ///< terminated when the parent's Process object dies
  std::optional<StartMethod> start_method{};  ///< default: get_start_method()
  int threads = 1;                            ///< LibTorch intra-op threads in the child
};

namespace detail {

/// Code address that is valid in another process running the same binary (module name,
/// offset), so a spawned child can find a function and its trampoline.
struct CodeAddress {
  std::string module;
  uint64_t offset = 0;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(module, offset);
  }
};
CodeAddress to_code_address(const void* p);
void* from_code_address(const CodeAddress& a);

using Trampoline = void (*)(void* fn, const Payload& args);

template <class R, class... P, class... A>
void spawn_trampoline_impl(void* fn, const Payload& args, std::tuple<A...>*) {
  auto f = reinterpret_cast<R (*)(P...)>(fn);
  auto tup = loads<std::tuple<A...>>(args);
  std::apply([&](auto&... a) { f(a...); }, tup);
}

template <class FnPtr, class Tuple>
struct Trampolines;
template <class R, class... P, class Tuple>
struct Trampolines<R (*)(P...), Tuple> {
  static void run(void* fn, const Payload& args) {
    spawn_trampoline_impl<R, P...>(fn, args, static_cast<Tuple*>(nullptr));
  }
};

/// What a child needs: a direct closure for fork, and for spawn the function, its
/// trampoline and the serialized arguments.
struct LaunchSpec {
  std::function<void()> direct;
  bool spawnable = false;
  std::string not_spawnable_reason;
  const void* fn = nullptr;
  Trampoline trampoline = nullptr;
  std::function<Payload()> make_args;
};

template <class Fn>
constexpr auto function_pointer(Fn& fn) {
  using D = std::decay_t<Fn>;
  if constexpr (std::is_pointer_v<D> && std::is_function_v<std::remove_pointer_t<D>>) {
    return fn;
  } else if constexpr (requires { +fn; }) {
    using P = decltype(+fn);
    if constexpr (std::is_pointer_v<P> && std::is_function_v<std::remove_pointer_t<P>>)
      return +fn;
    else
      return nullptr;
  } else {
    return nullptr;
  }
}

template <class T>
constexpr bool is_serializable_v = cereal::traits::is_output_serializable<T, OutputArchive>::value&&
    cereal::traits::is_input_serializable<T, InputArchive>::value&&
        std::is_default_constructible_v<T>;

/// Builds the spec for fn(args...). Arguments are stored decayed (copied or moved).
template <class Fn, class... Args>
LaunchSpec make_launch_spec(Fn&& fn, Args&&... args) {
  using Tuple = std::tuple<std::decay_t<Args>...>;
  auto tup = std::make_shared<Tuple>(std::forward<Args>(args)...);
  LaunchSpec spec;
  auto fp = function_pointer(fn);
  spec.direct = [f = std::forward<Fn>(fn), tup]() mutable { std::apply(f, *tup); };
  if constexpr (std::is_same_v<decltype(fp), std::nullptr_t>) {
    spec.not_spawnable_reason =
        "the target is not a free function or captureless lambda (captures cannot cross exec)";
  } else if constexpr (!(is_serializable_v<std::decay_t<Args>> && ...)) {
    spec.not_spawnable_reason = "an argument type is not serializable with torchpar::dumps";
  } else {
    spec.spawnable = true;
    spec.fn = reinterpret_cast<const void*>(fp);
    spec.trampoline = &Trampolines<decltype(fp), Tuple>::run;
    // Tensors travel by shared memory, as torch.multiprocessing passes them.
    spec.make_args = [tup] { return dumps(*tup, {.copy_tensor = false}); };
  }
  return spec;
}

struct ProcessImpl;

}  // namespace detail

class Process;
namespace detail {
/// A fd that becomes readable when `p` exits (its pidfd, or the forkserver's status
/// channel); -1 if none. For ProcessContext::join's poll.
int process_wait_fd(const Process& p);
/// A Process running `spec` (start_processes builds fn(i, args...) as a spec).
Process make_process(ProcessOptions options, LaunchSpec spec);
}  // namespace detail

/// A child process running `target(args...)`.
///
/// Lifetime: the destructor of a started, un-joined Process kills (SIGKILL) and reaps a
/// daemon child, and waits for a non-daemon one (as Python waits for non-daemonic children
/// at exit). Children always die with their parent process (PR_SET_PDEATHSIG; a start from a
/// thread other than the main one forks on a long-lived launcher thread, so a child
/// outlives the thread that started it, as in Python).
/// Safety: one thread uses a Process object at a time; separate objects are independent.
/// Errors: start() throws torchpar::Error for a second start, spawn without init() or a
/// target that cannot be spawned, SystemError when fork/exec resources run out.
/// Source: multiprocessing.Process.
class Process {
 public:
  template <class Fn, class... Args>
  requires(!std::is_same_v<std::decay_t<Fn>, ProcessOptions>) explicit Process(Fn&& target,
                                                                               Args&&... args)
      : Process(ProcessOptions{}, std::forward<Fn>(target), std::forward<Args>(args)...) {}

  template <class Fn, class... Args>
  Process(ProcessOptions options, Fn&& target, Args&&... args)
      : Process(std::move(options),
                detail::make_launch_spec(std::forward<Fn>(target), std::forward<Args>(args)...)) {}

  Process(Process&&) noexcept;
  Process& operator=(Process&&) noexcept;
  ~Process();

  /// Starts the child. Errors: see the class.
  void start();
  /// Waits for the child to exit; true when it did (then it is reaped), false on timeout.
  bool join(Timeout timeout = std::nullopt);
  bool is_alive();
  /// Python's exitcode: nullopt while running (or not started), the exit code, or minus the
  /// signal number that killed it.
  std::optional<int> exitcode();
  int pid() const;
  /// SIGTERM / SIGKILL to the child (no-op when it already exited).
  void terminate();
  void kill();
  const std::string& name() const;
  bool daemon() const;
  /// Error the child raised, if it ended by an exception: {type, message}. The child also
  /// prints "Process <name>:" and "<type>: <message>" on its stderr.
  std::optional<std::pair<std::string, std::string>> error() const;

 private:
  friend int detail::process_wait_fd(const Process& p);
  friend Process detail::make_process(ProcessOptions options, detail::LaunchSpec spec);
  Process(ProcessOptions options, detail::LaunchSpec spec);
  void finish() noexcept;  // kill a daemon, then join: what the destructor does
  std::unique_ptr<detail::ProcessImpl> impl_;
};

inline Process detail::make_process(ProcessOptions options, LaunchSpec spec) {
  return Process(std::move(options), std::move(spec));
}

}  // namespace torchpar
