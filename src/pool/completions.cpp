// A Pool's completions: results in, chunk outcomes out to their JobState (completions.h).
#include "pool/completions.h"

#include <algorithm>
#include <cstdio>
#include <functional>

namespace torchpar {
namespace detail {

void PoolCompletions::drain(std::vector<PoolResult>& out, Timeout wait, size_t max) {
  for (bool first = true; out.size() < max; first = false) {
    try {
      decode_answers(results_.get(first && wait ? *wait : std::chrono::duration<double>(0)), out);
    } catch (const Empty&) {
      return;
    } catch (const std::exception& e) {
      report_unreadable(e);
      return;
    }
  }
}

void PoolCompletions::report_unreadable(const std::exception& e) {
  if (!result_error_reported_)
    std::fprintf(stderr, "torchpar: Pool: a worker's result could not be read: %s\n", e.what());
  result_error_reported_ = true;
}

void PoolCompletions::decode(Completion& c) {
  if (c.error) return;
  try {
    c.values = c.job->unpack(c.results);
  } catch (...) {
    c.error = std::current_exception();
  }
  c.results.clear();
}

void PoolCompletions::finish_now(std::vector<Completion>& done) {
  for (auto& c : done) {
    decode(c);
    c.job->complete(c.chunk, std::move(c.values), c.error);
  }
  done.clear();
}

void PoolCompletions::finish(std::vector<Completion>& done) {
  for (auto& c : done) decode(c);
  const auto now = PoolClock::now();
  for (size_t i = 0; i < done.size();) {
    const std::shared_ptr<JobState> job = done[i].job;
    JobState& j = *job;
    std::function<void()> on_done;
    bool last = false;
    size_t e = i;
    {
      std::lock_guard<std::mutex> lock(j.mu);
      for (; e < done.size() && done[e].job.get() == &j; ++e)
        last |= j.record_locked(done[e].chunk, std::move(done[e].values), done[e].error, on_done);
    }
    i = e;
    if (last) {
      quiet_.erase(&j);
      j.cv.notify_all();
      JobState::run_on_done(on_done);
    } else {
      wake_later(job, now);
    }
  }
  done.clear();
}

void PoolCompletions::wake_later(const std::shared_ptr<JobState>& job, PoolClock::time_point now) {
  auto [it, fresh] = quiet_.try_emplace(job.get());
  Quiet& q = it->second;
  q.job = job;
  if (fresh || now - q.woken >= kWakeEvery) {
    job->cv.notify_all();
    q.woken = now;
    q.pending = false;
  } else {
    q.pending = true;
  }
}

void PoolCompletions::wake_due(PoolClock::time_point now, bool all) {
  for (auto it = quiet_.begin(); it != quiet_.end();) {
    Quiet& q = it->second;
    if (!all && now - q.woken < kWakeEvery) {
      ++it;
    } else if (q.pending) {
      q.job->cv.notify_all();
      q.woken = now;
      q.pending = false;
      if (all)
        it = quiet_.erase(it);
      else
        ++it;
    } else {
      it = quiet_.erase(it);
    }
  }
}

std::chrono::duration<double> PoolCompletions::drain_wait(PoolClock::time_point now) const {
  std::chrono::duration<double> wait = kIdleWait;
  for (const auto& [key, q] : quiet_)
    if (q.pending)
      wait = std::min(wait, std::max(std::chrono::duration<double>(0),
                                     std::chrono::duration<double>(q.woken - now) + kWakeEvery));
  return wait;
}

}  // namespace detail
}  // namespace torchpar
