// RPC between two processes on this host: torchpar's RpcGroup calling functions registered
// by name (rpc_sync / rpc_async). The peer, torch.distributed.rpc with its TensorPipe backend,
// runs from bench/peers/python_rpc.py; bench/run_bench.py (`torchpar bench`, section rpc)
// runs both side by side and prints ratios.
//
// This program is rank 0 ("caller") of a 2-rank World on 127.0.0.1; before its first
// benchmark it forks rank 1 ("callee"), both join one RpcGroup, and every benchmark reuses
// it (the callee only serves calls, on its RPC thread pool). An iteration is one batch of N
// calls, timed in the caller; a warm-up batch (100 calls, 20 of 1 MiB) runs first, and every
// reply is checked.
//   BM_RpcSyncTiny                rpc_sync<int>(callee, "add", {i, 1}): two ints, one back
//   BM_RpcSyncTensor1M/shared:0   rpc_sync<float>(callee, "first_element", {t}), t a fresh
//                                 at::full({262144}, i) each call (1 MiB float32, its
//                                 creation timed too); the reply is one float, so this is
//                                 the 1 MiB transfer
//   BM_RpcSyncTensor1M/shared:1   the same with one tensor moved to torchpar shared memory
//                                 (share_memory_) before the loop, t[0] = i before each
//                                 call: it travels as a handle
//   BM_RpcAsyncInFlight64         rpc_async<int>(callee, "add") keeping 64 calls outstanding
//                                 (waits for the oldest before issuing the 65th)
// The transport's limit: TensorPipe's own API, no torchpar in between, between this process
// and a spawned echo peer ("raw_peer"), both with the uv and shm transports and the basic and
// cma channels (shm and cma chosen on one host: what torchpar's transport uses between two
// members of one host, its TensorPipe shm half):
//   BM_RawTensorPipeTiny          an 8-byte payload there, a 4-byte payload back (what
//                                 add(int, int) carries, without framing or serialization)
//   BM_RawTensorPipeTensor1M      a fresh at::full({262144}, i) each call as a TensorPipe
//                                 tensor (its creation timed too, as in BM_RpcSyncTensor1M);
//                                 the peer reads it into one reused buffer and answers its
//                                 first 4 bytes
// A raw round trip ends when the reply is read and the request's write has completed.
// Round trips report the counter us_per_call = the median batch time / N; the in-flight
// benchmark reports items_per_second (calls/s).
//   rpc_bench [--calls N] [--tensor-calls N] [Google Benchmark flags]
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <tensorpipe/tensorpipe.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "support/bench_main.h"
#include "torchpar/core/auth.h"
#include "torchpar/dist/world.h"
#include "torchpar/ipc/connection.h"
#include "torchpar/process/process.h"
#include "torchpar/process/start_method.h"
#include "torchpar/rpc/rpc_group.h"
#include "torchpar/shm/share.h"

namespace tp = torchpar;
using namespace std::chrono_literals;

namespace {

int64_t g_calls = 2000;        // calls per tiny or in-flight batch (--calls)
int64_t g_tensor_calls = 200;  // calls per 1 MiB batch (--tensor-calls)
constexpr int64_t kWarmup = 100;
constexpr int64_t kWarmupTensor = 20;
constexpr int64_t kNumel = 262144;  // float32: 1 MiB
constexpr size_t kInFlight = 64;
constexpr auto kWait = 60s;  // rendezvous and stop bound; every call has RPC's 60 s timeout
const std::string kCaller = "caller", kCallee = "callee", kGroup = "rpc_bench";

// Functions by name: registered in both processes (static initializers of this binary).
const bool kAdd = tp::register_function(
    "add", +[](int a, int b) { return a + b; });
const bool kFirstElement = tp::register_function(
    "first_element", +[](at::Tensor t) { return t.data_ptr<float>()[0]; });

/// `key`: the job's key, fresh per run (Session makes it, as `torchpar run` does per job).
tp::WorldOptions world_options(int rank, int port, tp::AuthKey key) {
  return tp::WorldOptions{.name = rank == 0 ? kCaller : kCallee,
                          .rank = rank,
                          .world_size = 2,
                          .master_addr = "127.0.0.1",
                          .master_port = port,
                          .timeout = kWait,
                          .authkey = std::move(key)};
}

/// Rank 1: joins the group and serves calls until the caller says stop (or is gone).
void callee_main(int port, tp::AuthKey key, tp::Connection ctl) {
  tp::World world(world_options(1, port, std::move(key)));
  tp::RpcGroup group = world.create_rpc_group(kGroup, {kCaller, kCallee});
  // Unbounded: the stop message or EOF ends it, and this child dies with its parent anyway.
  try {
    (void)ctl.recv<int64_t>();
  } catch (const tp::ClosedError&) {  // the caller is gone
  }
  group.destroy();
}

/// The caller's World and group plus the callee process, made once for every benchmark.
/// Lifetime: close() (or the destructor) leaves the group, stops the callee (killed after
/// 10 s) and then leaves the World, whose store this process hosts.
class Session {
 public:
  Session() : Session(tp::find_free_port(), tp::random_authkey(), tp::Pipe()) {}
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  ~Session() { close(); }

  tp::RpcGroup& group() { return group_; }

  void close() noexcept {
    if (closed_) return;
    closed_ = true;
    try {
      group_.destroy();
    } catch (const std::exception&) {  // the callee is stopped below either way
    }
    try {
      ctl_.send(int64_t{0});
      if (!callee_.join(10s)) {
        callee_.kill();
        callee_.join(10s);
      }
    } catch (const std::exception&) {
    }
    world_.reset();
  }

 private:
  static tp::ProcessOptions callee_options() {
    tp::ProcessOptions o;
    o.name = kCallee;
    o.start_method = tp::StartMethod::kFork;  // before this process starts any thread of RPC
    o.daemon = true;                          // killed with its Process object on failure
    return o;
  }

  Session(int port, const tp::AuthKey& key, std::pair<tp::Connection, tp::Connection> pipe)
      : ctl_(std::move(pipe.first)),
        callee_(callee_options(), callee_main, port, key, std::move(pipe.second)) {
    callee_.start();
    world_.emplace(world_options(0, port, key));
    group_ = world_->create_rpc_group(kGroup, {kCaller, kCallee});
  }

  tp::Connection ctl_;
  tp::Process callee_;
  std::optional<tp::World> world_;
  tp::RpcGroup group_;
  bool closed_ = false;
};

std::unique_ptr<Session> g_session;
std::string g_session_error;  // why the session could not start (tried once)

tp::RpcGroup& rpc_group() {
  if (!g_session && g_session_error.empty()) {
    try {
      g_session = std::make_unique<Session>();
    } catch (const std::exception& e) {
      g_session_error = e.what();
    }
  }
  if (!g_session) throw std::runtime_error("setup failed: " + g_session_error);
  return g_session->group();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

/// Runs `warmup` calls of call(i), then each iteration as a batch of n calls; reports
/// us_per_call (the median batch time / n) and items_per_second.
template <class Call>
void timed_batches(benchmark::State& state, int64_t n, int64_t warmup, const Call& call) {
  for (int64_t i = 0; i < warmup; ++i) call(i);
  std::vector<double> seconds;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < n; ++i) call(i);
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  state.SetItemsProcessed(state.iterations() * n);
  if (!seconds.empty())
    state.counters["us_per_call"] = median(std::move(seconds)) / static_cast<double>(n) * 1e6;
}

void BM_RpcSyncTiny(benchmark::State& state) {
  try {
    tp::RpcGroup& g = rpc_group();
    timed_batches(state, g_calls, kWarmup, [&](int64_t i) {
      const int a = static_cast<int>(i);
      const int got = g.rpc_sync<int>(kCallee, "add", std::tuple{a, 1});
      if (got != a + 1) throw std::runtime_error(fmt::format("add({}, 1) returned {}", a, got));
    });
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void BM_RpcSyncTensor1M(benchmark::State& state) {
  try {
    tp::RpcGroup& g = rpc_group();
    const bool shared = state.range(0) != 0;
    at::Tensor resent;
    if (shared) {
      resent = at::zeros({kNumel});
      tp::share_memory_(resent);
    }
    timed_batches(state, g_tensor_calls, kWarmupTensor, [&](int64_t i) {
      const auto v = static_cast<float>(i);
      at::Tensor t;
      if (shared) {
        resent.data_ptr<float>()[0] = v;
        t = resent;
      } else {
        t = at::full({kNumel}, v);
      }
      const float got = g.rpc_sync<float>(kCallee, "first_element", std::tuple{t});
      if (got != v) throw std::runtime_error(fmt::format("first_element: {}, want {}", got, v));
    });
    state.SetBytesProcessed(state.iterations() * g_tensor_calls * kNumel *
                            static_cast<int64_t>(sizeof(float)));
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void BM_RpcAsyncInFlight64(benchmark::State& state) {
  try {
    tp::RpcGroup& g = rpc_group();
    auto batch = [&](int64_t n) {
      std::deque<std::pair<int, tp::RpcFuture<int>>> pending;
      auto retire = [&] {
        const auto& [j, f] = pending.front();
        const int got = f.wait();  // bounded by the call's own timeout
        if (got != j + 1) throw std::runtime_error(fmt::format("add({}, 1) returned {}", j, got));
        pending.pop_front();
      };
      for (int64_t i = 0; i < n; ++i) {
        if (pending.size() == kInFlight) retire();
        const int a = static_cast<int>(i);
        pending.emplace_back(a, g.rpc_async<int>(kCallee, "add", std::tuple{a, 1}));
      }
      while (!pending.empty()) retire();
    };
    batch(kWarmup);
    for (auto _ : state) batch(g_calls);
    state.SetItemsProcessed(state.iterations() * g_calls);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

// ---- raw TensorPipe: the transport's limit -------------------------------------------------

constexpr size_t kRawRequestBytes = 8;  // two ints, as add(int, int) takes
constexpr size_t kRawReplyBytes = 4;    // one int, or one float
constexpr size_t kRawMaxRequestBytes = 64;
constexpr size_t kRawTensorBytes = kNumel * sizeof(float);

/// A TensorPipe context as create_tensorpipe_transport sets up its own: uv (TCP) always, shm
/// with a peer in this network namespace, channels cma and basic (TensorPipe uses the highest
/// priority both sides offer, so shm and cma here, as create_transport's shm half uses).
std::shared_ptr<tensorpipe::Context> raw_context(const std::string& name) {
  auto ctx = std::make_shared<tensorpipe::Context>(tensorpipe::ContextOptions().name(name));
  ctx->registerTransport(0, "uv", tensorpipe::transport::uv::create());
  ctx->registerTransport(100, "shm", tensorpipe::transport::shm::create());
  ctx->registerChannel(0, "basic", tensorpipe::channel::basic::create());
  ctx->registerChannel(100, "cma", tensorpipe::channel::cma::create());
  return ctx;
}

tensorpipe::Message::Payload raw_payload(void* data, size_t length) {
  tensorpipe::Message::Payload payload;
  payload.data = data;
  payload.length = length;
  return payload;
}

/// Completions reported by TensorPipe's callbacks (its loop thread) and waited for by one
/// other thread. The first error wins; nothing here throws on the loop thread.
class RawOutcome {
 public:
  void done() {
    std::lock_guard<std::mutex> lock(mu_);
    ++done_;
    cv_.notify_all();
  }
  void fail(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.empty()) error_ = why.empty() ? "unknown TensorPipe error" : why;
    cv_.notify_all();
  }
  /// Waits until done() ran `n` times. Errors: std::runtime_error naming `what` on the first
  /// fail() or after kWait.
  void wait(int n, const char* what) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, kWait, [&] { return !error_.empty() || done_ >= n; })) {
      throw std::runtime_error(fmt::format("{}: nothing within {} s", what, kWait.count()));
    }
    if (!error_.empty()) throw std::runtime_error(fmt::format("{}: {}", what, error_));
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int done_ = 0;
  std::string error_;
};

/// The peer's side of one pipe: reads each request and answers it with 4 bytes (the first
/// of the tensor when one came, else of the payload), until the pipe ends. Keeps itself
/// alive through the callbacks it has armed; the context's close ends them.
class RawEcho : public std::enable_shared_from_this<RawEcho> {
 public:
  explicit RawEcho(std::shared_ptr<tensorpipe::Pipe> pipe) : pipe_(std::move(pipe)) {}

  void read_next() {
    pipe_->readDescriptor(
        [self = shared_from_this()](const tensorpipe::Error& error, tensorpipe::Descriptor d) {
          if (!error) self->on_request(d);  // an error: the caller closed, or we stop
        });
  }

 private:
  void on_request(const tensorpipe::Descriptor& d) {
    const bool tensor = !d.tensors.empty();
    if (d.payloads.size() != 1 || d.payloads[0].length < kRawReplyBytes ||
        d.payloads[0].length > kRawMaxRequestBytes || d.tensors.size() > 1 ||
        (tensor &&
         (d.tensors[0].length < kRawReplyBytes || d.tensors[0].length > kRawTensorBytes))) {
      pipe_->close();  // not this benchmark's request: its sender then sees a TensorPipe error
      return;
    }
    request_.resize(d.payloads[0].length);
    tensorpipe::Allocation allocation;
    allocation.payloads.push_back({.data = request_.data()});
    if (tensor) {
      tensor_.resize(d.tensors[0].length);  // one buffer, reused: the transport's limit
      allocation.tensors.push_back({.buffer = tensorpipe::CpuBuffer{.ptr = tensor_.data()}});
    }
    pipe_->read(std::move(allocation),
                [self = shared_from_this(), tensor](const tensorpipe::Error& error) {
                  if (!error) self->reply(tensor);
                });
  }

  void reply(bool tensor) {
    // Owned by the write's callback: TensorPipe reads it until that runs.
    auto out =
        std::make_shared<std::string>(tensor ? tensor_.data() : request_.data(), kRawReplyBytes);
    tensorpipe::Message message;
    message.payloads.push_back(raw_payload(out->data(), out->size()));
    pipe_->write(std::move(message), [out](const tensorpipe::Error&) {});
    read_next();
  }

  std::shared_ptr<tensorpipe::Pipe> pipe_;
  std::string request_;
  std::vector<char> tensor_;
};

/// The raw peer (spawned): listens on 127.0.0.1 (and an abstract shm socket), sends its uv
/// address on `ctl`, answers the first pipe that connects until the caller says stop (or is
/// gone). Like torchpar's transport, TensorPipe's listener stays open for the pipe's side
/// connections; it accepts no second pipe.
void raw_peer_main(tp::Connection ctl) {
  auto ctx = raw_context("raw_peer");
  std::string error;
  try {
    auto listener = ctx->listen({"uv://127.0.0.1:0", "shm://"});
    auto accepted = std::make_shared<RawOutcome>();
    listener->accept(
        [accepted](const tensorpipe::Error& e, std::shared_ptr<tensorpipe::Pipe> pipe) {
          if (e) return accepted->fail(e.what());
          std::make_shared<RawEcho>(std::move(pipe))->read_next();
          accepted->done();
        });
    ctl.send("uv://" + listener->address("uv"));
    accepted->wait(1, "raw_peer: accepting the caller's pipe");
    try {
      (void)ctl.recv<int64_t>();        // unbounded: the stop message or EOF ends it
    } catch (const tp::ClosedError&) {  // the caller is gone
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  ctx->close();  // closes the listener and the pipe: every armed callback runs, with an error
  ctx->join();
  if (!error.empty()) throw std::runtime_error(error);
}

/// The caller's context and pipe plus the raw peer process, made on first use. Lifetime:
/// close() (or the destructor) stops the peer (killed after 10 s), then closes the context.
class RawSession {
 public:
  RawSession() : RawSession(tp::Pipe()) {}
  RawSession(const RawSession&) = delete;
  RawSession& operator=(const RawSession&) = delete;
  ~RawSession() { close(); }

  /// One round trip: `request` as a payload, and `tensor`'s bytes as a TensorPipe tensor
  /// when it is defined (CPU, contiguous); returns the reply's bytes. Returns once the reply
  /// is read and TensorPipe is done with the request (its write completed); the request's
  /// buffers are held until then, also when it throws.
  /// Errors: std::runtime_error on a TensorPipe error or after kWait.
  std::string round_trip(std::string request, at::Tensor tensor) {
    struct Call {
      RawOutcome outcome;
      std::string reply;
    };
    auto call = std::make_shared<Call>();
    auto held =
        std::make_shared<std::pair<std::string, at::Tensor>>(std::move(request), std::move(tensor));
    tensorpipe::Message message;
    message.payloads.push_back(raw_payload(held->first.data(), held->first.size()));
    if (held->second.defined()) {
      tensorpipe::Message::Tensor t;
      t.buffer = tensorpipe::CpuBuffer{.ptr = held->second.data_ptr()};
      t.length = static_cast<size_t>(held->second.nbytes());
      message.tensors.push_back(std::move(t));
    }
    pipe_->write(std::move(message), [call, held](const tensorpipe::Error& error) {
      if (error) return call->outcome.fail(error.what());
      call->outcome.done();
    });
    pipe_->readDescriptor(
        [call, pipe = pipe_](const tensorpipe::Error& error, tensorpipe::Descriptor d) {
          if (error) return call->outcome.fail(error.what());
          if (d.payloads.size() != 1 || !d.tensors.empty() ||
              d.payloads[0].length > kRawMaxRequestBytes) {
            return call->outcome.fail("the reply is not one small payload");
          }
          call->reply.resize(d.payloads[0].length);
          tensorpipe::Allocation allocation;
          allocation.payloads.push_back({.data = call->reply.data()});
          pipe->read(std::move(allocation), [call](const tensorpipe::Error& e) {
            if (e) return call->outcome.fail(e.what());
            call->outcome.done();
          });
        });
    call->outcome.wait(2, "raw TensorPipe round trip");
    return call->reply;
  }

  void close() noexcept {
    if (closed_) return;
    closed_ = true;
    try {
      ctl_.send(int64_t{0});
      if (!peer_.join(10s)) {
        peer_.kill();
        peer_.join(10s);
      }
    } catch (const std::exception&) {
    }
    if (ctx_) {
      ctx_->close();
      ctx_->join();
    }
  }

 private:
  static tp::ProcessOptions peer_options() {
    tp::ProcessOptions o;
    o.name = "raw_peer";
    // Spawned (exec'd): this process may already run TensorPipe's and RPC's threads.
    o.start_method = tp::StartMethod::kSpawn;
    o.daemon = true;  // killed with its Process object on failure
    return o;
  }

  explicit RawSession(std::pair<tp::Connection, tp::Connection> pipe)
      : ctl_(std::move(pipe.first)), peer_(peer_options(), raw_peer_main, std::move(pipe.second)) {
    peer_.start();
    const auto url = ctl_.recv<std::string>(kWait);
    ctx_ = raw_context("raw_caller");
    pipe_ = ctx_->connect(url);
  }

  tp::Connection ctl_;
  tp::Process peer_;
  std::shared_ptr<tensorpipe::Context> ctx_;
  std::shared_ptr<tensorpipe::Pipe> pipe_;
  bool closed_ = false;
};

std::unique_ptr<RawSession> g_raw;
std::string g_raw_error;  // why the raw session could not start (tried once)

RawSession& raw_session() {
  if (!g_raw && g_raw_error.empty()) {
    try {
      g_raw = std::make_unique<RawSession>();
    } catch (const std::exception& e) {
      g_raw_error = e.what();
    }
  }
  if (!g_raw) throw std::runtime_error("raw setup failed: " + g_raw_error);
  return *g_raw;
}

void BM_RawTensorPipeTiny(benchmark::State& state) {
  try {
    RawSession& raw = raw_session();
    timed_batches(state, g_calls, kWarmup, [&](int64_t i) {
      const int32_t a[2] = {static_cast<int32_t>(i), 1};
      std::string request(reinterpret_cast<const char*>(a), kRawRequestBytes);
      const std::string got = raw.round_trip(std::move(request), at::Tensor());
      int32_t back = 0;
      if (got.size() == sizeof(back)) std::memcpy(&back, got.data(), sizeof(back));
      if (got.size() != sizeof(back) || back != a[0])
        throw std::runtime_error(fmt::format("raw echo of {}: {} bytes", a[0], got.size()));
    });
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void BM_RawTensorPipeTensor1M(benchmark::State& state) {
  try {
    RawSession& raw = raw_session();
    timed_batches(state, g_tensor_calls, kWarmupTensor, [&](int64_t i) {
      const auto v = static_cast<float>(i);
      const std::string got =
          raw.round_trip(std::string(kRawRequestBytes, '\0'), at::full({kNumel}, v));
      float back = 0;
      if (got.size() == sizeof(back)) std::memcpy(&back, got.data(), sizeof(back));
      if (got.size() != sizeof(back) || back != v)
        throw std::runtime_error(fmt::format("raw 1 MiB: first element {}, want {}", back, v));
    });
    state.SetBytesProcessed(state.iterations() * g_tensor_calls * kNumel *
                            static_cast<int64_t>(sizeof(float)));
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

}  // namespace

BENCHMARK(BM_RpcSyncTiny)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_RpcSyncTensor1M)
    ->ArgName("shared")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_RpcAsyncInFlight64)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_RawTensorPipeTiny)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_RawTensorPipeTensor1M)->Unit(benchmark::kMillisecond)->UseRealTime();

int main(int argc, char** argv) {
  return tp::bench::run_benchmarks(
      argc, argv, {{"--calls", &g_calls}, {"--tensor-calls", &g_tensor_calls}}, [] {
        g_session.reset();  // stops the callee
        g_raw.reset();      // and the raw peer
      });
}
