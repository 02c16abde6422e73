#pragma once
// What a spawned child reads from its launch-record fd.

#include <string>
#include <vector>

#include "torchpar/process/process.h"

namespace torchpar::detail {

struct LaunchRecord {
  CodeAddress trampoline;
  CodeAddress fn;
  int threads = 1;
  std::string name;
  std::string args;  // bytes of the argument payload; its fds are passed by number
  template <class Archive>
  void serialize(Archive& ar) {
    ar(trampoline, fn, threads, name, args);
  }
};

/// argv recorded by torchpar::init (re-exec'd for spawn).
std::vector<std::string>& saved_argv();

}  // namespace torchpar::detail
