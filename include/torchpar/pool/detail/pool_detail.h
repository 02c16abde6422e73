#pragma once
/// Pool's detail machinery: the task trampolines (run_chunk, run_task, run_ctx_task), the
/// decoding of a chunk's results, the call as code addresses (PoolCall, make_call), and what
/// a worker receives at launch (PoolInit, WorkerContext).
///
/// Internal: nothing here is public API (namespace torchpar::detail); it may change
/// without notice. It is an installed header only because the templates of pool.h
/// (Pool, CtxPool, initializer) instantiate it in the user's translation units; include
/// "torchpar/pool/pool.h" instead.

#include <any>
#include <cstdint>
#include <functional>
#include <memory>
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

/// Runs `call` on every argument tuple of a chunk in a worker. A chunk travels as one
/// archive (the count, then each tuple) and its results likewise (the count, then each
/// value; void as true): one header and one allocation a chunk, not one an item.
/// Results are copied, never shared: the worker may exit before the parent reads them.
template <class Tuple, class Call>
std::string run_chunk(const std::string& args, Call&& call) {
  std::vector<Tuple> items;
  load_payload(Payload{args, {}}, [&](InputArchive& in) {
    uint64_t n = 0;
    in(n);
    for (uint64_t i = 0; i < n; ++i) in(items.emplace_back());  // bounded by the bytes
  });
  // Calls run outside load_payload, whose errors all become SerializationError: a task's
  // own exception must reach the caller as itself.
  Payload out;
  OutputArchive results(out, {.copy_tensor = true});
  results(static_cast<uint64_t>(items.size()));
  for (auto& t : items) {
    using R = decltype(std::apply(call, t));
    if constexpr (std::is_void_v<R>) {
      std::apply(call, t);
      results(true);
    } else {
      results(std::apply(call, t));
    }
  }
  return std::move(out.bytes);
}

/// Runs fn(args...) for each argument tuple of a chunk, in a worker.
template <class FnPtr, class Tuple>
std::string run_task(void* fn, const std::string& args) {
  return run_chunk<Tuple>(args, reinterpret_cast<FnPtr>(fn));
}

/// The parent's side of run_chunk: a chunk's results, one std::any (holding a V) each.
/// Runs on the pool's manager thread as results arrive. Errors: SerializationError.
template <class V>
std::vector<std::any> unpack_values(const std::string& bytes) {
  std::vector<std::any> out;
  load_payload(Payload{bytes, {}}, [&](InputArchive& in) {
    uint64_t n = 0;
    in(n);
    for (uint64_t i = 0; i < n; ++i) {
      V v{};
      in(v);
      out.emplace_back(std::move(v));
    }
  });
  return out;
}

/// Every value of every chunk, in order (map / starmap results).
template <class V>
std::vector<V> decode_all(JobState& j) {
  std::vector<V> out;
  for (auto& c : j.chunks)
    for (auto& v : c.values) out.push_back(std::any_cast<const V&>(v));
  return out;
}

/// The single value of a one-item job (apply / apply_async).
template <class V>
V decode_one(JobState& j) {
  if (j.chunks.size() != 1 || j.chunks[0].values.size() != 1)
    throw SerializationError("Pool: a worker returned no value for apply");
  return std::any_cast<const V&>(j.chunks[0].values[0]);
}

struct PoolCall {  // a function and its trampoline, as code addresses
  CodeAddress tramp, fn;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(tramp, fn);
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
  Ctx& c = worker_context<Ctx>();
  return run_chunk<Tuple>(args, [&](auto&... a) { return f(c, a...); });
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
/// Serializes worker i's context (CtxPool).
using WorkerContextFn = std::function<Payload(size_t)>;

}  // namespace detail
}  // namespace torchpar
