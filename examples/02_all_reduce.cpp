// All-reduce across ranks started by `torchpar run` (or torchrun): each rank contributes
// rank + 1, every rank prints the sum and checks it.
//
//   torchpar run -n 3 -- example_all_reduce [--backend auto|shm|gloo]
//                                            [--fail-rank R [--exit-code C]]
//                                            [--python-compatible]
//
// --fail-rank: that rank exits with C (default 3) before the all_reduce, to show how the
// launcher stops the others. --python-compatible: join Python torch.distributed ranks
// (init_process_group("gloo", "env://")) in one default group and also broadcast from rank 0.
#include <torchpar/torchpar.h>

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>

int main(int argc, char** argv) {
  torchpar::init(argc, argv);
  std::string backend = "auto";
  int fail_rank = -1;
  int exit_code = 3;
  bool python = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--backend" && i + 1 < argc) {
      backend = argv[++i];
    } else if (a == "--fail-rank" && i + 1 < argc) {
      fail_rank = std::atoi(argv[++i]);
    } else if (a == "--exit-code" && i + 1 < argc) {
      exit_code = std::atoi(argv[++i]);
    } else if (a == "--python-compatible") {
      python = true;
    } else {
      std::cerr << "unknown argument " << a << "\n";
      return 2;
    }
  }
  try {
    torchpar::World world(
        torchpar::WorldOptions{.timeout = std::chrono::seconds(60), .python_compatible = python});
    const int rank = world.get_rank();
    const int n = world.get_world_size();
    if (rank == fail_rank) {
      std::cerr << "rank " << rank << " fails on purpose with exit code " << exit_code << "\n";
      return exit_code;
    }
    std::optional<torchpar::CollectiveGroup> own;
    torchpar::CollectiveGroup& group = python ? world.default_group()
                                              : own.emplace(world.create_collective_group(
                                                    {}, torchpar::backend_from_string(backend)));
    auto t = at::full({4}, static_cast<float>(rank + 1));
    group.all_reduce(t);
    const float want = static_cast<float>(n * (n + 1) / 2);
    std::cout << "rank " << rank << " of " << n << " (" << torchpar::to_string(group.backend())
              << "): all_reduce sum = " << t[0].item<float>() << " (expected " << want << ")"
              << std::endl;
    bool ok = at::equal(t, at::full({4}, want));
    if (python) {
      auto b = at::arange(5, at::kFloat) * (rank == 0 ? 1 : 0);
      group.broadcast(b, 0);
      std::cout << "rank " << rank << ": broadcast from rank 0 = " << b[4].item<float>()
                << std::endl;
      ok = ok && at::equal(b, at::arange(5, at::kFloat));
    }
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
