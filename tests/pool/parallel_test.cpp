// Parallel / Parallelizable: results match serial execution, serial_init, num_workers = 0,
// exceptions, LibTorch autograd from several threads.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <atomic>
#include <set>
#include <thread>

#include "torchpar/parallel/parallel.h"

using namespace std::chrono_literals;

namespace {
struct Square : torchpar::Parallelizable<at::Tensor, double> {
  std::atomic<int> calls{0};
  std::mutex mu;
  std::set<std::thread::id> threads;
  double forward_backward(at::Tensor x) override {
    ++calls;
    {
      std::lock_guard<std::mutex> lock(mu);
      threads.insert(std::this_thread::get_id());
    }
    if (x.item<double>() < 0) throw std::invalid_argument("negative input");
    at::Tensor w = x.clone().requires_grad_(true);
    at::Tensor loss = (w * w).sum();
    loss.backward();
    return w.grad().item<double>();  // d(w^2)/dw = 2w
  }
};
}  // namespace

TEST(Parallel, ResultsMatchSerial) {
  for (size_t workers : {0, 1, 3}) {
    for (bool serial_init : {true, false}) {
      Square net;
      std::multiset<double> got, expect;
      {
        torchpar::Parallel<at::Tensor, double> par(workers, net, serial_init);
        for (int i = 0; i < 20; ++i) {
          par.put(at::full({}, static_cast<double>(i), at::kDouble));
          expect.insert(2.0 * i);
        }
        for (int i = 0; i < 20; ++i) got.insert(par.get(30s));
      }
      EXPECT_EQ(got, expect) << "workers=" << workers;
      EXPECT_EQ(net.calls, 20);
      if (workers == 0) {
        EXPECT_EQ(net.threads.size(), 1u);
        EXPECT_EQ(*net.threads.begin(), std::this_thread::get_id());
      }
    }
  }
}

TEST(Parallel, SerialInitRunsFirstInputsInTheCallingThread) {
  Square net;
  torchpar::Parallel<at::Tensor, double> par(2, net, /*serial_init=*/true);
  par.put(at::full({}, 1.0, at::kDouble));
  par.put(at::full({}, 2.0, at::kDouble));
  {
    std::lock_guard<std::mutex> lock(net.mu);
    EXPECT_EQ(net.threads, std::set<std::thread::id>{std::this_thread::get_id()});
  }
  EXPECT_EQ(par.get(10s) + par.get(10s), 6.0);
}

TEST(Parallel, ExceptionsAndTimeouts) {
  Square net;
  torchpar::Parallel<at::Tensor, double> par(2, net, false);
  EXPECT_THROW(par.get(0.05s), torchpar::TimeoutError);
  par.put(at::full({}, -1.0, at::kDouble));
  EXPECT_THROW(par.get(10s), std::invalid_argument);
  par.put(at::full({}, 3.0, at::kDouble));
  EXPECT_EQ(par.get(10s), 6.0);
}
