#pragma once
/// Pool: worker processes running free functions over serializable arguments
/// (multiprocessing.Pool / torch.multiprocessing.Pool / machin's Pool).

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "torchpar/core/error.h"
#include "torchpar/ipc/queue.h"
#include "torchpar/pool/async_result.h"
// Internal machinery (the trampolines, PoolCall, PoolInit): installed because the
// templates below instantiate it; not public API.
#include "torchpar/pool/detail/pool_detail.h"
#include "torchpar/process/process.h"

namespace torchpar {

class Initializer;
namespace detail {
const PoolInit& pool_init(const Initializer& init);
}  // namespace detail

/// What torchpar::initializer returns: a function and its arguments, run once in every
/// worker when it starts. Default: none. Copyable; its arguments are shared by the copies.
class Initializer {
 public:
  Initializer() = default;
  /// True when no initializer is set.
  bool empty() const { return !init_.set; }

 private:
  explicit Initializer(detail::PoolInit init) : init_(std::move(init)) {}
  detail::PoolInit init_;
  template <class Fn, class... Args>
  friend Initializer initializer(Fn fn, Args... args);
  friend const detail::PoolInit& detail::pool_init(const Initializer&);
};

/// An initializer(initargs...) run once in every worker when it starts, before its first
/// task; the arguments are serialized afresh for every worker (tensors shared, queues and
/// locks passed as fds). An initializer that throws ends its worker (the pool reports
/// workers that keep dying; see docs/errors.md).
/// Errors: a compile error unless `fn` is a free function or a captureless lambda.
/// Source: the initializer/initargs of multiprocessing.Pool.
template <class Fn, class... Args>
Initializer initializer(Fn fn, Args... args) {
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
  return Initializer(std::move(init));
}

/// Options of a Pool.
struct PoolOptions {
  size_t processes = 0;           ///< 0: the number of cores
  Initializer init{};             ///< torchpar::initializer(fn, args...)
  uint64_t maxtasksperchild = 0;  ///< a worker is replaced after this many tasks (0: never)
  std::optional<StartMethod> start_method{};  ///< default: get_start_method()
  /// Task arguments: tensors shared (false) or copied (true); results are always copied.
  /// Default false, as torch.multiprocessing.Pool, Queue and Connection::send; machin's
  /// Pool defaults to is_copy_tensor=True, and so does dumps alone (machin's dumps).
  bool copy_tensor = false;
  int threads = 1;  ///< intra-op threads per worker
  /// Workers are daemons: killed (not waited for) when the pool goes. false: the pool's
  /// destructor still terminates them, as Python's context-manager exit does.
  bool daemon = true;
};

/// Worker processes that run tasks. A worker killed mid-task fails exactly the chunk it
/// was running with WorkerLostError and is replaced; the chunks of its batch it had not
/// started are queued again, in order. The pool goes on and never hangs.
///
/// Lifetime: the destructor terminates (kills workers; unfinished results fail with
/// ClosedError), as Python's context-manager exit does.
/// Safety: thread-safe. Errors: ClosedError for a call after close()/terminate(); results
/// raise TaskError (the task's exception type and message) or WorkerLostError.
/// Units: timeouts are std::chrono durations (seconds); chunksize counts items.
/// Source: multiprocessing.Pool, torch.multiprocessing.Pool, machin.parallel.pool.Pool.
class Pool {
 public:
  /// Starts `options.processes` workers. Errors: what Process::start raises (see
  /// docs/errors.md: a worker that cannot be started); workers started before are killed.
  explicit Pool(PoolOptions options = {});
  /// Terminates (see terminate()). Never throws.
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  /// fn(args...) in some worker; the result arrives later.
  ///
  /// Units:   the returned AsyncResult's timeouts are seconds (std::chrono durations).
  /// Errors:  ClosedError after close()/terminate(); torchpar::Error when an argument
  ///          carries fds (queues, locks, pipes: pass those with the initializer), both in
  ///          the calling thread. get() then raises TaskError (the task's exception type and
  ///          message), WorkerLostError (its worker died while running it), ClosedError
  ///          (terminated first) or the error of a failed dispatch.
  /// Callbacks: `callback(result)` or `error_callback(error)` runs once, on the pool's
  ///          manager thread (or in this call when already done); it must not block or
  ///          call join()/terminate(). Arguments are serialized in this thread (tensors
  ///          moved to shared memory unless PoolOptions::copy_tensor).
  /// Safety:  thread-safe.
  /// Source:  multiprocessing.Pool.apply_async.
  template <class Fn, class... Args>
  auto apply_async(Fn fn, std::tuple<Args...> args,
                   std::function<void(const detail::result_of_t<Fn, Args...>&)> callback = {},
                   std::function<void(std::exception_ptr)> error_callback = {}) {
    using V = detail::result_of_t<Fn, Args...>;
    using Tuple = std::tuple<std::decay_t<Args>...>;
    return apply_with<V, Tuple>(detail::make_call<Fn, Tuple>(fn), Tuple(std::move(args)),
                                std::move(callback), std::move(error_callback));
  }
  /// fn(args...) in some worker, waited for: apply_async(fn, args).get().
  ///
  /// Units:   no timeout; it still never hangs: a dead worker fails the task.
  /// Errors:  as apply_async, then what its get() raises (TaskError, WorkerLostError,
  ///          ClosedError).
  /// Safety:  thread-safe; not from a callback (it would wait for the manager thread).
  /// Source:  multiprocessing.Pool.apply.
  template <class Fn, class... Args>
  auto apply(Fn fn, std::tuple<Args...> args) {
    return apply_async(fn, std::move(args)).get();
  }

  /// fn(item) for each item, in chunks of `chunksize` items (0: about four chunks a
  /// worker); the results, in order, arrive later as one vector.
  ///
  /// Units:   chunksize counts items; AsyncResult timeouts are seconds.
  /// Errors:  as apply_async; get() raises the first failed chunk's error (the other
  ///          chunks still run). Callbacks: as apply_async, with the whole vector.
  /// Safety:  thread-safe. Source: multiprocessing.Pool.map_async.
  template <class Fn, class T>
  auto map_async(Fn fn, const std::vector<T>& items, size_t chunksize = 0,
                 std::function<void(const std::vector<detail::result_of_t<Fn, T>>&)> callback = {},
                 std::function<void(std::exception_ptr)> error_callback = {}) {
    using V = detail::result_of_t<Fn, T>;
    using Tuple = std::tuple<std::decay_t<T>>;
    return map_with<V, Tuple>(
        detail::make_call<Fn, Tuple>(fn), items.size(), chunksize,
        [&](size_t i) { return Tuple(items[i]); }, std::move(callback), std::move(error_callback));
  }
  /// fn(item) for each item, waited for: map_async(fn, items, chunksize).get().
  ///
  /// Units:   chunksize counts items (0: about four chunks a worker); no timeout, and no
  ///          hang: a dead worker fails its chunk.
  /// Errors:  as map_async, then the first failed chunk's error (TaskError,
  ///          WorkerLostError, ClosedError).
  /// Safety:  thread-safe; not from a callback. Source: multiprocessing.Pool.map.
  template <class Fn, class T>
  auto map(Fn fn, const std::vector<T>& items, size_t chunksize = 0) {
    return map_async(fn, items, chunksize).get();
  }
  /// fn(item) for each item; an iterator yielding the results in order as they come.
  ///
  /// Units:   chunksize counts items (default 1); IMapIterator::next's timeout is seconds.
  /// Errors:  as apply_async, in the calling thread; IMapIterator::next raises a failed
  ///          chunk's error (TaskError, WorkerLostError, ClosedError) once, then goes on.
  /// Safety:  thread-safe; the iterator has one consumer. Source: multiprocessing.Pool.imap.
  template <class Fn, class T>
  auto imap(Fn fn, const std::vector<T>& items, size_t chunksize = 1) {
    using Tuple = std::tuple<std::decay_t<T>>;
    return imap_with<detail::result_of_t<Fn, T>, Tuple>(
        detail::make_call<Fn, Tuple>(fn), items.size(), chunksize,
        [&](size_t i) { return Tuple(items[i]); }, true);
  }
  /// fn(item) for each item; an iterator yielding the results in completion order.
  ///
  /// Units, Errors, Safety: as imap.
  /// Source:  multiprocessing.Pool.imap_unordered.
  template <class Fn, class T>
  auto imap_unordered(Fn fn, const std::vector<T>& items, size_t chunksize = 1) {
    using Tuple = std::tuple<std::decay_t<T>>;
    return imap_with<detail::result_of_t<Fn, T>, Tuple>(
        detail::make_call<Fn, Tuple>(fn), items.size(), chunksize,
        [&](size_t i) { return Tuple(items[i]); }, false);
  }
  /// fn(a, b, ...) for each tuple of `items`; the results, in order, arrive later.
  ///
  /// Units, Errors, Callbacks: as map_async.
  /// Safety:  thread-safe. Source: multiprocessing.Pool.starmap_async.
  template <class Fn, class... Args>
  auto starmap_async(
      Fn fn, const std::vector<std::tuple<Args...>>& items, size_t chunksize = 0,
      std::function<void(const std::vector<detail::result_of_t<Fn, Args...>>&)> callback = {},
      std::function<void(std::exception_ptr)> error_callback = {}) {
    using V = detail::result_of_t<Fn, Args...>;
    using Tuple = std::tuple<std::decay_t<Args>...>;
    return map_with<V, Tuple>(
        detail::make_call<Fn, Tuple>(fn), items.size(), chunksize,
        [&](size_t i) { return Tuple(items[i]); }, std::move(callback), std::move(error_callback));
  }
  /// fn(a, b, ...) for each tuple, waited for: starmap_async(fn, items, chunksize).get().
  ///
  /// Units, Errors: as map.
  /// Safety:  thread-safe; not from a callback. Source: multiprocessing.Pool.starmap.
  template <class Fn, class... Args>
  auto starmap(Fn fn, const std::vector<std::tuple<Args...>>& items, size_t chunksize = 0) {
    return starmap_async(fn, items, chunksize).get();
  }

  /// No more tasks: later calls raise ClosedError; workers exit once the queued tasks are
  /// done (results still arrive).
  ///
  /// Errors:  none. Safety: thread-safe. Source: multiprocessing.Pool.close.
  void close();
  /// Waits for the workers to end after close() or terminate().
  ///
  /// Units:   `timeout` wall-clock (nullopt: no limit). Returns true when they ended,
  ///          false when `timeout` passed first (nothing changed; call again).
  /// Errors:  torchpar::Error when neither close() nor terminate() was called.
  /// Safety:  one thread at a time, never from a callback. Source: multiprocessing.Pool.join.
  bool join(Timeout timeout = std::nullopt);
  /// Kills the workers now (SIGKILL, before anything else: a stopped or wedged worker
  /// cannot block it); unfinished results fail with ClosedError. Returns once the manager
  /// thread ended; every wait inside is bounded.
  ///
  /// Errors:  never throws. Safety: one thread at a time, never from a callback.
  /// Source:  multiprocessing.Pool.terminate.
  void terminate();
  /// The number of worker slots (PoolOptions::processes). Safety: thread-safe.
  size_t size() const;
  /// pids of the current workers (they change as workers are replaced; -1: a slot being
  /// refilled). Safety: thread-safe.
  std::vector<int> pids() const;

 private:
  // The engine below is private: CtxPool (a friend, deriving privately) is its only other
  // user; nothing here is part of the public API.
  template <class Ctx>
  friend class CtxPool;

  /// CtxPool: worker i's context comes from `worker_context(i)`.
  Pool(PoolOptions options, detail::WorkerContextFn worker_context);

  template <class V>
  using Callback = std::function<void(const V&)>;
  using ErrorCallback = std::function<void(std::exception_ptr)>;

  /// One task of one item: `call` on `args`.
  template <class V, class Tuple>
  AsyncResult<V> apply_with(detail::PoolCall call, Tuple args, Callback<V> callback,
                            ErrorCallback error_callback) {
    auto job = submit(std::move(call), {encode_chunk<Tuple>(0, 1, [&](size_t) { return args; })},
                      &detail::unpack_values<V>);
    AsyncResult<V> result(job, &detail::decode_one<V>);
    detail::attach_callbacks<V>(job, result, std::move(callback), std::move(error_callback));
    return result;
  }
  /// `call` on get(i) for i in [0, n), in chunks; all results as one vector.
  template <class V, class Tuple, class Get>
  AsyncResult<std::vector<V>> map_with(detail::PoolCall call, size_t n, size_t chunksize, Get&& get,
                                       Callback<std::vector<V>> callback,
                                       ErrorCallback error_callback) {
    auto job =
        submit(std::move(call), encode_chunks<Tuple>(n, chunksize, get), &detail::unpack_values<V>);
    AsyncResult<std::vector<V>> result(job, &detail::decode_all<V>);
    detail::attach_callbacks<std::vector<V>>(job, result, std::move(callback),
                                             std::move(error_callback));
    return result;
  }
  /// `call` on get(i) for i in [0, n); results one by one (in order or as they complete).
  template <class V, class Tuple, class Get>
  IMapIterator<V> imap_with(detail::PoolCall call, size_t n, size_t chunksize, Get&& get,
                            bool ordered) {
    return IMapIterator<V>(
        submit(std::move(call), encode_chunks<Tuple>(n, chunksize, get), &detail::unpack_values<V>),
        ordered, [](std::any& v) { return std::any_cast<const V&>(v); });
  }
  /// Items [b, e) as one archive: the count, then get(i) as a `Tuple` for each.
  template <class Tuple, class Get>
  std::string encode_chunk(size_t b, size_t e, Get&& get) const {
    Payload p;
    {
      detail::OutputArchive ar(p, {.copy_tensor = copy_tensor_, .pass_fds = false});
      ar(static_cast<uint64_t>(e - b));
      for (size_t i = b; i < e; ++i) ar(Tuple(get(i)));
    }
    if (!p.fds.empty())
      throw Error(
          "Pool: task arguments may not carry file descriptors (queues, locks, pipes); "
          "pass those with the initializer");
    return std::move(p.bytes);
  }
  /// Items [0, n) split into chunks of `chunksize` (0: about 4 chunks a worker), encoded.
  template <class Tuple, class Get>
  std::vector<std::string> encode_chunks(size_t n, size_t chunksize, Get&& get) const {
    std::vector<std::string> chunks;
    for (auto [b, e] : detail::split_chunks(n, chunksize, size()))
      chunks.push_back(encode_chunk<Tuple>(b, e, get));
    return chunks;
  }
  /// Queues one task a chunk; `unpack` decodes a chunk's results on the manager thread.
  std::shared_ptr<detail::JobState> submit(detail::PoolCall call, std::vector<std::string> chunks,
                                           detail::JobState::Unpack unpack);

  std::unique_ptr<detail::PoolCore> core_;
  bool copy_tensor_ = false;
};

/// A Pool whose worker i holds worker_contexts[i] and calls fn(context, args...): per-worker
/// state (a model, an environment, a connection) without globals. Contexts are serialized
/// once per worker (tensors shared). Every call passes the context: `fn` takes `Ctx&`
/// first, then the item (or the tuple's elements). Pool's calls without a context are not
/// reachable through a CtxPool (it is not a Pool).
///
/// Units, errors, callbacks, safety: as the Pool method of the same name.
/// Source: machin.parallel.pool.CtxPool.
template <class Ctx>
class CtxPool : private Pool {
 public:
  /// Errors: ValueError when `worker_contexts` is empty or its size differs from a non-zero
  /// `options.processes`; else as Pool's constructor.
  CtxPool(std::vector<Ctx> worker_contexts, PoolOptions options = {})
      : CtxPool(SharedContexts{}, std::make_shared<std::vector<Ctx>>(std::move(worker_contexts)),
                std::move(options)) {}

  /// close, join, terminate, size, pids: as Pool's (machin's CtxPool has them too).
  using Pool::close;
  using Pool::join;
  using Pool::pids;
  using Pool::size;
  using Pool::terminate;

  /// fn(Ctx&, args...) in some worker, with that worker's context; the result comes later.
  ///
  /// Units, Errors, Callbacks, Safety: as Pool::apply_async.
  /// Source:  machin.parallel.pool.CtxPool.apply_async.
  template <class Fn, class... Args>
  auto apply_async(Fn fn, std::tuple<Args...> args,
                   Callback<detail::result_of_t<Fn, Ctx, Args...>> callback = {},
                   ErrorCallback error_callback = {}) {
    using V = detail::result_of_t<Fn, Ctx, Args...>;
    using Tuple = std::tuple<std::decay_t<Args>...>;
    return apply_with<V, Tuple>(ctx_call<Fn, Tuple>(fn), Tuple(std::move(args)),
                                std::move(callback), std::move(error_callback));
  }
  /// fn(Ctx&, args...) in some worker, waited for: apply_async(fn, args).get().
  ///
  /// Units, Errors, Safety: as Pool::apply. Source: machin.parallel.pool.CtxPool.apply.
  template <class Fn, class... Args>
  auto apply(Fn fn, std::tuple<Args...> args) {
    return apply_async(fn, std::move(args)).get();
  }
  /// fn(Ctx&, item) for each item; the results, in order, arrive later.
  ///
  /// Units, Errors, Callbacks, Safety: as Pool::map_async.
  /// Source:  machin.parallel.pool.CtxPool.map_async.
  template <class Fn, class T>
  auto map_async(Fn fn, const std::vector<T>& items, size_t chunksize = 0,
                 Callback<std::vector<detail::result_of_t<Fn, Ctx, T>>> callback = {},
                 ErrorCallback error_callback = {}) {
    using V = detail::result_of_t<Fn, Ctx, T>;
    using Tuple = std::tuple<std::decay_t<T>>;
    return map_with<V, Tuple>(
        ctx_call<Fn, Tuple>(fn), items.size(), chunksize, [&](size_t i) { return Tuple(items[i]); },
        std::move(callback), std::move(error_callback));
  }
  /// fn(Ctx&, item) for each item, waited for: map_async(fn, items, chunksize).get().
  ///
  /// Units, Errors, Safety: as Pool::map. Source: machin.parallel.pool.CtxPool.map.
  template <class Fn, class T>
  auto map(Fn fn, const std::vector<T>& items, size_t chunksize = 0) {
    return map_async(fn, items, chunksize).get();
  }
  /// fn(Ctx&, item) for each item; an iterator yielding the results in order.
  ///
  /// Units, Errors, Safety: as Pool::imap. Source: machin.parallel.pool.CtxPool.imap.
  template <class Fn, class T>
  auto imap(Fn fn, const std::vector<T>& items, size_t chunksize = 1) {
    using Tuple = std::tuple<std::decay_t<T>>;
    return imap_with<detail::result_of_t<Fn, Ctx, T>, Tuple>(
        ctx_call<Fn, Tuple>(fn), items.size(), chunksize, [&](size_t i) { return Tuple(items[i]); },
        true);
  }
  /// fn(Ctx&, item) for each item; an iterator yielding the results in completion order.
  ///
  /// Units, Errors, Safety: as Pool::imap.
  /// Source:  machin.parallel.pool.CtxPool.imap_unordered.
  template <class Fn, class T>
  auto imap_unordered(Fn fn, const std::vector<T>& items, size_t chunksize = 1) {
    using Tuple = std::tuple<std::decay_t<T>>;
    return imap_with<detail::result_of_t<Fn, Ctx, T>, Tuple>(
        ctx_call<Fn, Tuple>(fn), items.size(), chunksize, [&](size_t i) { return Tuple(items[i]); },
        false);
  }
  /// fn(Ctx&, a, b, ...) for each tuple; the results, in order, arrive later.
  ///
  /// Units, Errors, Callbacks, Safety: as Pool::map_async.
  /// Source:  machin.parallel.pool.CtxPool.starmap_async.
  template <class Fn, class... Args>
  auto starmap_async(Fn fn, const std::vector<std::tuple<Args...>>& items, size_t chunksize = 0,
                     Callback<std::vector<detail::result_of_t<Fn, Ctx, Args...>>> callback = {},
                     ErrorCallback error_callback = {}) {
    using V = detail::result_of_t<Fn, Ctx, Args...>;
    using Tuple = std::tuple<std::decay_t<Args>...>;
    return map_with<V, Tuple>(
        ctx_call<Fn, Tuple>(fn), items.size(), chunksize, [&](size_t i) { return Tuple(items[i]); },
        std::move(callback), std::move(error_callback));
  }
  /// fn(Ctx&, a, b, ...) for each tuple, waited for: starmap_async(...).get().
  ///
  /// Units, Errors, Safety: as Pool::map. Source: machin.parallel.pool.CtxPool.starmap.
  template <class Fn, class... Args>
  auto starmap(Fn fn, const std::vector<std::tuple<Args...>>& items, size_t chunksize = 0) {
    return starmap_async(fn, items, chunksize).get();
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
  static PoolOptions with_contexts(size_t ncontexts, PoolOptions o) {
    if (ncontexts == 0) throw ValueError("CtxPool needs one context per worker, got none");
    if (o.processes == 0) o.processes = ncontexts;
    if (o.processes != ncontexts)
      throw ValueError("CtxPool: " + std::to_string(ncontexts) + " worker contexts for " +
                       std::to_string(o.processes) + " processes");
    return o;
  }
  // The tag keeps `CtxPool<int> p({0, 1}, {...})` (machin's own test) unambiguous: without it
  // `{0, 1}` also matched shared_ptr(nullptr_t, deleter) here.
  struct SharedContexts {};
  CtxPool(SharedContexts, std::shared_ptr<std::vector<Ctx>> contexts, PoolOptions options)
      : Pool(with_contexts(contexts->size(), std::move(options)),
             [contexts](size_t i) { return dumps((*contexts)[i], {.copy_tensor = false}); }) {}
};

/// The Pool engine already feeds each worker through its own queue (so a dead worker's
/// tasks are known exactly); P2PPool is the same pool under machin's name.
/// Source: machin.parallel.pool.P2PPool.
using P2PPool = Pool;

}  // namespace torchpar
