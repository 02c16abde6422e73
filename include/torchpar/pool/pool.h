#pragma once
/// Pool: worker processes running free functions over serializable arguments
/// (multiprocessing.Pool / torch.multiprocessing.Pool / machin's Pool).

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "torchpar/ipc/queue.h"
#include "torchpar/pool/async_result.h"
#include "torchpar/process/process.h"

namespace torchpar {
namespace detail {

using TaskTrampoline = std::string (*)(void* fn, const std::string& args);

/// Calls `call` on the loaded argument tuple and serializes the result (void as true).
/// Results are copied, never shared: the worker may exit before the parent reads them.
template <class Call, class Tuple>
std::string call_and_dump(Call&& call, Tuple& t) {
  using R = decltype(std::apply(call, t));
  if constexpr (std::is_void_v<R>) {
    std::apply(call, t);
    return dumps(true).bytes;
  } else {
    return dumps(std::apply(call, t), {.copy_tensor = true}).bytes;
  }
}

/// Runs fn(args...) from serialized args in a worker.
template <class FnPtr, class Tuple>
std::string run_task(void* fn, const std::string& args) {
  Tuple t = loads<Tuple>(Payload{args, {}});
  return call_and_dump(reinterpret_cast<FnPtr>(fn), t);
}

/// Decodes every value of every chunk, in order (map / starmap results).
template <class V>
std::vector<V> decode_all(JobState& j) {
  std::vector<V> out;
  for (auto& c : j.chunks)
    for (auto& v : c.values) out.push_back(loads<V>(Payload{std::any_cast<std::string>(v), {}}));
  return out;
}

struct PoolCall {  // a function and its trampoline, as code addresses
  CodeAddress tramp, fn;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(tramp, fn);
  }
};

struct PoolTask {
  uint64_t job = 0;  // 0: the worker should exit
  uint32_t chunk = 0;
  PoolCall call;
  std::vector<std::string> args;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(job, chunk, call, args);
  }
};

struct PoolResult {
  uint64_t job = 0;
  uint32_t chunk = 0;
  int32_t worker = 0;
  bool ok = true;
  std::vector<std::string> values;
  std::string type, message;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(job, chunk, worker, ok, values, type, message);
  }
};

/// A payload nested in a worker's launch arguments, its fds out of band.
inline void save_nested(OutputArchive& ar, const Payload& p) {
  std::vector<uint32_t> fds;
  for (const auto& fd : p.fds) fds.push_back(ar.fd_index(fd.get()));
  ar(p.bytes, fds);
}
inline std::shared_ptr<Payload> load_nested(InputArchive& ar) {
  auto p = std::make_shared<Payload>();
  std::vector<uint32_t> fds;
  ar(p->bytes, fds);
  for (uint32_t i : fds) p->fds.push_back(ar.take_fd(i));
  return p;
}

/// The initializer: its call and its arguments, serialized afresh for every worker (shared
/// tensors are exported once per worker; queues, locks and values travel as fds).
struct PoolInit {
  bool set = false;
  PoolCall call;
  std::function<Payload()> make_args;  // parent side
  std::shared_ptr<Payload> args;       // what a worker receives
  void save(OutputArchive& ar) const {
    ar(set, call);
    if (set) save_nested(ar, *args);
  }
  void load(InputArchive& ar) {
    ar(set, call);
    if (set) args = load_nested(ar);
  }
};

/// A worker's context object (CtxPool), serialized for that worker only.
struct WorkerContext {
  bool set = false;
  std::shared_ptr<Payload> payload;
  void save(OutputArchive& ar) const {
    ar(set);
    if (set) save_nested(ar, *payload);
  }
  void load(InputArchive& ar) {
    ar(set);
    if (set) payload = load_nested(ar);
  }
};

/// In a worker: the payload of its context (empty outside CtxPool workers).
const Payload& worker_context_payload();

/// In a CtxPool worker: its context, loaded on first use.
template <class Ctx>
Ctx& worker_context() {
  static Ctx* ctx = new Ctx(loads<Ctx>(worker_context_payload()));
  return *ctx;
}

/// Runs fn(context, args...) for CtxPool.
template <class FnPtr, class Ctx, class Tuple>
std::string run_ctx_task(void* fn, const std::string& args) {
  auto f = reinterpret_cast<FnPtr>(fn);
  Tuple t = loads<Tuple>(Payload{args, {}});
  Ctx& c = worker_context<Ctx>();
  return call_and_dump([&](auto&... a) { return f(c, a...); }, t);
}

template <class Fn, class Tuple>
PoolCall make_call(Fn fn) {
  auto fp = function_pointer(fn);
  static_assert(!std::is_same_v<decltype(fp), std::nullptr_t>,
                "Pool runs free functions and captureless lambdas (use ThreadPool for closures)");
  return PoolCall{to_code_address(reinterpret_cast<const void*>(&run_task<decltype(fp), Tuple>)),
                  to_code_address(reinterpret_cast<const void*>(fp))};
}

class PoolCore;

}  // namespace detail

/// An initializer(initargs...) run once in every worker when it starts.
template <class Fn, class... Args>
detail::PoolInit initializer(Fn fn, Args... args) {
  using Tuple = std::tuple<std::decay_t<Args>...>;
  auto fp = detail::function_pointer(fn);
  static_assert(!std::is_same_v<decltype(fp), std::nullptr_t>,
                "the initializer must be a free function or captureless lambda");
  detail::PoolInit init;
  init.set = true;
  init.call = detail::PoolCall{detail::to_code_address(reinterpret_cast<const void*>(
                                   &detail::Trampolines<decltype(fp), Tuple>::run)),
                               detail::to_code_address(reinterpret_cast<const void*>(fp))};
  auto tup = std::make_shared<Tuple>(args...);
  init.make_args = [tup] { return dumps(*tup, {.copy_tensor = false}); };
  return init;
}

/// Options of a Pool.
struct PoolOptions {
  size_t processes = 0;           ///< 0: the number of cores
  detail::PoolInit init;          ///< torchpar::initializer(fn, args...)
  uint64_t maxtasksperchild = 0;  ///< a worker is replaced after this many tasks (0: never)
  std::optional<StartMethod> start_method;  ///< default: get_start_method()
  bool copy_tensor = false;                 ///< task arguments: tensors shared (false) or copied
  int threads = 1;                          ///< intra-op threads per worker
  /// Workers are daemons: killed (not waited for) when the pool goes. false: the pool's
  /// destructor still terminates them, as Python's context-manager exit does.
  bool daemon = true;
  /// CtxPool: serializes worker i's context (set by CtxPool).
  std::function<Payload(size_t)> worker_context;
};

/// Worker processes that run tasks. A worker killed mid-task fails exactly the tasks it
/// held with WorkerLostError and is replaced; the pool goes on and never hangs.
///
/// Lifetime: the destructor terminates (kills workers; unfinished results fail with
/// ClosedError), as Python's context-manager exit does.
/// Safety: thread-safe. Errors: ClosedError for a call after close()/terminate(); results
/// raise TaskError (the task's exception type and message) or WorkerLostError.
/// Units: timeouts are std::chrono durations (seconds); chunksize counts items.
/// Source: multiprocessing.Pool, torch.multiprocessing.Pool, machin.parallel.pool.Pool.
class Pool {
 public:
  explicit Pool(PoolOptions options = {});
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  template <class Fn, class... Args>
  auto apply_async(Fn fn, std::tuple<Args...> args,
                   std::function<void(const detail::result_of_t<Fn, Args...>&)> callback = {},
                   std::function<void(std::exception_ptr)> error_callback = {}) {
    using V = detail::result_of_t<Fn, Args...>;
    using Tuple = std::tuple<std::decay_t<Args>...>;
    std::vector<std::vector<std::string>> chunks{{encode(Tuple(args))}};
    auto job = submit(detail::make_call<Fn, Tuple>(fn), std::move(chunks));
    AsyncResult<V> result(job, [](detail::JobState& j) {
      return loads<V>(Payload{std::any_cast<std::string>(j.chunks[0].values[0]), {}});
    });
    detail::attach_callbacks<V>(job, result, callback, error_callback);
    return result;
  }
  template <class Fn, class... Args>
  auto apply(Fn fn, std::tuple<Args...> args) {
    return apply_async(fn, std::move(args)).get();
  }

  template <class Fn, class T>
  auto map_async(Fn fn, const std::vector<T>& items, size_t chunksize = 0) {
    using V = detail::result_of_t<Fn, T>;
    auto job = submit_items<Fn, T>(fn, items, chunksize);
    return AsyncResult<std::vector<V>>(job, &detail::decode_all<V>);
  }
  template <class Fn, class T>
  auto map(Fn fn, const std::vector<T>& items, size_t chunksize = 0) {
    return map_async(fn, items, chunksize).get();
  }
  template <class Fn, class T>
  auto imap(Fn fn, const std::vector<T>& items, size_t chunksize = 1) {
    return iterator<Fn, T>(fn, items, chunksize, true);
  }
  template <class Fn, class T>
  auto imap_unordered(Fn fn, const std::vector<T>& items, size_t chunksize = 1) {
    return iterator<Fn, T>(fn, items, chunksize, false);
  }
  /// fn(a, b, ...) for each tuple.
  template <class Fn, class... Args>
  auto starmap_async(Fn fn, const std::vector<std::tuple<Args...>>& items, size_t chunksize = 0) {
    using V = detail::result_of_t<Fn, Args...>;
    using Tuple = std::tuple<std::decay_t<Args>...>;
    auto ranges = detail::split_chunks(items.size(), chunksize, size());
    std::vector<std::vector<std::string>> chunks;
    for (auto [b, e] : ranges) {
      chunks.emplace_back();
      for (size_t i = b; i < e; ++i) chunks.back().push_back(encode(Tuple(items[i])));
    }
    auto job = submit(detail::make_call<Fn, Tuple>(fn), std::move(chunks));
    return AsyncResult<std::vector<V>>(job, &detail::decode_all<V>);
  }
  template <class Fn, class... Args>
  auto starmap(Fn fn, const std::vector<std::tuple<Args...>>& items, size_t chunksize = 0) {
    return starmap_async(fn, items, chunksize).get();
  }

  /// No more tasks; workers exit once the queued ones are done.
  void close();
  /// Waits for the workers after close() (true) or until `timeout` (false).
  /// Errors: torchpar::Error when neither close() nor terminate() was called.
  bool join(std::optional<std::chrono::duration<double>> timeout = std::nullopt);
  /// Kills the workers now; unfinished results fail with ClosedError.
  void terminate();
  size_t size() const;
  /// pids of the current workers (they change as workers are replaced).
  std::vector<int> pids() const;

 protected:
  template <class T>
  std::string encode(const T& args) const {
    Payload p = dumps(args, {.copy_tensor = copy_tensor_, .pass_fds = false});
    if (!p.fds.empty())
      throw Error(
          "Pool: task arguments may not carry file descriptors (queues, locks, pipes); "
          "pass those with the initializer");
    return std::move(p.bytes);
  }
  template <class Fn, class T>
  std::shared_ptr<detail::JobState> submit_items(Fn fn, const std::vector<T>& items,
                                                 size_t chunksize) {
    using Tuple = std::tuple<std::decay_t<T>>;
    auto ranges = detail::split_chunks(items.size(), chunksize, size());
    std::vector<std::vector<std::string>> chunks;
    for (auto [b, e] : ranges) {
      chunks.emplace_back();
      for (size_t i = b; i < e; ++i) chunks.back().push_back(encode(Tuple(items[i])));
    }
    return submit(detail::make_call<Fn, Tuple>(fn), std::move(chunks));
  }
  template <class Fn, class T>
  auto iterator(Fn fn, const std::vector<T>& items, size_t chunksize, bool ordered) {
    using V = detail::result_of_t<Fn, T>;
    return IMapIterator<V>(submit_items<Fn, T>(fn, items, chunksize), ordered, [](std::any& v) {
      return loads<V>(Payload{std::any_cast<std::string>(v), {}});
    });
  }
  std::shared_ptr<detail::JobState> submit(detail::PoolCall call,
                                           std::vector<std::vector<std::string>> chunks);

  std::unique_ptr<detail::PoolCore> core_;
  bool copy_tensor_ = false;
};

/// A Pool whose worker i holds worker_contexts[i] and calls fn(context, args...): per-worker
/// state (a model, an environment, a connection) without globals. Contexts are serialized
/// once per worker (tensors shared). Source: machin.parallel.pool.CtxPool.
template <class Ctx>
class CtxPool : public Pool {
 public:
  CtxPool(std::vector<Ctx> worker_contexts, PoolOptions options = {})
      : Pool(with_contexts(std::move(worker_contexts), std::move(options))) {}

  /// fn(Ctx&, args...) in some worker.
  template <class Fn, class... Args>
  auto apply_async(Fn fn, std::tuple<Args...> args) {
    using V = detail::result_of_t<Fn, Ctx, Args...>;
    using Tuple = std::tuple<std::decay_t<Args>...>;
    auto job = submit(ctx_call<Fn, Tuple>(fn), {{encode(Tuple(args))}});
    return AsyncResult<V>(job, [](detail::JobState& j) {
      return loads<V>(Payload{std::any_cast<std::string>(j.chunks[0].values[0]), {}});
    });
  }
  template <class Fn, class... Args>
  auto apply(Fn fn, std::tuple<Args...> args) {
    return apply_async(fn, std::move(args)).get();
  }
  /// fn(Ctx&, item) for each item, in order.
  template <class Fn, class T>
  auto map(Fn fn, const std::vector<T>& items, size_t chunksize = 0) {
    using V = detail::result_of_t<Fn, Ctx, T>;
    using Tuple = std::tuple<std::decay_t<T>>;
    std::vector<std::vector<std::string>> chunks;
    for (auto [b, e] : detail::split_chunks(items.size(), chunksize, size())) {
      chunks.emplace_back();
      for (size_t i = b; i < e; ++i) chunks.back().push_back(encode(Tuple(items[i])));
    }
    auto job = submit(ctx_call<Fn, Tuple>(fn), std::move(chunks));
    return AsyncResult<std::vector<V>>(job, &detail::decode_all<V>).get();
  }

 private:
  template <class Fn, class Tuple>
  static detail::PoolCall ctx_call(Fn fn) {
    auto fp = detail::function_pointer(fn);
    static_assert(!std::is_same_v<decltype(fp), std::nullptr_t>,
                  "CtxPool runs free functions and captureless lambdas");
    return detail::PoolCall{detail::to_code_address(reinterpret_cast<const void*>(
                                &detail::run_ctx_task<decltype(fp), Ctx, Tuple>)),
                            detail::to_code_address(reinterpret_cast<const void*>(fp))};
  }
  static PoolOptions with_contexts(std::vector<Ctx> contexts, PoolOptions o) {
    TORCH_CHECK(!contexts.empty(), "CtxPool needs one context per worker");
    if (o.processes == 0) o.processes = contexts.size();
    TORCH_CHECK(o.processes == contexts.size(), "CtxPool: ", contexts.size(),
                " worker contexts for ", o.processes, " processes");
    auto shared = std::make_shared<std::vector<Ctx>>(std::move(contexts));
    o.worker_context = [shared](size_t i) { return dumps((*shared)[i], {.copy_tensor = false}); };
    return o;
  }
};

/// The Pool engine already feeds each worker through its own queue (so a dead worker's
/// tasks are known exactly); P2PPool is the same pool under machin's name.
/// Source: machin.parallel.pool.P2PPool.
using P2PPool = Pool;

}  // namespace torchpar
