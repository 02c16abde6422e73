// `torchpar manager`: a manager server in the foreground, for Python clients (CPython's own
// SyncManager(address, authkey).connect()) and C++ clients (Manager::connect) alike.
#include <fmt/format.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "commands.h"
#include "torchpar/core/error.h"
#include "torchpar/manager/manager.h"

namespace torchpar::cli {
namespace {

struct ManagerConfig {
  std::string address = "127.0.0.1:0";
  std::string authkey_file;
};

/// The Unix socket's path to remove at a signal (empty for TCP); written before the
/// handlers are installed, read only by them.
char g_socket_path[4096] = {};

extern "C" void on_manager_stop(int) {
  if (g_socket_path[0] == '/') ::unlink(g_socket_path);  // as Python's Listener.close does
  ::_exit(0);
}

int run_manager(const ManagerConfig& c) {
  std::ifstream f(c.authkey_file, std::ios::binary);
  if (!f) throw ValueError(fmt::format("--authkey-file {}: cannot read it", c.authkey_file));
  std::stringstream ss;
  ss << f.rdbuf();
  std::string key = ss.str();
  while (!key.empty() && (key.back() == '\n' || key.back() == '\r')) key.pop_back();
  if (key.empty()) throw ValueError(fmt::format("--authkey-file {} is empty", c.authkey_file));
  if (!c.address.empty() && c.address[0] == '/' && c.address.size() < sizeof g_socket_path)
    c.address.copy(g_socket_path, c.address.size());
  struct sigaction sa {};
  sa.sa_handler = on_manager_stop;
  ::sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
  serve_manager(c.address, AuthKey(key), [](const std::string& bound) {
    fmt::print("torchpar manager: listening on {}\n", bound);
    std::fflush(stdout);
  });
  return 0;
}

}  // namespace

Command add_manager(CLI::App& app) {
  auto c = std::make_shared<ManagerConfig>();
  auto* cmd = app.add_subcommand(
      "manager",
      "Run a manager server in the foreground for Python clients "
      "(multiprocessing.managers.SyncManager(address, authkey).connect(): dict, list, "
      "Namespace, Value, Array, Queue, Lock, RLock, Semaphore, Condition, Event, Barrier) and "
      "C++ clients (torchpar::Manager::connect). Prints the address it listens on; exits 0 "
      "on SIGTERM, SIGINT or a client's shutdown.");
  cmd->add_option("--address", c->address,
                  "host:port (port 0: any free one) or a filesystem path (a Unix socket); "
                  "loopback by default")
      ->capture_default_str();
  cmd->add_option("--authkey-file", c->authkey_file,
                  "file whose bytes are the key every client proves (a trailing newline is "
                  "dropped)")
      ->required();
  return [c] { return run_manager(*c); };
}

}  // namespace torchpar::cli
