// Spawn workers that fill shared tensors handed to them through a queue, and collect
// their replies. Run: build/bin/example_spawn_queue
#include <torchpar/torchpar.h>

#include <cstdio>

namespace tp = torchpar;
using namespace std::chrono_literals;

// Runs in each child: takes tensors until an empty one, writes into them (shared memory:
// the parent sees the writes) and answers with its rank.
void worker(int rank, tp::Queue<at::Tensor> jobs, tp::Queue<int> done) {
  for (;;) {
    at::Tensor t = jobs.get(30s);
    if (t.numel() == 0) return;
    t.fill_(rank + 1);
    done.put(rank);
  }
}

int main(int argc, char** argv) {
  tp::init(argc, argv);  // first: a spawned child runs `worker` here and exits
  tp::Queue<at::Tensor> jobs;
  tp::Queue<int> done;
  tp::SpawnOptions options;
  options.join = false;
  auto ctx = tp::spawn(worker, std::make_tuple(jobs, done), 2, options);

  std::vector<at::Tensor> tensors;
  for (int i = 0; i < 4; ++i) {
    tensors.push_back(at::zeros({3}));
    jobs.put(tensors.back());  // moves it to shared memory; the worker aliases it
  }
  for (int i = 0; i < 4; ++i) std::printf("reply from worker %d\n", done.get(30s));
  for (int i = 0; i < 2; ++i) jobs.put(at::empty({0}));
  ctx.join(30s);
  for (auto& t : tensors) std::printf("%s\n", c10::str(t).c_str());
  return 0;
}
