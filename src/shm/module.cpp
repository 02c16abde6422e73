// Kept apart: <torch/nn/module.h> is heavy, and only this function needs it.
#include <torch/nn/module.h>

#include "torchpar/shm/share.h"

namespace torchpar {

void share_memory(torch::nn::Module& module) {
  for (auto& p : module.parameters(/*recurse=*/true)) {
    at::Tensor data = p.data();  // share the storage without recording autograd history
    share_memory_(data);
  }
  for (auto& b : module.buffers(/*recurse=*/true)) {
    at::Tensor data = b.data();
    share_memory_(data);
  }
}

}  // namespace torchpar
