#pragma once
/// StateDict, load_state_dict_file and save_state_dict_file: the weights a tensor-parallel model
/// slices on load, read from what Python's torch.save wrote, and written as torch.save writes
/// them.

#include <ATen/core/Tensor.h>

#include <map>
#include <string>

namespace torchpar {

/// Parameter (or buffer) name -> tensor, as torch.nn.Module.state_dict() returns it
/// ("h.0.attn.c_attn.weight" -> [768, 2304]). Ordered by name, so messages and iteration are
/// deterministic.
using StateDict = std::map<std::string, at::Tensor>;

/// Options of load_state_dict_file.
struct LoadStateDictOptions {
  /// true: the tensors alias a private, copy-on-write memory mapping of the file (what
  /// torch.load(mmap=True) does in later torch versions): nothing is read until a tensor's
  /// bytes are touched, the pages are the page cache's (shared by every process that maps the
  /// file, and reclaimable), and slicing a tensor reads only the slice. This is what keeps a
  /// tensor-parallel rank at about its shard of private memory. The file must stay unchanged
  /// while any returned tensor (or a view of one) lives: truncating it makes a later access
  /// raise SIGBUS, as with any mapping. Needs the records stored uncompressed, as torch.save
  /// writes them; a zip recompressed by another tool needs mmap = false.
  /// false: every tensor is read into memory of its own (torch.load's default).
  bool mmap = true;
};

/// Reads a dict of tensors written by Python's `torch.save(d, path)` (the zip format, torch >=
/// 1.6; pickle protocol 2, torch.save's default). `d` is a plain dict whose keys are strings
/// and whose values are tensors: save `dict(model.state_dict())`, since the OrderedDict that
/// state_dict() returns (with its `_metadata`) is not something LibTorch's unpickler reads.
/// Nor does LibTorch 1.13's unpickler know the SETITEM opcode, which Python's pickler writes
/// for a dict of 1, 1001, 2001, ... entries (its last batch of one): such a file is refused;
/// add an entry before saving.
///
/// Shapes:  each tensor as saved, with its strides and storage offset; tensors that shared a
///          storage in Python share one here.
/// Dtypes:  as saved (float32, bfloat16, int64, ...); CPU tensors whatever the saved device.
/// Errors:  torchpar::Error naming the path when the file cannot be opened or mapped;
///          SerializationError naming the path when it is not a regular file (a FIFO is
///          refused, not waited on), not a torch.save zip archive, holds something other than
///          a dict of string -> tensor, or a tensor's bytes lie outside the file (or its
///          record); SerializationError naming the path and the key when a tensor's view as
///          the file states it does not fit its storage: a negative size, stride or storage
///          offset, sizes and strides of different lengths, more elements than an int64
///          counts, or an element past the storage's end (checked in 128-bit arithmetic).
/// Safety:  thread-safe (nothing shared between calls). Reading runs LibTorch's own unpickler,
///          which knows only tensors, containers and a few torch globals: no Python code runs
///          and no other class is built (unlike Python's torch.load). Every view is checked
///          before it is built (a scan of the pickle, which also sees the negative strides the
///          unpickler would silently replace) and again after, so no tensor returned reads
///          outside its storage. Other crafted pickles are the unpickler's to refuse: it is
///          LibTorch's, not hardened by torchpar beyond these checks.
/// Source:  torch.load (with mmap=True for the default), torch::pickle_load.
///
///   auto sd = torchpar::load_state_dict_file("gpt2/state_dict.pt");
///   at::Tensor wte = sd.at("wte.weight");
StateDict load_state_dict_file(const std::string& path, const LoadStateDictOptions& options = {});

/// Writes `state_dict` to `path` as Python's `torch.save(d, path)` writes a plain dict of
/// tensors (the zip format, pickle protocol 2, records stored uncompressed), so that both
/// load_state_dict_file and Python's `torch.load(path)` read it back as a dict of str ->
/// tensor. The file appears whole or not at all: the bytes go to a temporary file beside it
/// flushed (fsync), then renamed over `path`.
///
/// Shapes:  each tensor as it is (any strides; stored contiguous, with its own storage: views
///          are copied out, so a slice does not write its whole base); CPU, strided, detached
///          (requires_grad is not kept). Tensors on other devices are copied to the CPU.
/// Memory:  the whole file is assembled in memory before it is written (about the tensors'
///          bytes again).
/// Errors:  ValueError for an empty path, or naming the entry for an undefined or
///          non-strided (sparse, mkldnn) tensor, before anything is written; torchpar::Error
///          naming the path when it cannot be written (the temporary file is removed).
/// Safety:  thread-safe for different paths.
/// Source:  torch.save; LibTorch's torch::pickle_save, without its type tags
///          (torch.jit._pickle.restore_type_tag) so that the pickle holds nothing but a dict.
///
///   torchpar::StateDict sd{{"wte.weight", wte}, {"wpe.weight", wpe}};
///   torchpar::save_state_dict_file(sd, "model.pt");  // Python: torch.load("model.pt")
void save_state_dict_file(const StateDict& state_dict, const std::string& path);

}  // namespace torchpar
