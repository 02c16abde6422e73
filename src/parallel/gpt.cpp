#include "torchpar/parallel/gpt.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include "parallel/decode_linear.h"
#include "shape_text.h"
#include "torchpar/core/error.h"

namespace torchpar {
namespace {

using detail::shape_of;

/// A plain submodule, so parameter names nest as in Python ("h.0.ln_1.weight"): torch::nn
/// refuses dots in a registered name.
std::shared_ptr<torch::nn::Module> child(torch::nn::Module& parent, const std::string& name) {
  return parent.register_module(name, std::make_shared<torch::nn::Module>());
}

at::Tensor new_param(torch::nn::Module& m, const std::string& name, at::IntArrayRef sizes,
                     at::ScalarType dtype) {
  return m.register_parameter(name, at::empty(sizes, at::TensorOptions().dtype(dtype)));
}

/// "a, b, c" of the first few names, and how many there are in all.
std::string some_of(const std::vector<std::string>& names) {
  constexpr size_t kShown = 5;
  const std::vector<std::string> head(names.begin(),
                                      names.begin() + std::min(names.size(), kShown));
  return names.size() <= kShown
             ? fmt::format("{}", fmt::join(head, ", "))
             : fmt::format("{}, ... ({} in all)", fmt::join(head, ", "), names.size());
}

void check_config(const GptConfig& c) {
  if (c.vocab_size < 1 || c.n_positions < 1 || c.n_embd < 1 || c.n_layer < 1 || c.n_head < 1 ||
      c.n_inner < 0)
    throw ValueError(fmt::format(
        "Gpt: vocab_size {}, n_positions {}, n_embd {}, n_layer {} and n_head {} must be >= 1, "
        "n_inner {} >= 0",
        c.vocab_size, c.n_positions, c.n_embd, c.n_layer, c.n_head, c.n_inner));
  if (c.n_embd % c.n_head != 0)
    throw ValueError(
        fmt::format("Gpt: n_embd = {} is not divisible by n_head = {}", c.n_embd, c.n_head));
  if (!(c.layer_norm_epsilon > 0))
    throw ValueError(fmt::format("Gpt: layer_norm_epsilon {} must be > 0", c.layer_norm_epsilon));
  if (!c10::isFloatingType(c.dtype))
    throw ValueError(fmt::format("Gpt: dtype {} is not a floating dtype", c10::toString(c.dtype)));
}

bool same_layers(const std::vector<TensorParallelLayer>& a,
                 const std::vector<TensorParallelLayer>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].weight != b[i].weight || a[i].bias != b[i].bias || a[i].n_fused != b[i].n_fused)
      return false;
  }
  return true;
}

/// The model's blocks are GPT-2's: a policy may only say how the checkpoint is laid out.
void check_fits_gpt2(const TensorParallelPolicy& p, const TensorParallelPolicy& gpt2) {
  std::set<std::pair<std::string, int64_t>> args, want;
  for (const auto& a : p.replace_arguments) args.emplace(a.name, a.value);
  for (const auto& a : gpt2.replace_arguments) want.emplace(a.name, a.value);
  if (p.block_pattern != gpt2.block_pattern || !same_layers(p.attn_qkv, gpt2.attn_qkv) ||
      !same_layers(p.attn_out, gpt2.attn_out) || !same_layers(p.mlp_in, gpt2.mlp_in) ||
      !same_layers(p.mlp_out, gpt2.mlp_out) || args != want)
    throw ValueError(fmt::format(
        "Gpt: the policy for '{}' does not fit the model: only the layers' transposed flags may "
        "differ from gpt2_policy(config) (blocks 'h.{{}}.', attn.c_attn fused x3, attn.c_proj, "
        "mlp.c_fc, mlp.c_proj; arguments attn.num_heads, attn.embed_dim, mlp.inner_dim with the "
        "config's values)",
        p.block_type));
}

}  // namespace

TensorParallelPolicy gpt2_policy(const GptConfig& config) {
  TensorParallelPolicy p;
  p.block_type = "GPT2Block";
  p.block_pattern = "h.{}.";
  p.attn_qkv = {{.weight = "attn.c_attn.weight",
                 .bias = "attn.c_attn.bias",
                 .n_fused = 3,
                 .transposed = true}};
  p.attn_out = {{.weight = "attn.c_proj.weight", .bias = "attn.c_proj.bias", .transposed = true}};
  p.mlp_in = {{.weight = "mlp.c_fc.weight", .bias = "mlp.c_fc.bias", .transposed = true}};
  p.mlp_out = {{.weight = "mlp.c_proj.weight", .bias = "mlp.c_proj.bias", .transposed = true}};
  // Heads first: when both fail, the head count is the number users chose.
  p.replace_arguments = {{"attn.num_heads", config.n_head},
                         {"attn.embed_dim", config.n_embd},
                         {"mlp.inner_dim", config.inner_size()}};
  return p;
}

int64_t GptKvCache::length() const {
  return keys.empty() || !keys.front().defined() ? 0 : keys.front().size(2);
}

void GptKvCache::clear() {
  keys.clear();
  values.clear();
}

// ---- one block ----------------------------------------------------------------------------------

struct GptImpl::Block : torch::nn::Module {
  Block(const GptConfig& c, const TensorParallelComm& comm, int64_t heads_per_rank, bool initialize)
      : heads(heads_per_rank),
        head_dim(c.n_embd / c.n_head),
        width(c.n_embd),
        eps(c.layer_norm_epsilon) {
    auto ln_1 = child(*this, "ln_1");
    ln_1_weight = new_param(*ln_1, "weight", {width}, c.dtype);
    ln_1_bias = new_param(*ln_1, "bias", {width}, c.dtype);
    auto attn = child(*this, "attn");
    c_attn = attn->register_module(
        "c_attn", ColumnParallelLinear(ColumnParallelLinearOptions{.in_features = width,
                                                                   .out_features = 3 * width,
                                                                   .dtype = c.dtype,
                                                                   .initialize = false},
                                       comm));
    attn_proj = attn->register_module(
        "c_proj",
        RowParallelLinear(
            RowParallelLinearOptions{
                .in_features = width, .out_features = width, .dtype = c.dtype, .initialize = false},
            comm));
    auto ln_2 = child(*this, "ln_2");
    ln_2_weight = new_param(*ln_2, "weight", {width}, c.dtype);
    ln_2_bias = new_param(*ln_2, "bias", {width}, c.dtype);
    auto mlp = child(*this, "mlp");
    c_fc = mlp->register_module(
        "c_fc", ColumnParallelLinear(ColumnParallelLinearOptions{.in_features = width,
                                                                 .out_features = c.inner_size(),
                                                                 .dtype = c.dtype,
                                                                 .initialize = false},
                                     comm));
    mlp_proj = mlp->register_module(
        "c_proj", RowParallelLinear(RowParallelLinearOptions{.in_features = c.inner_size(),
                                                             .out_features = width,
                                                             .dtype = c.dtype,
                                                             .initialize = false},
                                    comm));
    if (initialize) {
      // GPT-2's: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer), zero biases.
      const double proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(c.n_layer));
      at::NoGradGuard no_grad;
      ln_1_weight.fill_(1);
      ln_1_bias.zero_();
      ln_2_weight.fill_(1);
      ln_2_bias.zero_();
      c_attn->weight.normal_(0, 0.02);
      c_attn->bias.zero_();
      attn_proj->weight.normal_(0, proj_std);
      attn_proj->bias.zero_();
      c_fc->weight.normal_(0, 0.02);
      c_fc->bias.zero_();
      mlp_proj->weight.normal_(0, proj_std);
      mlp_proj->bias.zero_();
    }
  }

  /// x [B, T, C] -> [B, T, C]. `mask` [T, past + T] is true where a query may not look;
  /// past_k / past_v [B, heads, past, head_dim] or undefined. k_out / v_out receive the keys
  /// and values of all past + T positions.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& mask, const at::Tensor& past_k,
                     const at::Tensor& past_v, at::Tensor& k_out, at::Tensor& v_out) {
    const int64_t b = x.size(0);
    const int64_t t = x.size(1);
    const int64_t local = heads * head_dim;
    const auto qkv = c_attn->forward(at::layer_norm(x, {width}, ln_1_weight, ln_1_bias, eps))
                         .split(local, 2);  // this rank's q, k and v: [B, T, local] each
    auto split_heads = [&](const at::Tensor& z) {
      return z.view({b, t, heads, head_dim}).transpose(1, 2);
    };
    const at::Tensor q = split_heads(qkv[0]);
    k_out = split_heads(qkv[1]);
    v_out = split_heads(qkv[2]);
    if (past_k.defined()) {
      k_out = at::cat({past_k, k_out}, 2);
      v_out = at::cat({past_v, v_out}, 2);
    }
    const at::Tensor scores =
        at::matmul(q, k_out.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim));
    const at::Tensor probs =
        scores.masked_fill(mask, -std::numeric_limits<double>::infinity()).softmax(-1);
    return finish(x, at::matmul(probs, v_out).transpose(1, 2).reshape({b, t, local}));
  }

  /// One position per row of a GptBatchCache: x [R, 1, C]; `mask` [R, 1, 1, span] is true
  /// where a row may not look; kc / vc this layer's cache [capacity, heads, positions,
  /// head_dim]; `slots` [R * heads] the flat (row, head, position) indexes of kc.view({-1,
  /// head_dim}) that receive the new keys and values.
  at::Tensor decode(const at::Tensor& x, const at::Tensor& mask, at::Tensor& kc, at::Tensor& vc,
                    const at::Tensor& slots, int64_t span) {
    const int64_t r = x.size(0);
    const int64_t local = heads * head_dim;
    const auto qkv = c_attn->forward(at::layer_norm(x, {width}, ln_1_weight, ln_1_bias, eps))
                         .split(local, 2);  // [R, 1, local] each
    // With one position, [R, 1, heads * head_dim] is [R, heads, 1, head_dim] in memory.
    const at::Tensor q = qkv[0].reshape({r, heads, 1, head_dim});
    kc.view({-1, head_dim}).index_copy_(0, slots, qkv[1].reshape({r * heads, head_dim}));
    vc.view({-1, head_dim}).index_copy_(0, slots, qkv[2].reshape({r * heads, head_dim}));
    const at::Tensor k = kc.narrow(0, 0, r).narrow(2, 0, span);  // views: no copy of the cache
    const at::Tensor v = vc.narrow(0, 0, r).narrow(2, 0, span);
    const at::Tensor scores =
        at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim));
    const at::Tensor probs =
        scores.masked_fill(mask, -std::numeric_limits<double>::infinity()).softmax(-1);
    return finish(x, at::matmul(probs, v).reshape({r, 1, local}));
  }

  /// The attention's projection and the MLP: x [B, T, C], y the heads' output [B, T, local].
  at::Tensor finish(const at::Tensor& x, const at::Tensor& y) {
    const at::Tensor h = x + attn_proj->forward(y);
    const at::Tensor inner =
        at::gelu(c_fc->forward(at::layer_norm(h, {width}, ln_2_weight, ln_2_bias, eps)), "tanh");
    return h + mlp_proj->forward(inner);
  }

  int64_t heads;
  int64_t head_dim;
  int64_t width;
  double eps;
  at::Tensor ln_1_weight, ln_1_bias, ln_2_weight, ln_2_bias;
  ColumnParallelLinear c_attn{nullptr};
  RowParallelLinear attn_proj{nullptr};
  ColumnParallelLinear c_fc{nullptr};
  RowParallelLinear mlp_proj{nullptr};
};

// ---- the model ----------------------------------------------------------------------------------

GptImpl::GptImpl(const GptConfig& config, GptOptions options)
    : config_(config),
      comm_(std::move(options.comm)),
      policy_(options.policy ? std::move(*options.policy) : gpt2_policy(config)) {
  check_config(config_);
  comm_.check("Gpt");
  check_fits_gpt2(policy_, gpt2_policy(config_));
  const auto per_rank = arguments_per_rank(policy_, comm_.world_size);
  heads_ = per_rank.at("attn.num_heads");

  const auto dtype = config_.dtype;
  const int64_t width = config_.n_embd;
  vocab_rows_ = config_.vocab_size;
  if (options.vocab_parallel && comm_.world_size > 1) {
    if (!comm_.all_gather)
      throw ValueError(
          "Gpt: vocab_parallel with world size > 1 needs TensorParallelComm::all_gather "
          "(from_group(group) sets it)");
    vocab_rows_ = (config_.vocab_size + comm_.world_size - 1) / comm_.world_size;
    vocab_start_ = vocab_rows_ * comm_.rank;
  }
  wte_ = new_param(*child(*this, "wte"), "weight", {vocab_rows_, width}, dtype);
  wpe_ = new_param(*child(*this, "wpe"), "weight", {config_.n_positions, width}, dtype);
  auto h = child(*this, "h");
  for (int64_t i = 0; i < config_.n_layer; ++i) {
    blocks_.push_back(h->register_module(
        std::to_string(i), std::make_shared<Block>(config_, comm_, heads_, options.initialize)));
  }
  auto ln_f = child(*this, "ln_f");
  ln_f_weight_ = new_param(*ln_f, "weight", {width}, dtype);
  ln_f_bias_ = new_param(*ln_f, "bias", {width}, dtype);
  if (options.initialize) {
    at::NoGradGuard no_grad;
    wte_.normal_(0, 0.02);
    const int64_t held = owned_vocab_rows();
    if (held < vocab_rows_) wte_.narrow(0, held, vocab_rows_ - held).zero_();  // the padding
    wpe_.normal_(0, 0.01);
    ln_f_weight_.fill_(1);
    ln_f_bias_.zero_();
  }
}

GptImpl::~GptImpl() = default;

int64_t GptImpl::num_parameters() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

at::Tensor GptImpl::forward(const at::Tensor& input_ids, GptKvCache* cache) {
  if (!input_ids.defined() || input_ids.dim() != 2 || input_ids.scalar_type() != at::kLong ||
      input_ids.numel() == 0)
    throw ValueError(fmt::format(
        "Gpt.forward: input_ids must be a non-empty int64 tensor [batch, tokens], got {} {}",
        input_ids.defined() ? c10::toString(input_ids.scalar_type()) : "undefined",
        input_ids.defined() ? shape_of(input_ids.sizes()) : ""));
  const int64_t b = input_ids.size(0);
  const int64_t t = input_ids.size(1);
  const int64_t past = cache != nullptr ? cache->length() : 0;
  if (past > 0) {
    const auto& k0 = cache->keys.front();
    if (cache->keys.size() != blocks_.size() || cache->values.size() != blocks_.size() ||
        k0.size(0) != b || k0.size(1) != heads_ || k0.scalar_type() != config_.dtype)
      throw ValueError(fmt::format(
          "Gpt.forward: the cache ({} layers, keys {} {}) is not from this model ({} layers, {} "
          "heads per rank, {}) with batch {}",
          cache->keys.size(), shape_of(k0.sizes()), c10::toString(k0.scalar_type()), blocks_.size(),
          heads_, c10::toString(config_.dtype), b));
  }
  if (past + t > config_.n_positions)
    throw ValueError(fmt::format(
        "Gpt.forward: {} cached + {} new positions exceed the context of {} (n_positions)", past, t,
        config_.n_positions));
  const int64_t lo = input_ids.min().item<int64_t>();
  const int64_t hi = input_ids.max().item<int64_t>();
  if (lo < 0 || hi >= config_.vocab_size)
    throw ValueError(fmt::format("Gpt.forward: token ids span [{}, {}], outside [0, {})", lo, hi,
                                 config_.vocab_size));

  // The collectives write behind autograd's back: with world_size > 1 forward is inference.
  std::optional<at::NoGradGuard> no_grad;
  if (comm_.world_size > 1) no_grad.emplace();

  at::Tensor x = embed(input_ids, at::arange(past, past + t, at::TensorOptions(at::kLong)));
  // Query i (position past + i) sees keys 0 .. past + i.
  const auto mask = at::ones({t, past + t}, at::TensorOptions().dtype(at::kBool)).triu(past + 1);
  std::vector<at::Tensor> keys(blocks_.size()), values(blocks_.size());
  for (size_t l = 0; l < blocks_.size(); ++l) {
    const at::Tensor none;
    x = blocks_[l]->forward(x, mask, past > 0 ? cache->keys[l] : none,
                            past > 0 ? cache->values[l] : none, keys[l], values[l]);
  }
  at::Tensor logits = head(x);
  if (cache != nullptr) {  // only now: a failed forward leaves the cache as it was
    cache->keys = std::move(keys);
    cache->values = std::move(values);
  }
  return logits;
}

at::Tensor GptImpl::embed(const at::Tensor& input_ids, const at::Tensor& positions) {
  if (!vocab_parallel()) return at::embedding(wte_, input_ids) + at::embedding(wpe_, positions);
  // Megatron's VocabParallelEmbedding: each rank looks up the ids it holds, zeros for the
  // rest, and the sum over ranks is every id's row.
  const at::Tensor local = input_ids - vocab_start_;
  const at::Tensor foreign = (local < 0).logical_or_(local >= owned_vocab_rows());
  at::Tensor x =
      at::embedding(wte_, local.masked_fill(foreign, 0)).masked_fill_(foreign.unsqueeze(-1), 0);
  comm_.all_reduce_sum(x);
  return x.add_(at::embedding(wpe_, positions));
}

at::Tensor GptImpl::head(const at::Tensor& x) {
  at::Tensor logits = detail::decode_linear(
      at::layer_norm(x, {config_.n_embd}, ln_f_weight_, ln_f_bias_, config_.layer_norm_epsilon),
      wte_, {});
  if (vocab_parallel()) {  // [B, T, Vp] per rank -> [B, T, world * Vp] -> the vocabulary's
    logits = comm_.all_gather(logits, -1);
    if (logits.size(-1) != config_.vocab_size) logits = logits.narrow(-1, 0, config_.vocab_size);
  }
  return logits;
}

// ---- continuous batching ------------------------------------------------------------------------

namespace {

/// `t` [rows, heads, positions, head_dim] grown to at least `rows` x `positions`, zeros in the
/// new room, the old content kept.
void grow(at::Tensor& t, int64_t rows, int64_t positions) {
  if (t.size(0) >= rows && t.size(2) >= positions) return;
  at::Tensor bigger =
      at::zeros({std::max(rows, t.size(0)), t.size(1), std::max(positions, t.size(2)), t.size(3)},
                t.options());
  bigger.narrow(0, 0, t.size(0)).narrow(2, 0, t.size(2)).copy_(t);
  t = std::move(bigger);
}

/// `have` when `need` fits in it, else `have` doubled until it does, at most `most` (need <=
/// most).
int64_t doubled(int64_t have, int64_t need, int64_t most) {
  if (have >= need) return have;
  int64_t c = std::max<int64_t>(have, 1);
  while (c < need) c *= 2;
  return std::min(c, most);
}

}  // namespace

void GptBatchCache::remove_row(int64_t row) {
  if (row < 0 || row >= rows())
    throw ValueError(
        fmt::format("GptBatchCache.remove_row: row {} is not in [0, {})", row, rows()));
  const int64_t last = rows() - 1;
  if (row != last) {
    const int64_t len = lengths[static_cast<size_t>(last)];
    for (auto* layers : {&keys, &values}) {
      for (auto& t : *layers) {
        if (len > 0) t[row].narrow(1, 0, len).copy_(t[last].narrow(1, 0, len));
      }
    }
    lengths[static_cast<size_t>(row)] = len;
  }
  // Zeros where the last row was: a masked position must hold a finite value (0 x inf = NaN).
  const int64_t len = lengths[static_cast<size_t>(last)];
  for (auto* layers : {&keys, &values}) {
    for (auto& t : *layers) {
      if (len > 0) t[last].narrow(1, 0, len).zero_();
    }
  }
  lengths.pop_back();
}

void GptBatchCache::clear() {
  keys.clear();
  values.clear();
  lengths.clear();
}

void GptImpl::check_batch_cache(const GptBatchCache& cache, const char* where) const {
  if (cache.keys.empty() && cache.rows() == 0) return;
  const auto& k0 = cache.keys.front();
  if (cache.keys.size() != blocks_.size() || cache.values.size() != blocks_.size() ||
      k0.size(1) != heads_ || k0.scalar_type() != config_.dtype)
    throw ValueError(fmt::format(
        "{}: the cache ({} layers, keys {} {}) is not from this model ({} layers, {} heads per "
        "rank, {})",
        where, cache.keys.size(), shape_of(k0.sizes()), c10::toString(k0.scalar_type()),
        blocks_.size(), heads_, c10::toString(config_.dtype)));
}

at::Tensor GptImpl::prefill_rows(const at::Tensor& prompt_ids, GptBatchCache& cache) {
  check_batch_cache(cache, "Gpt.prefill_rows");
  GptKvCache one;
  const at::Tensor logits = forward(prompt_ids, &one);  // checks ids, shape, dtype, n_positions
  const int64_t k = prompt_ids.size(0);
  const int64_t t = prompt_ids.size(1);
  const int64_t first = cache.rows();
  const int64_t rows = first + k;
  if (cache.keys.empty()) {
    const int64_t head_dim = config_.n_embd / config_.n_head;
    const auto zeros = [&] {
      return at::zeros({0, heads_, 0, head_dim}, at::TensorOptions(config_.dtype));
    };
    for (size_t l = 0; l < blocks_.size(); ++l) {
      cache.keys.push_back(zeros());
      cache.values.push_back(zeros());
    }
  }
  const int64_t cap_rows =
      doubled(cache.keys.front().size(0), rows, std::numeric_limits<int64_t>::max());
  const int64_t cap_pos = doubled(cache.keys.front().size(2), t, config_.n_positions);
  for (size_t l = 0; l < blocks_.size(); ++l) {
    for (auto* pair : {&cache.keys, &cache.values}) {
      at::Tensor& c = (*pair)[l];
      grow(c, std::max<int64_t>(cap_rows, 4),
           std::max<int64_t>(cap_pos, std::min<int64_t>(64, config_.n_positions)));
      c.narrow(0, first, k).narrow(2, 0, t).copy_((pair == &cache.keys ? one.keys : one.values)[l]);
    }
  }
  cache.lengths.insert(cache.lengths.end(), static_cast<size_t>(k), t);
  return logits.select(1, -1);
}

at::Tensor GptImpl::decode_rows(const at::Tensor& tokens, GptBatchCache& cache) {
  check_batch_cache(cache, "Gpt.decode_rows");
  const int64_t r = cache.rows();
  if (r == 0) throw ValueError("Gpt.decode_rows: the cache holds no sequence");
  if (!tokens.defined() || tokens.dim() != 1 || tokens.size(0) != r ||
      tokens.scalar_type() != at::kLong)
    throw ValueError(
        fmt::format("Gpt.decode_rows: tokens must be int64 [{}] (one per row), got {} {}", r,
                    tokens.defined() ? c10::toString(tokens.scalar_type()) : "undefined",
                    tokens.defined() ? shape_of(tokens.sizes()) : ""));
  const at::Tensor ids = tokens.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t i = 0; i < r; ++i) {
    if (id[i] < 0 || id[i] >= config_.vocab_size)
      throw ValueError(fmt::format("Gpt.decode_rows: row {}'s token {} is outside [0, {})", i,
                                   id[i], config_.vocab_size));
    const int64_t len = cache.lengths[static_cast<size_t>(i)];
    if (len >= config_.n_positions)
      throw ValueError(fmt::format(
          "Gpt.decode_rows: row {} holds {} positions, the model's context (n_positions): it "
          "cannot take another",
          i, len));
    longest = std::max(longest, len);
  }
  const int64_t span = longest + 1;
  const int64_t cap_pos = doubled(cache.keys.front().size(2), span, config_.n_positions);
  if (cache.keys.front().size(2) < span) {
    for (auto* layers : {&cache.keys, &cache.values}) {
      for (auto& c : *layers) grow(c, c.size(0), cap_pos);
    }
  }
  const int64_t capacity = cache.keys.front().size(2);
  const auto long_options = at::TensorOptions(at::kLong);
  const at::Tensor lengths = at::from_blob(cache.lengths.data(), {r}, long_options).clone();  // [R]
  // Row i, head j writes at position lengths[i] of kc[i][j]: flat index (i * heads + j) *
  // capacity + lengths[i] of kc.view({-1, head_dim}).
  const at::Tensor slots =
      ((at::arange(r, long_options).mul_(heads_).unsqueeze(1) + at::arange(heads_, long_options))
           .mul_(capacity)
           .add_(lengths.unsqueeze(1)))
          .view({-1});
  const at::Tensor mask =
      at::arange(span, long_options).unsqueeze(0).gt(lengths.unsqueeze(1)).view({r, 1, 1, span});

  std::optional<at::NoGradGuard> no_grad;
  if (comm_.world_size > 1) no_grad.emplace();
  at::Tensor x = embed(ids.view({r, 1}), lengths.view({r, 1}));  // [R, 1, C]
  for (size_t l = 0; l < blocks_.size(); ++l)
    x = blocks_[l]->decode(x, mask, cache.keys[l], cache.values[l], slots, span);
  at::Tensor logits = head(x).select(1, 0);  // [R, V]
  for (auto& len : cache.lengths) ++len;
  return logits;
}

int64_t GptImpl::owned_vocab_rows() const {
  return std::clamp<int64_t>(config_.vocab_size - vocab_start_, 0, vocab_rows_);
}

void GptImpl::load_state_dict(StateDict full, bool strict) {
  StateDict shards = shard_state_dict(std::move(full), {policy_}, comm_.rank, comm_.world_size);
  const auto wte = shards.find("wte.weight");
  if (vocab_parallel() && wte != shards.end() && wte->second.dim() == 2 &&
      wte->second.size(0) == config_.vocab_size) {
    // This rank's rows, zero-padded to Vp (a wrong width is reported below, as for any entry).
    const at::Tensor& whole = wte->second;
    const int64_t held = owned_vocab_rows();
    at::Tensor part = at::zeros({vocab_rows_, whole.size(1)}, whole.options());
    if (held > 0) part.narrow(0, 0, held).copy_(whole.narrow(0, vocab_start_, held));
    wte->second = part;
  }
  auto params = named_parameters(/*recurse=*/true);
  // Every check before the first copy: a refused state dict leaves the model as it was.
  std::vector<std::string> missing;
  for (const auto& item : params) {
    const auto it = shards.find(item.key());
    if (it == shards.end()) {
      missing.push_back(item.key());
      continue;
    }
    if (it->second.sizes() != item.value().sizes())
      throw ValueError(fmt::format(
          "Gpt.load_state_dict: '{}' has shape {} after slicing for rank {} of {}, the model's "
          "is {} (weights are expected in Conv1D [in, out] layout under the default policy; a "
          "checkpoint in nn.Linear [out, in] layout needs the policy's transposed = false)",
          item.key(), shape_of(it->second.sizes()), comm_.rank, comm_.world_size,
          shape_of(item.value().sizes())));
  }
  if (strict && !missing.empty())
    throw ValueError(
        fmt::format("Gpt.load_state_dict: missing from the state dict: {}", some_of(missing)));
  if (strict) {
    std::vector<std::string> unexpected;
    for (const auto& [name, tensor] : shards) {
      if (!params.contains(name)) unexpected.push_back(name);
    }
    if (!unexpected.empty())
      throw ValueError(fmt::format(
          "Gpt.load_state_dict: entries the model does not have: {} (strict = false ignores them)",
          some_of(unexpected)));
  }
  at::NoGradGuard no_grad;
  for (auto& item : params) {
    const auto it = shards.find(item.key());
    if (it == shards.end()) continue;
    item.value().copy_(it->second);
    shards.erase(it);  // each shard is released once copied
  }
}

Gpt load_gpt(const GptConfig& config, StateDict full, GptOptions options) {
  options.initialize = false;
  Gpt gpt(config, std::move(options));
  gpt->load_state_dict(std::move(full), /*strict=*/true);
  return gpt;
}

}  // namespace torchpar
