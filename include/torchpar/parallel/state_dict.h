#pragma once
/// StateDict, load_state_dict_file and save_state_dict_file: the weights a tensor-parallel model
/// slices on load, in the file format of Python's torch.save.

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
///          SerializationError naming the path when it is not a torch.save zip archive, holds
///          something other than a dict of string -> tensor, or a tensor's bytes lie outside
///          the file.
/// Safety:  thread-safe (nothing shared between calls). Reading runs LibTorch's own unpickler,
///          which knows only tensors, containers and a few torch globals: no Python code runs
///          and no other class is built (unlike Python's torch.load). Still, load files you
///          trust: the unpickler is not hardened against crafted input.
/// Source:  torch.load (with mmap=True for the default), torch::pickle_load.
///
///   auto sd = torchpar::load_state_dict_file("gpt2/state_dict.pt");
///   at::Tensor wte = sd.at("wte.weight");
StateDict load_state_dict_file(const std::string& path, const LoadStateDictOptions& options = {});

/// Writes `state_dict` as a file that load_state_dict_file (and Python's torch.load) reads:
/// the zip format of torch.save (torch >= 1.6), written by LibTorch's torch::pickle_save, a
/// plain dict of string -> tensor, records stored uncompressed (so load_state_dict_file can
/// map it). The file appears whole or not at all: it is written beside `path` under a
/// temporary name, flushed (fsync), then renamed over `path`.
///
/// Shapes:  each tensor as it is (views are written with their whole storage); CPU tensors
///          (others are copied to the CPU first); gradients are not saved.
/// Errors:  ValueError for an empty name; SystemError naming the file (open, write, fsync,
///          rename) when the file cannot be written, and the temporary file is removed.
/// Safety:  thread-safe; concurrent writers of one path leave one of their files whole.
/// Source:  torch.save(dict(model.state_dict()), path).
///
///   torchpar::save_state_dict_file(sd, "runs/gpt/model.pt");
///   auto back = torchpar::load_state_dict_file("runs/gpt/model.pt");
void save_state_dict_file(const StateDict& state_dict, const std::string& path);

}  // namespace torchpar
