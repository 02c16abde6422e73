// A Pool's dispatcher: pending chunks to workers in batches, answers back to their chunks
// (dispatcher.h).
#include "pool/dispatcher.h"

#include <algorithm>
#include <iterator>
#include <limits>

namespace torchpar {
namespace detail {

size_t BatchPolicy::limit(double busy_s, double answers, size_t pending, size_t takers) {
  if (answers <= 0) return 1;
  double k = static_cast<double>(std::min(kMaxBatch, pending / (2 * std::max<size_t>(takers, 1))));
  const double per_chunk = busy_s / answers;
  if (per_chunk > 0) k = std::min(k, kBatchWork.count() / per_chunk);
  return std::max<size_t>(1, static_cast<size_t>(k));
}

size_t BatchPolicy::take(const std::deque<PoolTask>& pending, size_t want) {
  if (pending.empty()) return 0;
  const uint64_t job = pending.front().job;
  size_t n = 0, bytes = 0;
  while (n < want && n < pending.size() && pending[n].job == job &&
         (n == 0 || bytes + pending[n].args.size() <= kBatchBytes))
    bytes += pending[n++].args.size();
  return n;
}

void PoolDispatcher::add(std::shared_ptr<JobState> state, PoolCall call,
                         std::vector<std::string> chunks) {
  const uint64_t id = next_job_++;
  Job& j = jobs_[id];
  j.state = std::move(state);
  j.call = std::move(call);
  for (uint32_t c = 0; c < chunks.size(); ++c)
    pending_.push_back(PoolTask{id, c, std::move(chunks[c])});
}

size_t PoolDispatcher::batch_limit(uint64_t job, size_t takers) const {
  auto it = jobs_.find(job);
  if (it == jobs_.end()) return 1;
  return BatchPolicy::limit(it->second.busy_s, it->second.answers, pending_.size(), takers);
}

void PoolDispatcher::dispatch(WorkerSet& workers, std::vector<Completion>& done) {
  if (pending_.empty()) return;
  const size_t takers = workers.takers();
  const auto now = PoolClock::now();
  for (size_t i = 0; i < workers.size(); ++i) {
    PoolWorker& w = workers[i];
    if (!w.takes_tasks()) continue;
    while (!pending_.empty()) {
      uint64_t budget = std::numeric_limits<uint64_t>::max();
      if (maxtasks_ != 0) {
        if (w.sent >= maxtasks_) break;
        budget = maxtasks_ - w.sent;
      }
      const size_t held = w.outstanding.size();
      if (BatchPolicy::full(held, w.outstanding_bytes)) break;
      const size_t k = batch_limit(pending_.front().job, takers);
      const size_t n =
          BatchPolicy::take(pending_, static_cast<size_t>(std::min<uint64_t>(k, budget)));
      if (BatchPolicy::waits(held, n, k)) break;
      if (!send_batch(w, n, now, done)) break;
    }
  }
}

// Sends the first `n` pending chunks to `w` as one batch. False: `w` gets nothing more
// this turn.
bool PoolDispatcher::send_batch(PoolWorker& w, size_t n, PoolClock::time_point now,
                                std::vector<Completion>& done) {
  for (;;) {
    PoolBatch b;
    b.call = jobs_.at(pending_.front().job).call;
    b.tasks.assign(std::make_move_iterator(pending_.begin()),
                   std::make_move_iterator(pending_.begin() + static_cast<std::ptrdiff_t>(n)));
    pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(n));
    std::exception_ptr err;
    bool full = false;
    try {
      w.inbox.put(b, std::chrono::duration<double>(0));
    } catch (const Full&) {
      err = std::current_exception();
      full = true;
    } catch (...) {
      err = std::current_exception();
    }
    if (!err) {
      // Marked after the put succeeded; the worker's result needs the owner's lock, held.
      for (auto& t : b.tasks) {
        w.outstanding_bytes += t.args.size();
        w.outstanding.push_back(SentChunk{std::move(t), w.sent++, now});
      }
      return true;
    }
    pending_.insert(pending_.begin(), std::make_move_iterator(b.tasks.begin()),
                    std::make_move_iterator(b.tasks.end()));
    if (full && !w.outstanding.empty()) return false;  // room comes as it takes its batches
    if (n > 1) {
      n = 1;  // maybe too large as a batch: the first chunk alone
      continue;
    }
    fail_chunk(pending_.front().job, pending_.front().chunk, err, done);
    pending_.pop_front();
    return true;
  }
}

void PoolDispatcher::take_result(WorkerSet& workers, PoolResult& r, PoolClock::time_point now,
                                 std::vector<Completion>& done) {
  workers.note_answer();  // workers do get work done
  PoolWorker* w = workers.by_id(r.worker);
  if (w == nullptr) return;
  auto& out = w->outstanding;
  size_t p = 0;
  while (p < out.size() && !(out[p].task.job == r.job && out[p].task.chunk == r.chunk)) ++p;
  if (p == out.size()) return;  // earlier ones (p > 0): answers lost, they fail at its death
  ++w->answered;
  // It began this chunk when it was sent or when its previous answer came, the later.
  const auto began = std::max(out[p].at, w->last_answer);
  w->last_answer = now;
  w->outstanding_bytes -= std::min(w->outstanding_bytes, out[p].task.args.size());
  out.erase(out.begin() + static_cast<std::ptrdiff_t>(p));
  auto it = jobs_.find(r.job);
  if (it == jobs_.end()) return;
  Job& job = it->second;
  BatchPolicy::estimate(job.busy_s, job.answers,
                        std::chrono::duration<double>(now - std::min(now, began)).count());
  std::exception_ptr err = r.ok ? nullptr : std::make_exception_ptr(TaskError(r.type, r.message));
  done.push_back(Completion{job.state, r.chunk, std::move(r.values), err, {}});
  if (++job.finished == job.state->chunks.size()) jobs_.erase(it);
}

void PoolDispatcher::settle_dead(PoolWorker& w, uint64_t begun, std::exception_ptr lost,
                                 std::vector<Completion>& done) {
  std::vector<PoolTask> again;
  for (SentChunk& s : w.outstanding) {
    if (s.seq >= begun)
      again.push_back(std::move(s.task));
    else
      fail_chunk(s.task.job, s.task.chunk, lost, done);
  }
  pending_.insert(pending_.begin(), std::make_move_iterator(again.begin()),
                  std::make_move_iterator(again.end()));
  w.outstanding.clear();
  w.outstanding_bytes = 0;
}

void PoolDispatcher::fail_held(PoolWorker& w, std::exception_ptr err,
                               std::vector<Completion>& done) {
  for (auto& s : w.outstanding) fail_chunk(s.task.job, s.task.chunk, err, done);
  w.outstanding.clear();
  w.outstanding_bytes = 0;
}

void PoolDispatcher::fail_pending(std::exception_ptr err, std::vector<Completion>& done) {
  for (auto& t : pending_) fail_chunk(t.job, t.chunk, err, done);
  pending_.clear();
}

void PoolDispatcher::fail_chunk(uint64_t job, uint32_t chunk, std::exception_ptr err,
                                std::vector<Completion>& done) {
  auto it = jobs_.find(job);
  if (it == jobs_.end()) return;
  done.push_back(Completion{it->second.state, chunk, {}, err, {}});
  if (++it->second.finished == it->second.state->chunks.size()) jobs_.erase(it);
}

}  // namespace detail
}  // namespace torchpar
