// The loop every Pool worker process runs (pool_worker_main), and the answer records it
// stages in its AnswerStage page and sends to the results queue. The parent's side is
// pool.cpp (the manager thread) and its parts (worker_set, dispatcher, completions).
#include <c10/util/Type.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>

#include "pool/messages.h"

namespace torchpar {
namespace detail {

namespace {
std::shared_ptr<Payload> g_worker_context;
}  // namespace

const Payload& worker_context_payload() {
  static const Payload empty;
  return g_worker_context ? *g_worker_context : empty;
}

// The payload is encoded in place after the length (the archive appends to the bytes it
// finds).
std::string encode_answer(const PoolResult& r) {
  Payload p;
  uint32_t n = 0;
  p.bytes.assign(sizeof n, '\0');
  {
    OutputArchive ar(p, {});
    ar(r);
  }
  n = static_cast<uint32_t>(p.bytes.size() - sizeof n);
  std::memcpy(p.bytes.data(), &n, sizeof n);
  return std::move(p.bytes);
}

void decode_answers(std::string_view bytes, std::vector<PoolResult>& out) {
  while (!bytes.empty()) {
    uint32_t n = 0;
    if (bytes.size() < sizeof n) throw SerializationError("Pool: a truncated answer record");
    std::memcpy(&n, bytes.data(), sizeof n);
    bytes.remove_prefix(sizeof n);
    if (n > bytes.size()) throw SerializationError("Pool: a truncated answer record");
    out.push_back(loads<PoolResult>(Payload{std::string(bytes.substr(0, n)), {}}));
    bytes.remove_prefix(n);
  }
}

// `stage` is its page shared with the manager (AnswerStage).
void pool_worker_main(int index, Queue<PoolBatch> inbox, Queue<std::string> results,
                      Value<AnswerStage> stage, uint64_t maxtasks, PoolInit init,
                      WorkerContext context) {
  if (context.set) g_worker_context = context.payload;
  if (init.set) {
    auto tramp = reinterpret_cast<Trampoline>(from_code_address(init.call.tramp));
    tramp(from_code_address(init.call.fn), *init.args);
  }
  AnswerStage& page = *stage.get_obj();
  std::atomic_ref<uint64_t> begun(page.begun), staged(page.staged);
  // The last call's code addresses, resolved: resolving searches the loaded modules, and
  // batches mostly share one call.
  PoolCall resolved_call;
  TaskTrampoline tramp = nullptr;
  void* fn = nullptr;
  auto same = [](const CodeAddress& a, const CodeAddress& b) {
    return a.offset == b.offset && a.module == b.module;
  };
  auto last_send = std::chrono::steady_clock::now();
  auto send_staged = [&] {
    const uint64_t n = staged.load(std::memory_order_relaxed);
    if (n == 0) return;
    results.put(std::string(page.records, n));
    staged.store(0, std::memory_order_release);
  };
  for (uint64_t n = 0; maxtasks == 0 || n < maxtasks;) {
    // Waits as every Queue get does: spins (kSpinIterations, tens of µs), then sleeps on
    // the queue's futex. The parent's death kills us (PDEATHSIG).
    PoolBatch batch = inbox.get();
    if (batch.tasks.empty()) return;
    // The manager never sends past the maxtasksperchild budget; a batch runs whole.
    for (size_t i = 0; i < batch.tasks.size(); ++i) {
      const PoolTask& task = batch.tasks[i];
      begun.store(++n, std::memory_order_release);
      PoolResult r;
      r.job = task.job;
      r.chunk = task.chunk;
      r.worker = index;
      try {
        // Resolved in the try: a module this process lacks fails the chunk (TaskError).
        if (tramp == nullptr || !same(batch.call.tramp, resolved_call.tramp) ||
            !same(batch.call.fn, resolved_call.fn)) {
          tramp = nullptr;
          fn = from_code_address(batch.call.fn);
          tramp = reinterpret_cast<TaskTrampoline>(from_code_address(batch.call.tramp));
          resolved_call = batch.call;
        }
        r.values = tramp(fn, task.args);
      } catch (const std::exception& e) {
        r.ok = false;
        r.values.clear();
        r.type = c10::demangle(typeid(e).name());
        r.message = e.what();
      }
      const std::string rec = encode_answer(r);
      uint64_t used = staged.load(std::memory_order_relaxed);
      if (used + rec.size() > kAnswerBytes) {
        send_staged();
        used = 0;
      }
      if (rec.size() > kAnswerBytes) {
        results.put(rec);  // too large to stage: it travels alone, now
      } else {
        std::memcpy(page.records + used, rec.data(), rec.size());
        staged.store(used + rec.size(), std::memory_order_release);
      }
      const auto now = std::chrono::steady_clock::now();
      if (i + 1 == batch.tasks.size() || now - last_send >= kAnswerEvery) {
        send_staged();
        last_send = now;
      }
    }
  }
}
}  // namespace detail
}  // namespace torchpar
