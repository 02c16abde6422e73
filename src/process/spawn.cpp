#include "torchpar/process/spawn.h"

#include <poll.h>
#include <signal.h>

#include <thread>

namespace torchpar {

ProcessContext::ProcessContext(std::vector<Process> processes) : processes_(std::move(processes)) {}

ProcessContext::~ProcessContext() {
  for (auto& p : processes_) {
    if (p.pid() > 0 && p.is_alive()) p.kill();
  }
  for (auto& p : processes_) {
    if (p.pid() > 0) {
      try {
        p.join(std::chrono::seconds(10));
      } catch (...) {
      }
    }
  }
}

std::vector<int> ProcessContext::pids() const {
  std::vector<int> out;
  for (const auto& p : processes_) out.push_back(p.pid());
  return out;
}

void ProcessContext::terminate_all() {
  for (auto& p : processes_)
    if (p.is_alive()) p.terminate();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  for (auto& p : processes_) {
    auto left = std::chrono::duration<double>(deadline - std::chrono::steady_clock::now());
    if (!p.join(std::max(left, std::chrono::duration<double>(0)))) {
      p.kill();
      p.join();
    }
  }
}

bool ProcessContext::join(Timeout timeout) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    bool all_done = true;
    for (size_t i = 0; i < processes_.size(); ++i) {
      auto& p = processes_[i];
      if (p.is_alive()) {
        all_done = false;
        continue;
      }
      const int code = p.exitcode().value_or(0);
      if (code == 0) continue;
      // Failure: stop the others, then report this one.
      const int pid = p.pid();
      auto err = p.error();
      terminate_all();
      if (err) throw ProcessRaisedException(static_cast<int>(i), pid, err->first, err->second);
      throw ProcessExitedException(static_cast<int>(i), pid, code);
    }
    if (all_done) return true;
    int wait_ms = 100;
    if (timeout) {
      const auto left = *timeout - (std::chrono::steady_clock::now() - start);
      if (left.count() <= 0) return false;
      wait_ms = std::min(
          100, static_cast<int>(std::chrono::duration<double, std::milli>(left).count()) + 1);
    }
    std::vector<pollfd> fds;
    for (auto& p : processes_)
      if (const int fd = detail::process_wait_fd(p); fd >= 0) fds.push_back({fd, POLLIN, 0});
    if (!fds.empty())
      ::poll(fds.data(), fds.size(), wait_ms);
    else
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(wait_ms, 5)));
  }
}

}  // namespace torchpar
