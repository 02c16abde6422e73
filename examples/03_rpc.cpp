// RPC between ranks started by `torchpar run` (or by hand with RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT and the job's key): every rank registers a function by name and a
// service of its own, then calls the next rank's function, the previous rank's service, and
// fetches a remote() result.
//
//   torchpar run -n 3 -- example_rpc
//
// RPC needs the job's key: `torchpar run` gives its ranks a fresh one in TORCHPAR_AUTHKEY
// (hex); started by hand, give every rank the same TORCHPAR_AUTHKEY (for instance
// `export TORCHPAR_AUTHKEY=$(openssl rand -hex 32)`) or set WorldOptions::authkey. Without
// one, create_rpc_group throws ValueError saying so.
//
// The RPC listener binds to 127.0.0.1 unless TORCHPAR_RPC_ADDR names an address of this
// host (the two-host test sets it to each network namespace's address).
#include <torchpar/torchpar.h>

#include <iostream>
#include <string>

namespace {
// Functions travel by name: every process registers the same ones.
const bool kAdd = torchpar::register_function(
    "add", +[](int a, int b) { return a + b; });
const bool kNorm = torchpar::register_function(
    "norm", +[](at::Tensor t) { return t.norm().item<double>(); });
}  // namespace

int main(int argc, char** argv) {
  torchpar::init(argc, argv);
  using namespace std::chrono_literals;
  try {
    torchpar::World world(torchpar::WorldOptions{.timeout = 60s});
    const int rank = world.get_rank();
    const int n = world.get_world_size();
    auto names = world.get_names();
    auto group = world.create_rpc_group("example", names);
    const std::string me = group.get_cur_name();
    const std::string next = names[static_cast<size_t>((rank + 1) % n)];
    const std::string prev = names[static_cast<size_t>((rank + n - 1) % n)];
    int calls = 0;
    group.register_service("greet_" + me, [&, me](std::string who) {
      ++calls;
      return "hello " + who + " from " + me;
    });
    group.barrier();

    const int sum = group.rpc_sync<int>(next, "add", std::tuple{rank, 40});
    const double norm = group.rpc_sync<double>(next, "norm", std::tuple{at::full({4}, 1.5)});
    const auto greeting =
        group.registered_sync<std::string>("greet_" + prev, std::tuple{std::string(me)});
    auto rref = group.remote<int>(next, "add", std::tuple{1, 1});
    std::cout << "rank " << rank << " (" << me << "): add on " << next << " = " << sum
              << ", norm = " << norm << ", " << greeting << ", remote = " << rref.to_here()
              << std::endl;
    const bool ok = sum == rank + 40 && norm == 3.0 && rref.to_here() == 2 &&
                    greeting == "hello " + me + " from " + prev;
    group.barrier();
    group.destroy();
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
