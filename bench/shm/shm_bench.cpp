// Shared-memory tensors and serialization: share_memory_ (steady state and cold),
// dumps/loads in both modes, and the machine's limits (memcpy, segment create+touch)
// that each result should be read against. The peer (PyTorch's share_memory_ and
// ForkingPickler) runs from bench/peers/torch_share_memory.py.
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "torchpar/torchpar.h"

namespace {

void set_bytes(benchmark::State& state, int64_t bytes) {
  state.SetBytesProcessed(state.iterations() * bytes);
}

// share_memory_ of a fresh (private) tensor, with the segment cache warm: the case of a
// training loop or a queue that keeps handing tensors over.
void BM_ShareMemorySteady(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  at::Tensor src = at::ones({bytes / 4}, at::kFloat);
  {
    // Warm the cache first: a 64 MiB call can take longer than the minimum time, and a run
    // of one iteration would otherwise time the cold case under this name.
    at::Tensor warm = src.clone();
    torchpar::share_memory_(warm);
  }
  for (auto _ : state) {
    state.PauseTiming();
    at::Tensor t = src.clone();
    state.ResumeTiming();
    torchpar::share_memory_(t);
    benchmark::DoNotOptimize(t.data_ptr());
    state.PauseTiming();
    t = at::Tensor();  // back to the cache
    state.ResumeTiming();
  }
  set_bytes(state, bytes);
}

// share_memory_ with the cache emptied first: every call creates, reserves and faults in
// a new segment (what PyTorch does on every call).
void BM_ShareMemoryCold(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  at::Tensor src = at::ones({bytes / 4}, at::kFloat);
  for (auto _ : state) {
    state.PauseTiming();
    torchpar::empty_shm_cache();
    at::Tensor t = src.clone();
    state.ResumeTiming();
    torchpar::share_memory_(t);
    benchmark::DoNotOptimize(t.data_ptr());
    state.PauseTiming();
    t = at::Tensor();
    state.ResumeTiming();
  }
  set_bytes(state, bytes);
}

// dumps + loads round trip in one process. copy: bytes travel; shared: only a handle.
// loads consumes the payload (std::move), as a receiver does with what it received.
void BM_DumpsLoads(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  const bool copy = state.range(1) != 0;
  at::Tensor t = at::ones({bytes / 4}, at::kFloat);
  if (!copy) torchpar::share_memory_(t);
  // One untimed round trip, as the other programs warm up: the process's first large dumps
  // faults its buffer in (the payload cache then hands it back each time), and a single
  // timed 64 MiB iteration (short --benchmark_min_time) would report that first call.
  (void)torchpar::loads<at::Tensor>(torchpar::dumps(t, {.copy_tensor = copy}));
  for (auto _ : state) {
    torchpar::Payload p = torchpar::dumps(t, {.copy_tensor = copy});
    at::Tensor back = torchpar::loads<at::Tensor>(std::move(p));
    benchmark::DoNotOptimize(back.data_ptr());
  }
  set_bytes(state, bytes);
}

// The physical limit: one thread's memcpy between two warm buffers.
void BM_Memcpy(benchmark::State& state) {
  const auto bytes = static_cast<size_t>(state.range(0));
  std::vector<char> a(bytes, 1), b(bytes, 2);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), bytes);
    benchmark::DoNotOptimize(b.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state, static_cast<int64_t>(bytes));
}

// The cost of fresh shared memory: memfd_create + fallocate + mmap + touch every page.
void BM_SegmentCreateTouch(benchmark::State& state) {
  const auto bytes = static_cast<size_t>(state.range(0));
  for (auto _ : state) {
    int fd = ::memfd_create("bench", MFD_CLOEXEC);
    if (fd < 0 || ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)) != 0) {
      state.SkipWithError("memfd/fallocate failed");
      break;
    }
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    std::memset(p, 1, bytes);
    benchmark::DoNotOptimize(p);
    ::munmap(p, bytes);
    ::close(fd);
  }
  set_bytes(state, static_cast<int64_t>(bytes));
}

constexpr int64_t k4K = 4 << 10, k1M = 1 << 20, k64M = 64 << 20;

}  // namespace

BENCHMARK(BM_ShareMemorySteady)->Arg(k4K)->Arg(k1M)->Arg(k64M)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ShareMemoryCold)->Arg(k4K)->Arg(k1M)->Arg(k64M)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DumpsLoads)
    ->ArgsProduct({{k4K, k1M, k64M}, {1, 0}})
    ->ArgNames({"bytes", "copy"})
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Memcpy)->Arg(k4K)->Arg(k1M)->Arg(k64M)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_SegmentCreateTouch)->Arg(k1M)->Arg(k64M)->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  at::set_num_threads(1);  // one intra-op thread, as torchpar workers run
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
