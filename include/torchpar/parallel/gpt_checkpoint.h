#pragma once
/// The checkpoint of a Gpt on disk: what `torchpar train --model gpt` writes and
/// `torchpar infer` and TensorParallel read (docs/inference.md has the contract).
///
///   runs/<dir>/model.pt    the parameters: a torch.save zip of a plain dict of string -> tensor
///                          (save_state_dict_file; Python's torch.load reads it too)
///   runs/<dir>/model.json  the GptConfig fields, "tokenizer" and "weight_layout":
///     {"vocab_size": 256, "n_positions": 256, "n_embd": 128, "n_layer": 4, "n_head": 4,
///      "n_inner": 0, "layer_norm_epsilon": 1e-05, "dtype": "float32",
///      "tokenizer": "bytes", "weight_layout": "conv1d"}
///
/// Not included by torchpar/torchpar.h (it pulls in torch::nn through gpt.h).

#include <ATen/core/Tensor.h>

#include <string>

#include "torchpar/parallel/gpt.h"
#include "torchpar/parallel/state_dict.h"
#include "torchpar/parallel/tensor_parallel_policy.h"

namespace torchpar {

/// What model.json says about the weights in model.pt.
struct GptCheckpointInfo {
  /// The model's shape. config.dtype is the dtype the weights were saved in (informational: a
  /// reader converts to the dtype it runs in).
  GptConfig config{};
  /// How text maps to token ids. "bytes": byte-level, token = byte value (vocab_size >= 256),
  /// the only one torchpar infer knows. Other names are kept as they are for other readers.
  std::string tokenizer = "bytes";
  /// Layout of the four projection weights of every block (attn.c_attn, attn.c_proj, mlp.c_fc,
  /// mlp.c_proj): "conv1d" = [in, out], GPT-2's and Hugging Face's (the default, and what
  /// save_gpt_checkpoint writes); "linear" = nn.Linear's [out, in] (nanoGPT's).
  std::string weight_layout = "conv1d";

  /// gpt2_policy(config) with every layer's `transposed` set for weight_layout.
  /// Errors: ValueError for a weight_layout other than "conv1d" or "linear".
  TensorParallelPolicy policy() const;
};

/// The sidecar of a model file: `model_path` with its extension replaced by ".json"
/// ("runs/a/model.pt" -> "runs/a/model.json"; "w" -> "w.json").
std::string gpt_checkpoint_info_path(const std::string& model_path);

/// Reads the sidecar of `model_path` (gpt_checkpoint_info_path). Required keys: vocab_size,
/// n_positions, n_embd, n_layer, n_head (integers); optional: n_inner (0), layer_norm_epsilon
/// (1e-5), dtype ("float32"), tokenizer ("bytes"), weight_layout ("conv1d"). Other keys are
/// ignored, so a writer may add its own (training step, loss, ...).
///
/// Errors:  torchpar::Error naming the file when it cannot be opened; SerializationError
///          naming the file when it is not a regular file (a FIFO or device such as /dev/zero:
///          refused before a byte is read, so this never blocks) or is larger than 1 MiB;
///          SerializationError naming the file and the key for malformed JSON, a missing key,
///          a value of the wrong type, a size that is not a JSON integer in [1, 2^31 - 1]
///          (n_inner: from 0; 1e30 and 768.5 are refused, not converted), a
///          layer_norm_epsilon that is not finite and > 0, or an unknown dtype. Whether the
///          sizes fit together (n_embd divisible by n_head) is checked when a Gpt is built.
/// Safety:  thread-safe.
GptCheckpointInfo load_gpt_checkpoint_info(const std::string& model_path);

/// Writes `info` as the sidecar of `model_path` (through a temporary file and a rename).
/// Errors: SystemError naming the file; ValueError for an unknown weight_layout.
void save_gpt_checkpoint_info(const GptCheckpointInfo& info, const std::string& model_path);

/// The parameters of a single-rank Gpt (TP = 1) under their checkpoint names, with the four
/// projection weights in `weight_layout` ("conv1d": transposed to [in, out], new contiguous
/// tensors; "linear": as held). Detached from autograd; other tensors are the parameters
/// themselves (not copies).
/// Errors: ValueError for a Gpt with world_size > 1 (a shard is not a checkpoint) or an unknown
///         layout.
StateDict gpt_checkpoint_state_dict(GptImpl& gpt, const std::string& weight_layout = "conv1d");

/// Writes a single-rank Gpt as a checkpoint: `model_path` (gpt_checkpoint_state_dict, "conv1d",
/// save_state_dict_file) and its sidecar (config, `tokenizer`, "conv1d"). Each file appears
/// whole or not at all; the weights are written first.
/// Errors: as gpt_checkpoint_state_dict, save_state_dict_file and save_gpt_checkpoint_info.
///
///   torchpar::save_gpt_checkpoint(*gpt, "runs/gpt/model.pt");   // + runs/gpt/model.json
///   torchpar::TensorParallel tp("runs/gpt/model.pt", {.world_size = 2});
void save_gpt_checkpoint(GptImpl& gpt, const std::string& model_path,
                         const std::string& tokenizer = "bytes");

/// torch's dtype names: "float32" (also "float"), "float64" ("double"), "float16" ("half"),
/// "bfloat16". Errors: ValueError naming the accepted names.
at::ScalarType dtype_from_string(const std::string& name);
/// "float32", "float64", "float16", "bfloat16"; c10's name for any other dtype.
std::string dtype_name(at::ScalarType dtype);

}  // namespace torchpar
