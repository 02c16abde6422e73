// The caller's side of TensorParallel: starting the workers, sending requests, and waiting for
// the answers while watching every worker.
#include "torchpar/parallel/tensor_parallel.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include "parallel/tensor_parallel_impl.h"
#include "torchpar/core/error.h"
#include "torchpar/dist/world.h"
#include "torchpar/parallel/gpt_checkpoint.h"
#include "torchpar/process/process.h"

namespace torchpar {
namespace {

using Clock = std::chrono::steady_clock;
using Seconds = std::chrono::duration<double>;
using detail::TpRequest;
using detail::TpRequestKind;
using detail::TpResponse;

/// How long the caller blocks on one queue before it looks at the workers again: the delay
/// between a worker's death and the error.
constexpr auto kSlice = std::chrono::milliseconds(20);
/// How long an error that a rank got because of a peer (RankLostError) waits for the peer's
/// own error or death to show, so that the cause is named rather than the consequence.
constexpr auto kSecondaryGrace = std::chrono::seconds(1);

/// The longest timeout (about 115 days): steady_clock counts int64 nanoseconds, so a deadline
/// now + 1e10 s would wrap into the past.
constexpr Seconds kMaxTimeout{1e7};

/// Refuses a timeout that is NaN, infinite, <= 0 or above kMaxTimeout (naming `where`).
void check_timeout(Seconds s, const std::string& where) {
  if (!std::isfinite(s.count()) || !(s > Seconds(0)) || s > kMaxTimeout)
    throw ValueError(fmt::format("{}: timeout {} s must be finite, > 0 and at most {:g} s", where,
                                 s.count(), kMaxTimeout.count()));
}

/// Now + s, with s clamped to [0, kMaxTimeout] (NaN: 0), so that the deadline never wraps.
Clock::time_point deadline_in(Seconds s) {
  const Seconds t = std::isnan(s.count()) ? Seconds(0) : std::clamp(s, Seconds(0), kMaxTimeout);
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(t);
}

Seconds left_until(Clock::time_point deadline) {
  return std::max(Seconds(0), std::chrono::duration_cast<Seconds>(deadline - Clock::now()));
}

/// A tiny transformer's operations in `dtype`: a dtype whose CPU kernels are missing is refused
/// here, before any worker starts, naming the operation.
void check_cpu_kernels(at::ScalarType dtype) {
  if (!c10::isFloatingType(dtype))
    throw ValueError(
        fmt::format("TensorParallel: dtype {} is not a floating dtype (float32, "
                    "bfloat16, float64, float16)",
                    dtype_name(dtype)));
  const auto o = at::TensorOptions().dtype(dtype);
  const at::Tensor x = at::ones({2, 3, 8}, o);
  const at::Tensor w = at::ones({8, 8}, o);
  const at::Tensor b = at::ones({8}, o);
  const std::pair<const char*, std::function<void()>> probes[] = {
      {"linear (addmm)", [&] { (void)at::linear(x, w, b); }},
      {"layer_norm", [&] { (void)at::layer_norm(x, {8}, b, b, 1e-5); }},
      {"softmax", [&] { (void)x.softmax(-1); }},
      {"gelu", [&] { (void)at::gelu(x, "tanh"); }},
  };
  for (const auto& [op, run] : probes) {
    try {
      run();
    } catch (const c10::Error& e) {
      throw ValueError(fmt::format(
          "TensorParallel: {} weights are not supported by this LibTorch's CPU kernels: {} "
          "raised \"{}\"; use bfloat16 (2 bytes per weight too) or float32",
          dtype_name(dtype), op, e.what_without_backtrace()));
    }
  }
}

// Spawned and forkserver workers get these through exec: they must serialize.
static_assert(detail::is_serializable_v<detail::TpWorkerSpec> &&
              detail::is_serializable_v<Queue<TpRequest>> &&
              detail::is_serializable_v<Queue<TpResponse>>);

/// What went wrong with one rank, as the caller will hear it.
struct Failure {
  enum Kind { kRaised = 0, kDied = 1, kSecondary = 2 };  // lower: the likelier cause
  Kind kind = kRaised;
  int rank = -1;
  int pid = -1;
  std::string type{};
  std::string message{};
  int exit_code = 0;

  std::exception_ptr error(const std::string& where) const {
    if (kind == kDied) return std::make_exception_ptr(WorkerError(where, rank, pid, exit_code));
    return std::make_exception_ptr(WorkerError(where, rank, pid, type, message));
  }
};

}  // namespace

struct TensorParallel::Impl {
  TensorParallelOptions options;
  detail::TpWorkerSpec spec;
  /// Known for a Gpt: the caller's arguments are checked against it.
  std::optional<GptConfig> gpt_config;
  std::vector<Queue<TpRequest>> in;
  std::vector<Queue<TpResponse>> out;
  std::vector<Process> procs;
  std::mutex mu;
  uint64_t next_id = 1;
  /// step()'s running sequences: id -> positions cached in the workers.
  std::map<int64_t, int64_t> running;
  uint64_t seed = 0;
  /// The first failure (then every call rethrows it), or ClosedError after shutdown.
  std::exception_ptr broken;
  /// !broken, readable without the mutex (is_alive() during a call of another thread).
  std::atomic<bool> usable{true};
  bool stopped = false;

  ~Impl() { stop(std::chrono::seconds(10)); }

  void start(const TensorParallelFactory* factory);
  TpResponse call(TpRequest req, Timeout timeout, const std::string& where);
  TpResponse await(uint64_t id, Clock::time_point deadline, Seconds limit,
                   const std::string& where);
  void check_usable() const {
    if (broken) std::rethrow_exception(broken);
  }
  void check_ids(const at::Tensor& ids, const std::string& where, int64_t more) const;

  std::optional<Failure> read_answers(int r, uint64_t id,
                                      std::vector<std::optional<TpResponse>>& got, int& pending,
                                      Seconds wait);
  std::optional<Failure> worst_failure(uint64_t id, std::vector<std::optional<TpResponse>>& got,
                                       int& pending, std::vector<std::optional<Failure>>& known);
  [[noreturn]] void fail(std::exception_ptr e);
  void kill_all() noexcept;
  void stop(Seconds timeout) noexcept;
};

// ---- start --------------------------------------------------------------------------------------

void TensorParallel::Impl::start(const TensorParallelFactory* factory) {
  const int n = options.world_size;
  if (n < 1)
    throw ValueError(fmt::format("TensorParallel: world_size {} must be >= 1", options.world_size));
  check_timeout(options.timeout, "TensorParallel");
  const StartMethod method = options.start_method.value_or(
      factory != nullptr ? StartMethod::kFork : current_start_method());
  if (factory != nullptr && method != StartMethod::kFork)
    throw ValueError(fmt::format(
        "TensorParallel: a TensorParallelFactory needs the 'fork' start method, not '{}' (a "
        "std::function cannot cross exec): register it with register_tensor_parallel_model and "
        "pass its TensorParallelModelName instead",
        to_string(method)));
  if (options.threads_per_worker < 0)
    throw ValueError(fmt::format("TensorParallel: threads_per_worker {} must be >= 0",
                                 options.threads_per_worker));
  if (options.backend == Backend::kGloo && options.dtype == at::kBFloat16 && n > 1)
    throw ValueError(
        "TensorParallel: the gloo backend reduces no bfloat16; use Backend::kShm or kAuto (every "
        "worker is on this host)");
  check_cpu_kernels(options.dtype);
  if (gpt_config) {
    // The Gpt's own checks (heads, width and MLP width per rank), here rather than in n workers.
    arguments_per_rank(spec.has_policy ? spec.policy : gpt2_policy(*gpt_config), n);
  }

  int threads = options.threads_per_worker;
  if (threads == 0) {
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    threads = method == StartMethod::kFork ? 1 : std::max(1, cores / n);
  }
  spec.world_size = n;
  spec.dtype = static_cast<int8_t>(options.dtype);
  spec.backend = static_cast<int32_t>(options.backend);
  spec.timeout_s = options.timeout.count();
  spec.has_seed = options.seed.has_value();
  spec.seed = options.seed.value_or(0);
  if (n > 1) {
    // A private rendezvous: rank 0's store on loopback, proving a key made for this engine.
    spec.master_port = find_free_port(/*loopback_only=*/true);
    spec.authkey = random_authkey();
  }

  in.reserve(static_cast<size_t>(n));
  out.reserve(static_cast<size_t>(n));
  procs.reserve(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    // Requests are small: copied, so the caller's tensors are not moved to shared memory.
    in.emplace_back(0, QueueOptions{.copy_tensor = true});
    out.emplace_back();  // results stay in shared memory: the caller aliases rank 0's logits
  }
  for (int r = 0; r < n; ++r) {
    ProcessOptions po{.name = fmt::format("TensorParallel-rank{}", r),
                      .daemon = true,
                      .start_method = method,
                      .threads = threads};
    if (factory != nullptr) {
      procs.emplace_back(
          std::move(po),
          [f = *factory](int rank, detail::TpWorkerSpec s, Queue<TpRequest> i,
                         Queue<TpResponse> o) {
            detail::run_tensor_parallel_worker(rank, s, i, o, &f);
          },
          r, spec, in[r], out[r]);
    } else {
      procs.emplace_back(std::move(po), &detail::tensor_parallel_worker, r, spec, in[r], out[r]);
    }
    procs.back().start();
  }
  const TpResponse ready =
      await(0, deadline_in(options.timeout), options.timeout, "TensorParallel (starting)");
  seed = ready.seed;
}

// ---- waiting ------------------------------------------------------------------------------------

/// Takes rank r's answers to `id` from its queue, waiting up to `wait` for the first.
/// Returns the failure one of them reports.
std::optional<Failure> TensorParallel::Impl::read_answers(
    int r, uint64_t id, std::vector<std::optional<TpResponse>>& got, int& pending, Seconds wait) {
  const auto ri = static_cast<size_t>(r);
  for (;;) {
    TpResponse resp;
    try {
      resp = out[ri].get(wait);
    } catch (const Empty&) {
      return std::nullopt;
    } catch (const Error& e) {
      // A shared result whose sender is gone, a closed queue: the answer is lost.
      return Failure{.kind = Failure::kRaised,
                     .rank = r,
                     .pid = procs[ri].pid(),
                     .type = c10::demangle(typeid(e).name()),
                     .message = fmt::format("its answer could not be read: {}", e.what())};
    }
    wait = Seconds(0);
    if (resp.id != id) continue;  // an answer to an earlier call: not expected, dropped
    if (!resp.ok) {
      return Failure{.kind = resp.secondary ? Failure::kSecondary : Failure::kRaised,
                     .rank = r,
                     .pid = procs[ri].pid(),
                     .type = std::move(resp.type),
                     .message = std::move(resp.message)};
    }
    if (!got[ri]) {
      got[ri] = std::move(resp);
      --pending;
    }
  }
}

/// Looks at every rank now: reads what the living ones answered, and for the dead ones their
/// last answer, else the exception in their error slot, else their exit status. known[r] keeps
/// what rank r reported, so that a rank that reported a peer's death and then exited is not
/// blamed by its exit. Returns the likeliest cause: a rank's own exception first, then a death,
/// then an error a rank got because of a peer.
std::optional<Failure> TensorParallel::Impl::worst_failure(
    uint64_t id, std::vector<std::optional<TpResponse>>& got, int& pending,
    std::vector<std::optional<Failure>>& known) {
  for (size_t r = 0; r < procs.size(); ++r) {
    const int rank = static_cast<int>(r);
    const bool alive = procs[r].is_alive();
    if (!known[r] && (!alive || !got[r]))
      known[r] = read_answers(rank, id, got, pending, Seconds(0));
    if (alive || known[r]) continue;
    if (auto e = procs[r].error()) {  // it threw before it could answer
      const bool because_of_peer = e->first.find("RankLostError") != std::string::npos ||
                                   e->first.find("TimeoutError") != std::string::npos;
      known[r] = Failure{.kind = because_of_peer ? Failure::kSecondary : Failure::kRaised,
                         .rank = rank,
                         .pid = procs[r].pid(),
                         .type = e->first,
                         .message = e->second};
    } else {
      known[r] = Failure{.kind = Failure::kDied,
                         .rank = rank,
                         .pid = procs[r].pid(),
                         .exit_code = procs[r].exitcode().value_or(-1)};
    }
  }
  std::optional<Failure> worst;
  for (const auto& f : known) {
    if (f && (!worst || f->kind < worst->kind)) worst = f;
  }
  return worst;
}

TpResponse TensorParallel::Impl::await(uint64_t id, Clock::time_point deadline, Seconds limit,
                                       const std::string& where) {
  const int n = static_cast<int>(procs.size());
  std::vector<std::optional<TpResponse>> got(static_cast<size_t>(n));
  std::vector<std::optional<Failure>> known(static_cast<size_t>(n));
  int pending = n;
  std::optional<Clock::time_point> secondary_until;
  for (;;) {
    // Block on the first rank still owing an answer, briefly; then look at everyone.
    size_t first = 0;
    while (first < got.size() && (got[first] || known[first])) ++first;
    if (first < got.size()) {
      known[first] = read_answers(static_cast<int>(first), id, got, pending,
                                  std::min<Seconds>(kSlice, left_until(deadline)));
    }
    const std::optional<Failure> f = worst_failure(id, got, pending, known);
    if (!f && pending == 0) return std::move(*got[0]);
    if (f && f->kind != Failure::kSecondary) fail(f->error(where));
    const auto now = Clock::now();
    if (f && !secondary_until) secondary_until = std::min(deadline, now + kSecondaryGrace);
    if (f && now >= *secondary_until) fail(f->error(where));
    if (now >= deadline) {
      std::vector<int> missing;
      for (int r = 0; r < n; ++r) {
        if (!got[static_cast<size_t>(r)]) missing.push_back(r);
      }
      fail(std::make_exception_ptr(TimeoutError(fmt::format(
          "{}: no answer from rank(s) {} within {:.1f} s; the engine is broken (its workers "
          "were killed)",
          where, fmt::join(missing, ", "), limit.count()))));
    }
    if (first == got.size()) {
      // Every rank answered or failed, and only because of a peer: wait for the peer to show.
      std::this_thread::sleep_for(kSlice);
    }
  }
}

TpResponse TensorParallel::Impl::call(TpRequest req, Timeout timeout, const std::string& where) {
  const Seconds limit = timeout.value_or(options.timeout);
  check_timeout(limit, where);
  req.id = next_id++;
  const auto deadline = deadline_in(limit);
  for (auto& q : in) {
    try {
      q.put(req, left_until(deadline));
    } catch (const Full&) {
      fail(std::make_exception_ptr(TimeoutError(
          fmt::format("{}: a worker's request queue stayed full for {:.1f} s; the engine is broken",
                      where, limit.count()))));
    }
  }
  return await(req.id, deadline, limit, where);
}

void TensorParallel::Impl::fail(std::exception_ptr e) {
  broken = e;
  usable = false;
  kill_all();
  std::rethrow_exception(e);
}

// ---- stopping -----------------------------------------------------------------------------------

void TensorParallel::Impl::kill_all() noexcept {
  for (auto& p : procs) {
    try {
      if (p.pid() <= 0) continue;
      p.kill();
      p.join(std::chrono::seconds(5));  // SIGKILL: bounded unless stuck in the kernel
    } catch (...) {
    }
  }
}

void TensorParallel::Impl::stop(Seconds timeout) noexcept {
  if (stopped) return;
  stopped = true;
  try {
    broken = std::make_exception_ptr(ClosedError("TensorParallel: the engine was shut down"));
    usable = false;
    TpRequest stop_request;
    stop_request.kind = static_cast<int32_t>(TpRequestKind::kStop);
    for (size_t r = 0; r < procs.size(); ++r) {
      try {
        if (procs[r].pid() > 0 && procs[r].is_alive()) in[r].put(stop_request, Seconds(0.5));
      } catch (...) {
      }
    }
    const auto deadline = deadline_in(timeout);
    for (auto& p : procs) {
      try {
        if (p.pid() > 0) p.join(left_until(deadline));
      } catch (...) {
      }
    }
    bool any = false;
    for (auto& p : procs) {
      try {
        if (p.pid() > 0 && p.is_alive()) {
          p.terminate();
          any = true;
        }
      } catch (...) {
      }
    }
    if (any) {
      const auto grace = deadline_in(std::chrono::seconds(1));
      for (auto& p : procs) {
        try {
          if (p.pid() > 0) p.join(left_until(grace));
        } catch (...) {
        }
      }
    }
    kill_all();  // no-op for the reaped ones
    for (auto& q : in) q.close();
    for (auto& q : out) q.close();
  } catch (...) {
  }
}

// ---- arguments ----------------------------------------------------------------------------------

void TensorParallel::Impl::check_ids(const at::Tensor& ids, const std::string& where,
                                     int64_t more) const {
  if (!ids.defined() || ids.dim() != 2 || ids.scalar_type() != at::kLong || ids.numel() == 0 ||
      !ids.device().is_cpu())
    throw ValueError(fmt::format(
        "{}: input ids must be a non-empty int64 CPU tensor [batch, tokens], got {}", where,
        ids.defined() ? fmt::format("{} {} [{}]", ids.device().str(), dtype_name(ids.scalar_type()),
                                    fmt::join(ids.sizes(), ", "))
                      : std::string("an undefined tensor")));
  if (!gpt_config) return;
  const int64_t lo = ids.min().item<int64_t>();
  const int64_t hi = ids.max().item<int64_t>();
  if (lo < 0 || hi >= gpt_config->vocab_size)
    throw ValueError(fmt::format("{}: token ids span [{}, {}], outside the vocabulary [0, {})",
                                 where, lo, hi, gpt_config->vocab_size));
  if (ids.size(1) + more > gpt_config->n_positions)
    throw ValueError(fmt::format(
        "{}: {} prompt tokens + {} new ones exceed the model's {} positions (n_positions)", where,
        ids.size(1), more, gpt_config->n_positions));
}

// ---- TensorParallel -----------------------------------------------------------------------------

namespace {

std::unique_ptr<TensorParallel::Impl> gpt_impl(const std::string& path, const GptConfig& config,
                                               std::optional<TensorParallelPolicy> sidecar_policy,
                                               TensorParallelOptions options) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw ValueError(fmt::format("TensorParallel: '{}' is not a file", path));
  auto m = std::make_unique<TensorParallel::Impl>();
  m->spec.source = static_cast<int32_t>(detail::TpSource::kGptFile);
  m->spec.path = std::filesystem::absolute(path).string();  // workers may not share our cwd
  m->spec.set_gpt_config(config);
  if (options.policy) sidecar_policy = options.policy;
  if (sidecar_policy) {
    m->spec.has_policy = true;
    m->spec.policy = std::move(*sidecar_policy);
  }
  m->spec.vocab_parallel = options.vocab_parallel;
  m->gpt_config = config;
  m->options = std::move(options);
  return m;
}

}  // namespace

TensorParallel::TensorParallel(const std::string& model_path, TensorParallelOptions options) {
  const GptCheckpointInfo info = load_gpt_checkpoint_info(model_path);
  impl_ = gpt_impl(model_path, info.config, info.policy(), std::move(options));
  impl_->start(nullptr);
}

TensorParallel::TensorParallel(const std::string& state_dict_path, const GptConfig& config,
                               TensorParallelOptions options)
    : impl_(gpt_impl(state_dict_path, config, std::nullopt, std::move(options))) {
  impl_->start(nullptr);
}

TensorParallel::TensorParallel(const TensorParallelModelName& model, TensorParallelOptions options)
    : impl_(std::make_unique<Impl>()) {
  if (!detail::find_tensor_parallel_model(model.name))
    throw ValueError(fmt::format(
        "TensorParallel: no model is registered as '{}' (register_tensor_parallel_model, at "
        "namespace scope or in main() before torchpar::init)",
        model.name));
  impl_->spec.source = static_cast<int32_t>(detail::TpSource::kRegistered);
  impl_->spec.model_name = model.name;
  impl_->spec.model_argument = model.argument;
  impl_->options = std::move(options);
  impl_->start(nullptr);
}

namespace {
TensorParallelOptions in_memory_options(TensorParallelOptions options) {
  if (!options.start_method) options.start_method = StartMethod::kFork;
  if (*options.start_method != StartMethod::kFork)
    throw ValueError(
        "TensorParallel(model): a Gpt in memory reaches the workers only through fork (start "
        "method 'fork'); for spawn or forkserver save it with save_gpt_checkpoint and use "
        "TensorParallel(model_path)");
  return options;
}
}  // namespace

TensorParallel::TensorParallel(GptImpl& model, TensorParallelOptions options)
    : TensorParallel(gpt_tensor_parallel_factory(model, options.vocab_parallel),
                     in_memory_options(options)) {}

TensorParallel::TensorParallel(TensorParallelFactory factory, TensorParallelOptions options)
    : impl_(std::make_unique<Impl>()) {
  if (!factory) throw ValueError("TensorParallel: the factory is empty");
  impl_->spec.source = static_cast<int32_t>(detail::TpSource::kFactory);
  impl_->options = std::move(options);
  impl_->start(&factory);
}

TensorParallel::TensorParallel(TensorParallel&&) noexcept = default;
TensorParallel& TensorParallel::operator=(TensorParallel&&) noexcept = default;
TensorParallel::~TensorParallel() = default;  // Impl's destructor stops the workers

at::Tensor TensorParallel::forward(const at::Tensor& input_ids, const ForwardOptions& options) {
  const std::string where = "TensorParallel.forward";
  auto& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  m.check_usable();
  m.check_ids(input_ids, where, 0);
  TpRequest req;
  req.kind = static_cast<int32_t>(TpRequestKind::kForward);
  req.input_ids = input_ids.contiguous();
  return m.call(std::move(req), options.timeout, where).result;
}

at::Tensor TensorParallel::generate(const at::Tensor& prompt_ids, const GenerateOptions& options) {
  const std::string where = "TensorParallel.generate";
  auto& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  m.check_usable();
  if (options.max_new_tokens < 0 || !(options.temperature >= 0) ||
      !std::isfinite(options.temperature) || options.top_k < 0)
    throw ValueError(fmt::format(
        "{}: max_new_tokens {} and top_k {} must be >= 0, temperature {} finite and >= 0", where,
        options.max_new_tokens, options.top_k, options.temperature));
  m.check_ids(prompt_ids, where, options.max_new_tokens);
  TpRequest req;
  req.kind = static_cast<int32_t>(TpRequestKind::kGenerate);
  req.input_ids = prompt_ids.contiguous();
  req.max_new_tokens = options.max_new_tokens;
  req.temperature = options.temperature;
  req.top_k = options.top_k;
  req.greedy = options.greedy;
  req.has_seed = options.seed.has_value();
  req.seed = options.seed.value_or(0);
  return m.call(std::move(req), options.timeout, where).result;
}

StepResult TensorParallel::step(const std::vector<StepJoin>& join,
                                const std::vector<int64_t>& leave, const StepOptions& options) {
  const std::string where = "TensorParallel.step";
  auto& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  m.check_usable();
  // Every check before anything is sent: a refused step leaves the batch as it was.
  std::set<int64_t> leaving;
  for (const int64_t id : leave) {
    if (!m.running.contains(id) || !leaving.insert(id).second)
      throw ValueError(fmt::format("{}: sequence {} to leave is {}", where, id,
                                   m.running.contains(id) ? "named twice" : "not running"));
  }
  if (m.gpt_config) {
    for (const auto& [id, positions] : m.running) {
      if (!leaving.contains(id) && positions >= m.gpt_config->n_positions)
        throw ValueError(fmt::format(
            "{}: sequence {} holds {} positions, the model's context (n_positions): it cannot "
            "continue; name it in leave",
            where, id, positions));
    }
  }
  std::set<int64_t> joining;
  TpRequest req;
  req.kind = static_cast<int32_t>(TpRequestKind::kStep);
  req.leave = leave;
  std::vector<int64_t> lengths;
  for (const auto& j : join) {
    if ((m.running.contains(j.id) && !leaving.contains(j.id)) || !joining.insert(j.id).second)
      throw ValueError(fmt::format("{}: sequence {} to join is already {}", where, j.id,
                                   joining.contains(j.id) ? "joining" : "running"));
    if (!(j.temperature >= 0) || !std::isfinite(j.temperature) || j.top_k < 0)
      throw ValueError(
          fmt::format("{}: sequence {}: top_k {} must be >= 0, temperature {} finite and >= 0",
                      where, j.id, j.top_k, j.temperature));
    const at::Tensor p = j.prompt_ids.defined() && j.prompt_ids.dim() == 1
                             ? j.prompt_ids.view({1, -1})
                             : j.prompt_ids;
    m.check_ids(p, fmt::format("{}: sequence {}", where, j.id), 0);
    if (p.size(0) != 1)
      throw ValueError(
          fmt::format("{}: sequence {}: prompt_ids must be [tokens] or [1, tokens]", where, j.id));
    const at::Tensor flat = p.contiguous();
    req.join_tokens.insert(req.join_tokens.end(), flat.data_ptr<int64_t>(),
                           flat.data_ptr<int64_t>() + flat.numel());
    lengths.push_back(p.size(1));
    req.join.push_back(detail::TpJoin{.id = j.id,
                                      .length = p.size(1),
                                      .temperature = j.temperature,
                                      .top_k = j.top_k,
                                      .greedy = j.greedy || j.temperature == 0,
                                      .has_seed = j.seed.has_value(),
                                      .seed = j.seed.value_or(0)});
  }
  for (const int64_t id : leave) m.running.erase(id);  // gone from the workers either way
  if (m.running.empty() && join.empty() && leave.empty()) return {};
  const std::vector<int64_t> pairs = m.call(std::move(req), options.timeout, where).values;
  for (auto& [id, positions] : m.running) ++positions;  // the previous token is now cached
  for (size_t i = 0; i < join.size(); ++i) m.running[join[i].id] = lengths[i];
  StepResult out;
  for (size_t i = 0; i + 1 < pairs.size(); i += 2) {
    out.ids.push_back(pairs[i]);
    out.tokens.push_back(pairs[i + 1]);
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> TensorParallel::running() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return {impl_->running.begin(), impl_->running.end()};
}

void TensorParallel::shutdown(std::chrono::duration<double> timeout) noexcept {
  if (!impl_) return;
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->stop(timeout);
}

int TensorParallel::world_size() const { return impl_->options.world_size; }
uint64_t TensorParallel::seed() const { return impl_->seed; }

std::vector<int> TensorParallel::pids() const {
  std::vector<int> out;
  for (const auto& p : impl_->procs) out.push_back(p.pid());
  return out;
}

bool TensorParallel::is_alive() const { return impl_ && impl_->usable; }

}  // namespace torchpar
