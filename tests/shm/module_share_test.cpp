// share_memory(Module): every parameter and buffer, recursively, with autograd intact.
#include <gtest/gtest.h>
#include <torch/nn.h>

#include "torchpar/torchpar.h"

namespace {
struct Net : torch::nn::Module {
  Net() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)));
    bn = register_module("bn", torch::nn::BatchNorm2d(4));
    inner = register_module("inner", torch::nn::Sequential(torch::nn::Linear(8, 2)));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Sequential inner{nullptr};
};
}  // namespace

TEST(ShareModule, AllParametersAndBuffersRecursively) {
  auto net = std::make_shared<Net>();
  std::vector<at::Tensor> before;
  for (auto& p : net->parameters()) before.push_back(p.detach().clone());
  torchpar::share_memory(*net);
  size_t i = 0;
  for (auto& p : net->parameters()) {
    EXPECT_TRUE(torchpar::is_shared(p));
    EXPECT_TRUE(p.requires_grad());
    EXPECT_TRUE(at::equal(p.detach(), before[i++]));
  }
  for (auto& b : net->buffers()) EXPECT_TRUE(torchpar::is_shared(b));
  EXPECT_EQ(i, net->parameters().size());
  // Training still works on shared parameters.
  auto out = net->inner->forward(torch::ones({3, 8})).sum();
  out.backward();
  auto w = net->inner->parameters()[0];
  EXPECT_TRUE(w.grad().defined());
  torch::NoGradGuard ng;
  w.sub_(w.grad());
  EXPECT_TRUE(torchpar::is_shared(w));
}
