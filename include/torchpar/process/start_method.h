#pragma once
/// Start methods and program initialisation for child processes.
///
///  - "fork": the child is a fork() of the parent and runs the target directly (any
///    callable, any arguments). The child sets its intra-op threads to the budget (1 by
///    default); a budget above 1 is refused when the parent already runs other threads,
///    because OpenMP / LibTorch thread pools do not survive fork (users hit deadlocks).
///  - "spawn" (default): fork + exec of the same binary. The child holds none of the
///    parent's threads or state; it runs `torchpar::init(argc, argv)` at the top of main,
///    which recognises it as a spawned child, runs the target and exits. The target must
///    be a free function or captureless lambda and the arguments serializable
///    (torchpar::dumps; tensors travel by shared memory).
///  - "forkserver": a single-threaded server exec'd from this program on first use (needs
///    init() like spawn) forks the children; same target rules as spawn, faster starts.

#include <optional>
#include <string>
#include <vector>

namespace torchpar {

enum class StartMethod { kFork, kSpawn, kForkserver };

/// Call first thing in main(): `int main(int argc, char** argv) { torchpar::init(argc, argv); ...
/// }`. In a process started with the spawn method it runs the child's target and exits (never
/// returns); otherwise it records argv (needed to re-exec) and returns. Using the spawn start
/// method without it throws a clear torchpar::Error in the parent.
void init(int argc, char** argv);

/// True once init() ran in this process.
bool is_initialized();

/// Start methods this build supports: "fork", "forkserver", "spawn".
/// Source: multiprocessing.get_all_start_methods.
std::vector<std::string> get_all_start_methods();

/// Current default start method ("spawn" unless set). Source: multiprocessing.get_start_method.
std::string get_start_method();

/// Sets the default start method. Errors: torchpar::ValueError naming the valid methods
/// for an unknown or unsupported name. Safety: thread-safe.
/// Source: multiprocessing.set_start_method.
void set_start_method(const std::string& method);

std::string to_string(StartMethod m);
StartMethod start_method_from_string(const std::string& name);
StartMethod current_start_method();

}  // namespace torchpar
