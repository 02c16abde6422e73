// The worker side of TensorParallel: one process per rank, serving its input queue.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <c10/util/Type.h>
#include <fmt/format.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <utility>
#include <vector>

#include "parallel/tensor_parallel_impl.h"
#include "torchpar/core/error.h"
#include "torchpar/dist/world.h"
#include "torchpar/parallel/gpt_checkpoint.h"
#include "torchpar/parallel/sampling.h"
#include "torchpar/parallel/state_dict.h"

namespace torchpar {
namespace detail {
namespace {

std::mutex& registry_mutex() {
  static std::mutex mu;
  return mu;
}

// Function-local: registrations run from static initializers of other translation units.
std::map<std::string, TensorParallelFactory>& registry() {
  static std::map<std::string, TensorParallelFactory> r;
  return r;
}

std::shared_ptr<TensorParallelModel> build_model(const TpWorkerSpec& spec,
                                                 const TensorParallelComm& comm,
                                                 const TensorParallelFactory* factory) {
  const auto dtype = static_cast<at::ScalarType>(spec.dtype);
  TensorParallelFactory make;
  switch (static_cast<TpSource>(spec.source)) {
    case TpSource::kGptFile: {
      GptConfig config = spec.gpt_config();
      config.dtype = dtype;
      GptOptions options{.comm = comm, .vocab_parallel = spec.vocab_parallel};
      if (spec.has_policy) options.policy = spec.policy;
      // Mapped, not read: each rank's private memory is about its shard.
      return std::make_shared<GptTensorParallelModel>(
          load_gpt(config, load_state_dict_file(spec.path), std::move(options)));
    }
    case TpSource::kRegistered:
      make = find_tensor_parallel_model(spec.model_name);
      if (!make)
        throw ValueError(fmt::format(
            "no TensorParallel model is registered as '{}' in the worker process (register it "
            "at namespace scope, or in main() before torchpar::init, so that spawned workers "
            "have it too)",
            spec.model_name));
      break;
    case TpSource::kFactory:
      if (factory == nullptr || !*factory)
        throw ValueError(
            "TensorParallel worker: no factory (a factory needs the fork start method)");
      make = *factory;
      break;
  }
  if (!make) throw ValueError(fmt::format("TensorParallel worker: unknown source {}", spec.source));
  auto model =
      make(TensorParallelContext{.comm = comm, .dtype = dtype, .argument = spec.model_argument});
  if (!model) throw ValueError("TensorParallel worker: the model factory returned nullptr");
  return model;
}

/// Rank 0's seed, known to every rank.
uint64_t agree_seed(const TpWorkerSpec& spec, int rank, CollectiveGroup* group) {
  uint64_t seed = spec.seed;
  if (rank == 0 && !spec.has_seed) {
    std::random_device rd;
    seed = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }
  if (group != nullptr) {
    at::Tensor t = at::full({1}, std::bit_cast<int64_t>(seed), at::TensorOptions(at::kLong));
    group->broadcast(t, 0);
    seed = std::bit_cast<uint64_t>(t.item<int64_t>());
  }
  return seed;
}

/// The next token of every row from the last position's logits `last` [B, V]: [B, 1] int64,
/// drawn by the library's one sampler.
at::Tensor sample_next(const at::Tensor& last, const TpRequest& r, at::Generator& gen) {
  return sample_next_token(
      last, {.temperature = r.temperature, .top_k = r.top_k, .greedy = r.greedy}, gen);
}

/// Every rank runs the same forwards; rank 0 picks each token and broadcasts it, so the ranks'
/// caches never disagree on a token.
at::Tensor generate(TensorParallelModel& model, const TpRequest& r, int rank,
                    CollectiveGroup* group, at::Generator& gen) {
  if (r.has_seed) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(r.seed);
  }
  const at::Tensor& prompt = r.input_ids;
  std::vector<at::Tensor> pieces{prompt};
  if (r.max_new_tokens == 0) return prompt;
  const bool cached = model.uses_cache();
  GptKvCache cache;
  at::Tensor logits = model.forward(prompt, cached ? &cache : nullptr);
  for (int64_t i = 0; i < r.max_new_tokens; ++i) {
    at::Tensor next = rank == 0 ? sample_next(logits.select(1, -1), r, gen).contiguous()
                                : at::empty({prompt.size(0), 1}, at::TensorOptions(at::kLong));
    if (group != nullptr) group->broadcast(next, 0);
    pieces.push_back(next);
    if (i + 1 == r.max_new_tokens) break;
    logits = cached ? model.forward(next, &cache) : model.forward(at::cat(pieces, 1), nullptr);
  }
  return at::cat(pieces, 1);
}

/// The running batch of kStep requests (continuous batching), the same on every rank: the
/// ranks apply the same leaves and joins in the same order, and rank 0's tokens.
class StepBatch {
 public:
  /// Drops r.leave, gives every sequence that was running its next token (one batched
  /// forward for a Gpt), prefills r.join (each gets its first token from its prompt), and
  /// returns (sequence id, token) of every running sequence, in order (rank 0's tokens).
  std::vector<int64_t> step(TensorParallelModel& model, const TpRequest& r, int rank,
                            CollectiveGroup* group, at::Generator& gen) {
    auto* gpt_model = dynamic_cast<GptTensorParallelModel*>(&model);
    GptImpl* gpt = gpt_model != nullptr ? gpt_model->gpt().ptr().get() : nullptr;
    for (const int64_t id : r.leave) {
      const auto it =
          std::find_if(seqs_.begin(), seqs_.end(), [id](const Seq& q) { return q.id == id; });
      if (it == seqs_.end())
        throw ValueError(fmt::format("TensorParallel.step: sequence {} is not running", id));
      const auto i = static_cast<size_t>(it - seqs_.begin());
      if (gpt != nullptr) {
        batch_.remove_row(static_cast<int64_t>(i));
      } else {
        caches_[i] = std::move(caches_.back());
        caches_.pop_back();
      }
      seqs_[i] = std::move(seqs_.back());
      seqs_.pop_back();
    }
    // Nothing left running: the batch's tensors (sized for the widest batch so far) go too.
    if (seqs_.empty()) batch_.clear();
    const auto long_options = at::TensorOptions(at::kLong);
    std::vector<at::Tensor> logits;  // [rows, V] pieces, in the order of seqs_
    const size_t running = seqs_.size();
    if (running > 0 && gpt != nullptr) {
      std::vector<int64_t> last;
      for (const auto& q : seqs_) last.push_back(q.history.back());
      logits.push_back(
          gpt->decode_rows(at::tensor(last, long_options), batch_));  // one batched forward
    } else {
      for (size_t i = 0; i < running; ++i) {
        auto& q = seqs_[i];
        const at::Tensor ids = model.uses_cache()
                                   ? at::full({1, 1}, q.history.back(), long_options)
                                   : at::tensor(q.history, long_options).view({1, -1});
        logits.push_back(
            model.forward(ids, model.uses_cache() ? &caches_[i] : nullptr).select(1, -1));
      }
    }
    // Joins: a Gpt prefills each run of consecutive prompts of one length in one forward.
    int64_t offset = 0;
    for (size_t a = 0; a < r.join.size();) {
      size_t b = a + 1;
      while (gpt != nullptr && b < r.join.size() && r.join[b].length == r.join[a].length) ++b;
      const int64_t length = r.join[a].length;
      const auto k = static_cast<int64_t>(b - a);
      if (length < 1 || offset + k * length > static_cast<int64_t>(r.join_tokens.size()))
        throw ValueError(
            fmt::format("TensorParallel.step: sequence {}'s prompt is malformed", r.join[a].id));
      const at::Tensor prompts = at::tensor(at::IntArrayRef(r.join_tokens.data() + offset,
                                                            static_cast<size_t>(k * length)),
                                            long_options)
                                     .view({k, length});
      offset += k * length;
      if (gpt != nullptr) {
        logits.push_back(gpt->prefill_rows(prompts, batch_));
      } else {
        caches_.emplace_back();
        logits.push_back(
            model.forward(prompts, model.uses_cache() ? &caches_.back() : nullptr).select(1, -1));
      }
      for (size_t i = a; i < b; ++i) {
        const auto& j = r.join[i];
        Seq q{.id = j.id,
              .sampling = {.temperature = j.temperature, .top_k = j.top_k, .greedy = j.greedy}};
        if (j.has_seed) q.gen = at::make_generator<at::CPUGeneratorImpl>(j.seed);
        if (gpt == nullptr && !model.uses_cache()) {
          const at::Tensor p = prompts[static_cast<int64_t>(i - a)].contiguous();
          q.history.assign(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + p.numel());
        }
        seqs_.push_back(std::move(q));
      }
      a = b;
    }
    const auto n = static_cast<int64_t>(seqs_.size());
    at::Tensor next = at::empty({n}, long_options);
    if (rank == 0 && n > 0) {
      const at::Tensor all = logits.size() == 1 ? logits.front() : at::cat(logits, 0);
      auto* out = next.data_ptr<int64_t>();
      for (int64_t i = 0; i < n; ++i) {
        auto& q = seqs_[static_cast<size_t>(i)];
        out[i] = sample_next_token(all.narrow(0, i, 1), q.sampling, q.gen ? *q.gen : gen)
                     .item<int64_t>();
      }
    }
    if (group != nullptr && n > 0) group->broadcast(next, 0);
    const auto* tokens = next.data_ptr<int64_t>();
    std::vector<int64_t> pairs(static_cast<size_t>(2 * n));
    for (int64_t i = 0; i < n; ++i) {
      auto& q = seqs_[static_cast<size_t>(i)];
      if (gpt != nullptr || model.uses_cache())
        q.history.assign(1, tokens[i]);  // the last only
      else
        q.history.push_back(tokens[i]);
      pairs[static_cast<size_t>(2 * i)] = q.id;
      pairs[static_cast<size_t>(2 * i + 1)] = tokens[i];
    }
    return pairs;
  }

  /// No sequence running (none joined yet, or the last left).
  bool idle() const { return seqs_.empty(); }

 private:
  struct Seq {
    int64_t id = 0;
    SamplingOptions sampling{};
    /// Its own generator when the request gave a seed; else the engine's.
    std::optional<at::Generator> gen{};
    /// The last token; the whole sequence for a model that keeps no cache.
    std::vector<int64_t> history{};
  };
  std::vector<Seq> seqs_;
  GptBatchCache batch_;             // a Gpt's rows, in the order of seqs_
  std::vector<GptKvCache> caches_;  // other models: one cache per sequence
};

/// Reports the exception in flight as the answer to request `id`; never throws.
void report_failure(Queue<TpResponse>& out, int rank, uint64_t id, double timeout_s) noexcept {
  TpResponse r;
  r.id = id;
  r.rank = rank;
  try {
    throw;
  } catch (const RankLostError& e) {
    r.type = c10::demangle(typeid(e).name());
    r.message = e.what();
    r.secondary = true;
  } catch (const TimeoutError& e) {
    r.type = c10::demangle(typeid(e).name());
    r.message = e.what();
    r.secondary = true;  // a collective (or the rendezvous) waited for a peer
  } catch (const c10::Error& e) {
    r.type = c10::demangle(typeid(e).name());
    r.message = e.what_without_backtrace();
  } catch (const std::exception& e) {
    r.type = c10::demangle(typeid(e).name());
    r.message = e.what();
  } catch (...) {
    r.type = "unknown";
    r.message = "an exception that does not derive from std::exception";
  }
  try {
    out.put(r, std::chrono::duration<double>(timeout_s));
  } catch (...) {  // the parent reads the process's error slot instead
  }
}

}  // namespace

GptConfig TpWorkerSpec::gpt_config() const {
  return GptConfig{.vocab_size = vocab_size,
                   .n_positions = n_positions,
                   .n_embd = n_embd,
                   .n_layer = n_layer,
                   .n_head = n_head,
                   .n_inner = n_inner,
                   .layer_norm_epsilon = layer_norm_epsilon,
                   .dtype = static_cast<at::ScalarType>(dtype)};
}

void TpWorkerSpec::set_gpt_config(const GptConfig& c) {
  vocab_size = c.vocab_size;
  n_positions = c.n_positions;
  n_embd = c.n_embd;
  n_layer = c.n_layer;
  n_head = c.n_head;
  n_inner = c.n_inner;
  layer_norm_epsilon = c.layer_norm_epsilon;
}

TensorParallelFactory find_tensor_parallel_model(const std::string& name) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  const auto it = registry().find(name);
  return it == registry().end() ? TensorParallelFactory{} : it->second;
}

void run_tensor_parallel_worker(int rank, const TpWorkerSpec& spec, Queue<TpRequest>& in,
                                Queue<TpResponse>& out, const TensorParallelFactory* factory) {
  const pid_t parent = ::getppid();
  const auto timeout = std::chrono::duration<double>(spec.timeout_s);
  // Declared in this order so that they go in reverse: the model (holding the comm, holding
  // the group) before the group, the group before the World.
  std::optional<World> world;
  CollectiveGroup group;
  std::shared_ptr<TensorParallelModel> model;
  CollectiveGroup* g = nullptr;
  at::Generator gen;
  StepBatch steps;
  try {
    TensorParallelComm comm;
    if (spec.world_size > 1) {
      // Private to this engine whatever the environment says (TORCHPAR_STORE_BIND_ADDR):
      // loopback, and a key made for it.
      world.emplace(WorldOptions{.rank = rank,
                                 .world_size = spec.world_size,
                                 .master_addr = "127.0.0.1",
                                 .master_port = spec.master_port,
                                 .timeout = timeout,
                                 .authkey = spec.authkey,
                                 .store_bind_addr = "127.0.0.1"});
      group = world->create_collective_group({}, static_cast<Backend>(spec.backend), timeout);
      comm = TensorParallelComm::from_group(group);
      g = &group;
    }
    const uint64_t seed = agree_seed(spec, rank, g);
    at::manual_seed(seed);
    gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    model = build_model(spec, comm, factory);
    // Building a shard leaves freed temporaries (the full initialisation of a checkpoint's
    // tensors, the loader's buffers) in malloc's arenas: give those pages back, as below.
    ::malloc_trim(0);
    TpResponse ready;
    ready.rank = rank;
    ready.ok = true;
    ready.seed = seed;
    out.put(ready, timeout);
  } catch (...) {
    report_failure(out, rank, 0, spec.timeout_s);
    throw;
  }

  for (;;) {
    TpRequest req;
    try {
      req = in.get(std::chrono::seconds(1));
    } catch (const Empty&) {
      if (::getppid() != parent) return;  // orphaned (PR_SET_PDEATHSIG should have ended us)
      continue;
    } catch (const ClosedError&) {
      return;
    }
    if (req.kind == static_cast<int32_t>(TpRequestKind::kStop)) return;
    try {
      at::NoGradGuard no_grad;
      at::Tensor result;
      std::vector<int64_t> values;
      if (req.kind == static_cast<int32_t>(TpRequestKind::kForward))
        result = model->forward(req.input_ids, nullptr);
      else if (req.kind == static_cast<int32_t>(TpRequestKind::kGenerate))
        result = generate(*model, req, rank, g, gen);
      else if (req.kind == static_cast<int32_t>(TpRequestKind::kStep))
        values = steps.step(*model, req, rank, g, gen);
      else
        throw ValueError(fmt::format("TensorParallel worker: unknown request kind {}", req.kind));
      TpResponse r;
      r.id = req.id;
      r.rank = rank;
      r.ok = true;
      if (rank == 0) {
        r.result = result;
        r.values = std::move(values);
      }
      // A generate's (or forward's) KV cache and activations are freed by now, but glibc keeps
      // them in its arenas (its mmap threshold rises to the largest freed block, up to 32 MiB):
      // an idle worker would hold its last request's peak. Trimmed before the reply (about 8 ms
      // for 100 MiB freed in 64 KiB blocks, measured; a GPT-2-small generate takes a second),
      // so a worker that answered holds only its model (and a forward's logits); steps (serve's
      // continuous batching) come too often for it: only the one that empties the batch trims.
      if (req.kind != static_cast<int32_t>(TpRequestKind::kStep) || steps.idle()) ::malloc_trim(0);
      out.put(r, timeout);
    } catch (...) {
      report_failure(out, rank, req.id, spec.timeout_s);
      throw;  // the group is in an unknown state: this worker is done
    }
  }
}

void tensor_parallel_worker(int rank, TpWorkerSpec spec, Queue<TpRequest> in,
                            Queue<TpResponse> out) {
  run_tensor_parallel_worker(rank, spec, in, out, nullptr);
}

}  // namespace detail

GptTensorParallelModel::GptTensorParallelModel(Gpt gpt) : gpt_(std::move(gpt)) {
  if (!gpt_) throw ValueError("GptTensorParallelModel: the Gpt is empty (nullptr)");
  gpt_->eval();
}

at::Tensor GptTensorParallelModel::forward(const at::Tensor& input_ids, GptKvCache* cache) {
  return gpt_->forward(input_ids, cache);
}

TensorParallelFactory gpt_tensor_parallel_factory(GptImpl& model, bool vocab_parallel) {
  // "linear": the parameters themselves, no transposed copies; the policy says so.
  const GptCheckpointInfo info{.config = model.config(), .weight_layout = "linear"};
  auto full = std::make_shared<const StateDict>(gpt_checkpoint_state_dict(model, "linear"));
  return [full, info, vocab_parallel](const TensorParallelContext& ctx) {
    GptConfig config = info.config;
    config.dtype = ctx.dtype;
    GptOptions options{.comm = ctx.comm, .policy = info.policy(), .vocab_parallel = vocab_parallel};
    return std::make_shared<GptTensorParallelModel>(load_gpt(config, *full, std::move(options)));
  };
}

bool register_tensor_parallel_model(const std::string& name, TensorParallelFactory factory) {
  if (name.empty()) throw ValueError("register_tensor_parallel_model: the name is empty");
  if (!factory)
    throw ValueError(
        fmt::format("register_tensor_parallel_model: the factory for '{}' is empty", name));
  std::lock_guard<std::mutex> lock(detail::registry_mutex());
  detail::registry()[name] = std::move(factory);
  return true;
}

}  // namespace torchpar
