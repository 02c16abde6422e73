// `torchpar serve`: an HTTP inference server over the TensorParallel engine. OpenAI-style
// completions (server-sent events when streaming), continuous batching (TensorParallel::step),
// /health and /metrics. HTTP is cpp-httplib's (Debian's libcpp-httplib-dev), JSON
// nlohmann-json's. docs/serving.md is the user's guide.
#include <fcntl.h>
#include <fmt/format.h>
#include <httplib.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <deque>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "serve_protocol.h"
#include "text.h"
#include "torchpar/core/error.h"
#include "torchpar/parallel/gpt_checkpoint.h"
#include "torchpar/parallel/tensor_parallel.h"

namespace torchpar::cli {
namespace {

using serve::Clock;
using serve::Completion;
using serve::error_body;
using serve::json;
using serve::parse_completion;
using Seconds = std::chrono::duration<double>;

struct ServeConfig {
  std::string checkpoint;
  int tensor_parallel = 1;
  std::string host = "127.0.0.1";
  int port = 8000;
  int64_t max_batch = 8;
  int64_t max_queue = 64;
  int64_t max_new_tokens = 256;
  std::string api_key_file;
  std::string dtype = "float32";
  std::string backend = "auto";
  int threads_per_worker = 0;
  double timeout = 300;
  double drain_timeout = 30;
  uint64_t seed = 0;
  bool has_seed = false;
};

// ---- the server ---------------------------------------------------------------------------------

enum class Status { kLoading, kReady, kDraining, kBroken };

const char* status_name(Status s) {
  switch (s) {
    case Status::kLoading:
      return "loading";
    case Status::kReady:
      return "ready";
    case Status::kDraining:
      return "draining";
    case Status::kBroken:
      return "broken";
  }
  return "unknown";
}

/// Write end of the pipe SIGTERM / SIGINT write to (async-signal-safe).
int g_signal_pipe = -1;

extern "C" void on_stop_signal(int) {
  const char byte = 1;
  if (g_signal_pipe >= 0) (void)!::write(g_signal_pipe, &byte, 1);
}

class Serve {
 public:
  explicit Serve(const ServeConfig& c) : c_(c) {}

  int run() {
    resolve_checkpoint();
    read_api_key();
    const bool loopback = c_.host == "127.0.0.1" || c_.host == "localhost" || c_.host == "::1";
    if (!loopback && api_key_.empty())
      throw ValueError(fmt::format(
          "--host {} is reachable from other machines: give --api-key-file too (every request "
          "then needs its key), or serve on 127.0.0.1",
          c_.host));
    setup_routes();
    const int port = c_.port == 0 ? http_.bind_to_any_port(c_.host)
                                  : (http_.bind_to_port(c_.host, c_.port) ? c_.port : -1);
    if (port <= 0)
      throw Error(
          fmt::format("torchpar serve: cannot listen on {}:{} (in use, or not an address "
                      "of this machine)",
                      c_.host, c_.port));
    // httplib listens with a backlog of 5: 32 clients connecting at once overflowed it and
    // some waited for the kernel's SYN retry (1 s and more). listen() again sets a larger one.
    if (listen_fd_ >= 0) ::listen(listen_fd_, SOMAXCONN);
    fmt::print("torchpar serve: listening on http://{}:{}\n", c_.host, port);
    std::fflush(stdout);

    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) throw Error("torchpar serve: pipe2 failed");
    g_signal_pipe = fds[1];
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    ::sigemptyset(&sa.sa_mask);
    ::sigaction(SIGTERM, &sa, nullptr);
    ::sigaction(SIGINT, &sa, nullptr);
    std::signal(SIGPIPE, SIG_IGN);

    std::thread listener([this] { http_.listen_after_bind(); });
    std::thread drainer([this, fd = fds[0]] {
      char byte = 0;
      while (::read(fd, &byte, 1) < 0 && errno == EINTR) {
      }
      if (byte == 1) drain();
    });
    int rc = 0;
    try {
      load();
      std::thread scheduler([this] { schedule(); });
      scheduler.join();
    } catch (const std::exception& e) {
      fmt::print(stderr, "torchpar serve: error: {}\n", e.what());
      rc = 1;
    }
    // Here: drained, broken or failed to load. Broken stays up (health says why) until a signal.
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (status_ == Status::kBroken && rc == 0) {
        fmt::print(stderr, "torchpar serve: broken ({}); answering 503 until SIGTERM\n", reason_);
        stopped_.wait(lock, [this] { return draining_done_; });
      }
    }
    if (engine_) engine_->shutdown(std::chrono::duration<double>(10));
    on_stop_signal(0);  // wakes the drainer if no signal came
    http_.stop();
    listener.join();
    drainer.join();
    ::close(fds[0]);
    g_signal_pipe = -1;
    ::close(fds[1]);
    return rc;
  }

 private:
  // ---- start ----

  void resolve_checkpoint() {
    namespace fs = std::filesystem;
    std::error_code ec;
    fs::path p = c_.checkpoint;
    if (fs::is_directory(p, ec)) p /= "model.pt";
    if (!fs::is_regular_file(p, ec))
      throw ValueError(fmt::format(
          "--checkpoint {}: no model.pt there (give the directory `torchpar train --model gpt` "
          "wrote, or its model.pt)",
          c_.checkpoint));
    model_path_ = p.string();
    model_name_ = fs::absolute(p).parent_path().filename().string();
    info_ = load_gpt_checkpoint_info(model_path_);
    if (info_.tokenizer != "bytes")
      throw ValueError(fmt::format(
          "'{}' says tokenizer \"{}\"; torchpar serve knows \"bytes\" only (token = byte value)",
          gpt_checkpoint_info_path(model_path_), info_.tokenizer));
  }

  void read_api_key() {
    if (c_.api_key_file.empty()) return;
    std::ifstream f(c_.api_key_file, std::ios::binary);
    if (!f) throw ValueError(fmt::format("--api-key-file {}: cannot read it", c_.api_key_file));
    std::stringstream ss;
    ss << f.rdbuf();
    std::string key = ss.str();
    const auto first = key.find_first_not_of(" \t\r\n");
    const auto last = key.find_last_not_of(" \t\r\n");
    api_key_ = first == std::string::npos ? "" : key.substr(first, last - first + 1);
    if (api_key_.empty())
      throw ValueError(fmt::format("--api-key-file {} is empty", c_.api_key_file));
  }

  void load() {
    const auto t0 = Clock::now();
    auto engine = std::make_unique<TensorParallel>(
        model_path_, TensorParallelOptions{
                         .world_size = c_.tensor_parallel,
                         .dtype = dtype_from_string(c_.dtype),
                         .timeout = Seconds(c_.timeout),
                         .backend = backend_from_string(c_.backend),
                         .threads_per_worker = c_.threads_per_worker,
                         .seed = c_.has_seed ? std::optional<uint64_t>(c_.seed) : std::nullopt});
    // Warm-up: the first prefill and decode of a process pay for LibTorch's first use of
    // each shape (~30 ms on the tiny test model); the first client should not.
    engine->step({{.id = -1, .prompt_ids = at::full({2}, 32L, at::kLong), .greedy = true}}, {});
    engine->step({}, {});
    engine->step({}, {-1});
    {
      std::lock_guard<std::mutex> lock(mu_);
      engine_ = std::move(engine);
      if (status_ == Status::kLoading) status_ = Status::kReady;
    }
    fmt::print("torchpar serve: ready (tensor parallel {}, {}, max batch {}, {:.2f} s to load)\n",
               c_.tensor_parallel, c_.dtype, c_.max_batch, Seconds(Clock::now() - t0).count());
    std::fflush(stdout);
  }

  // ---- the batch ----

  /// The scheduler thread: admits waiting requests into the running batch between steps,
  /// runs TensorParallel::step, hands every token to its request. Returns when drained or
  /// broken.
  void schedule() {
    for (;;) {
      std::vector<StepJoin> join;
      std::vector<int64_t> leave;
      {
        std::unique_lock<std::mutex> lock(mu_);
        const auto has_work = [this] {
          return stop_scheduler_ || !waiting_.empty() || !running_.empty();
        };
        while (!work_.wait_for(lock, std::chrono::seconds(1), has_work)) {
          // Idle: a worker that died now would otherwise show only at the next request.
          if (const auto dead = serve::dead_worker(engine_->pids())) {
            lock.unlock();
            broken(*dead);
            return;
          }
        }
        for (auto it = running_.begin(); it != running_.end();) {
          if (it->second->done || it->second->cancelled) {
            it->second->done = true;
            leave.push_back(static_cast<int64_t>(it->first));
            it = running_.erase(it);
          } else {
            ++it;
          }
        }
        if (stop_scheduler_ && running_.empty() && waiting_.empty()) return;
        while (static_cast<int64_t>(running_.size()) < c_.max_batch && !waiting_.empty()) {
          auto r = std::move(waiting_.front());
          waiting_.pop_front();
          if (r->done || r->cancelled) {
            r->done = true;
            r->cv.notify_all();
            continue;
          }
          std::vector<int64_t> ids(r->prompt.begin(), r->prompt.end());
          for (auto& id : ids) id &= 0xFF;  // bytes: char may be signed
          join.push_back(StepJoin{.id = static_cast<int64_t>(r->id),
                                  .prompt_ids = at::tensor(ids, at::TensorOptions(at::kLong)),
                                  .temperature = r->temperature,
                                  .top_k = r->top_k,
                                  .greedy = r->temperature == 0,
                                  .seed = r->seed});
          running_[r->id] = std::move(r);
        }
        if (running_.empty() && leave.empty()) continue;
      }
      StepResult result;
      try {
        result = engine_->step(join, leave);
      } catch (const std::exception& e) {
        broken(e.what());
        return;
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (!result.ids.empty()) {  // a step that only let sequences leave decoded nothing
        ++m_.steps;
        m_.batch_size.observe(static_cast<double>(result.ids.size()));
      }
      const auto now = Clock::now();
      for (size_t i = 0; i < result.ids.size(); ++i) {
        const auto it = running_.find(static_cast<uint64_t>(result.ids[i]));
        if (it == running_.end()) continue;
        Completion& r = *it->second;
        if (r.done) continue;
        add_token(r, result.tokens[i], now);
        r.cv.notify_all();
      }
    }
  }

  void add_token(Completion& r, int64_t token, Clock::time_point now) {
    r.bytes.push_back(token_byte(token));
    ++r.tokens;
    ++m_.generated_tokens;
    if (!r.first_token) {
      r.first_token = now;
      m_.ttft.observe(Seconds(now - r.arrived).count());
    } else {
      m_.tpot.observe(Seconds(now - r.last_token).count());
    }
    r.last_token = now;
    size_t cut = std::string::npos;
    for (const auto& s : r.stop) {
      const size_t from = r.bytes.size() > s.size() ? r.bytes.size() - s.size() : 0;
      const size_t at = r.bytes.find(s, from > 0 ? from - 1 : 0);
      if (at != std::string::npos) cut = std::min(cut, at);
    }
    if (cut != std::string::npos) {
      finish(r, "stop", cut);
    } else if (r.tokens >= r.max_tokens) {
      finish(r, "length", r.bytes.size());
    }
  }

  void finish(Completion& r, const char* reason, size_t text_end) {
    r.done = true;
    r.finish_reason = reason;
    r.text_end = text_end;
    m_.duration.observe(Seconds(Clock::now() - r.arrived).count());
    work_.notify_all();  // it leaves at the next step, even if nothing else runs
  }

  /// Every request fails: a worker died or timed out. The server stays up, broken.
  void broken(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = Status::kBroken;
    reason_ = why;
    fmt::print(stderr, "torchpar serve: the engine failed: {}\n", why);
    for (auto& [id, r] : running_) fail(*r, 500, "server_error", why);
    for (auto& r : waiting_) fail(*r, 503, "unavailable", "the server is broken: " + why);
    running_.clear();
    waiting_.clear();
  }

  static void fail(Completion& r, int status, const std::string& type, const std::string& message) {
    if (r.done) return;
    r.done = true;
    r.error_status = status;
    r.error_type = type;
    r.error_message = message;
    r.cv.notify_all();
  }

  /// SIGTERM: no new requests; the queued and running ones finish within --drain-timeout,
  /// then the scheduler ends.
  void drain() {
    std::unique_lock<std::mutex> lock(mu_);
    if (status_ == Status::kReady) {
      fmt::print(stderr, "torchpar serve: draining ({} running, {} queued)\n", running_.size(),
                 waiting_.size());
      status_ = Status::kDraining;
      reason_ = "the server is shutting down";
    }
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(Seconds(c_.drain_timeout));
    while ((!running_.empty() || !waiting_.empty()) && status_ == Status::kDraining &&
           Clock::now() < deadline)
      drained_.wait_until(lock, std::min(deadline, Clock::now() + std::chrono::milliseconds(50)));
    for (auto& [id, r] : running_)
      fail(*r, 503, "unavailable", "the server shut down before this request finished");
    for (auto& r : waiting_)
      fail(*r, 503, "unavailable", "the server shut down before this request started");
    waiting_.clear();
    stop_scheduler_ = true;
    draining_done_ = true;
    work_.notify_all();
    stopped_.notify_all();
  }

  // ---- HTTP ----

  void setup_routes() {
    const int64_t threads = std::max<int64_t>(16, c_.max_batch + c_.max_queue + 8);
    http_.new_task_queue = [threads] {
      return new httplib::ThreadPool(static_cast<size_t>(threads));
    };
    http_.set_payload_max_length(1 << 20);
    http_.set_keep_alive_timeout(5);
    http_.set_keep_alive_max_count(1000);
    // SO_REUSEADDR only (httplib's default adds SO_REUSEPORT: another process of this user could
    // then bind the same port and take requests); the socket is kept for its backlog (below).
    http_.set_socket_options([this](int sock) {
      const int yes = 1;
      ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
      // Inherited by every accepted connection: each streamed token goes out at once, not
      // after the client's delayed ACK (Nagle's algorithm held the second write ~40 ms).
      ::setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof(yes));
      listen_fd_ = sock;
    });
    http_.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (api_key_.empty() || authorized(req)) return httplib::Server::HandlerResponse::Unhandled;
      res.status = 401;
      res.set_header("WWW-Authenticate", "Bearer");
      res.set_content(error_body("a valid API key is needed: Authorization: Bearer <key>",
                                 "authentication_error")
                          .dump(),
                      "application/json");
      return httplib::Server::HandlerResponse::Handled;
    });
    http_.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      const std::string what = res.status == 404   ? "no such endpoint (POST /v1/completions, "
                                                     "GET /health, GET /metrics)"
                               : res.status == 413 ? "the body is larger than 1 MiB"
                                                   : fmt::format("HTTP status {}", res.status);
      res.set_content(error_body(fmt::format("{} {}: {}", req.method, req.path, what),
                                 res.status == 404 ? "not_found_error" : "invalid_request_error")
                          .dump(),
                      "application/json");
    });
    http_.set_logger([this](const httplib::Request&, const httplib::Response& res) {
      std::lock_guard<std::mutex> lock(mu_);
      ++m_.requests[res.status];
    });
    http_.Get("/health", [this](const httplib::Request&, httplib::Response& res) { health(res); });
    http_.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(metrics(), "text/plain; version=0.0.4");
    });
    http_.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
      completions(req, res);
    });
  }

  bool authorized(const httplib::Request& req) const {
    const std::string h = req.get_header_value("Authorization");
    const std::string expected = "Bearer " + api_key_;
    if (h.size() != expected.size()) return false;
    unsigned char diff = 0;  // constant time in the key's bytes
    for (size_t i = 0; i < h.size(); ++i) diff |= static_cast<unsigned char>(h[i] ^ expected[i]);
    return diff == 0;
  }

  void health(httplib::Response& res) {
    std::lock_guard<std::mutex> lock(mu_);
    json body{{"status", status_name(status_)},
              {"tensor_parallel", c_.tensor_parallel},
              {"max_batch", c_.max_batch},
              {"running", running_.size()},
              {"queue_depth", waiting_.size()}};
    if (status_ != Status::kReady) body["reason"] = reason_.empty() ? "loading the model" : reason_;
    res.status = status_ == Status::kReady ? 200 : 503;
    res.set_content(body.dump(), "application/json");
  }

  std::string metrics() {
    std::lock_guard<std::mutex> lock(mu_);
    return m_.text(waiting_.size(), running_.size(), c_.max_batch);
  }

  static void reply_error(httplib::Response& res, int status, const std::string& message,
                          const std::string& type) {
    res.status = status;
    res.set_content(error_body(message, type).dump(), "application/json");
  }

  void completions(const httplib::Request& req, httplib::Response& res) {
    std::shared_ptr<Completion> r;
    try {
      r = parse_completion(req.body, c_.max_new_tokens, info_.config.n_positions);
    } catch (const ValueError& e) {
      reply_error(res, 400, e.what(), "invalid_request_error");
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (status_ != Status::kReady) {
        reply_error(res, 503,
                    fmt::format("the server is {}: {}", status_name(status_),
                                reason_.empty() ? "loading the model" : reason_),
                    "unavailable");
        return;
      }
      // --max-queue counts the requests that wait beyond the batch's free slots.
      const int64_t free_slots =
          std::max<int64_t>(0, c_.max_batch - static_cast<int64_t>(running_.size()));
      if (static_cast<int64_t>(waiting_.size()) >= c_.max_queue + free_slots) {
        reply_error(res, 503,
                    fmt::format("the server is overloaded: {} requests wait already "
                                "(--max-queue); retry later",
                                waiting_.size()),
                    "overloaded_error");
        return;
      }
      r->id = next_id_++;
      m_.prompt_tokens += r->prompt.size();
      if (r->max_tokens == 0) {
        r->done = true;
        r->finish_reason = "length";
      } else {
        waiting_.push_back(r);
        work_.notify_all();
      }
    }
    const std::string cmpl = fmt::format("cmpl-{}", r->id);
    const auto created = static_cast<int64_t>(std::time(nullptr));
    const auto chunk = [this, cmpl, created](const std::string& text, const json& reason) {
      return json{{"id", cmpl},
                  {"object", "text_completion"},
                  {"created", created},
                  {"model", model_name_},
                  {"choices", json::array({{{"index", 0},
                                            {"text", text},
                                            {"logprobs", nullptr},
                                            {"finish_reason", reason}}})}};
    };
    if (!r->stream) {
      std::unique_lock<std::mutex> lock(mu_);
      while (!r->done) r->cv.wait_for(lock, std::chrono::seconds(1));
      if (r->error_status != 0) {
        reply_error(res, r->error_status, r->error_message, r->error_type);
        return;
      }
      json body = chunk(valid_utf8(r->bytes.substr(0, r->text_end)), r->finish_reason);
      body["usage"] = {{"prompt_tokens", r->prompt.size()},
                       {"completion_tokens", r->tokens},
                       {"total_tokens", static_cast<int64_t>(r->prompt.size()) + r->tokens}};
      res.set_content(body.dump(), "application/json");
      return;
    }
    stream(res, r, chunk);
  }

  /// Streaming: one event per token, then the finishing chunk and [DONE] (or an error event).
  template <class Chunk>
  void stream(httplib::Response& res, const std::shared_ptr<Completion>& r, const Chunk& chunk) {
    auto sent = std::make_shared<int64_t>(0);
    auto shown = std::make_shared<size_t>(0);
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, r, sent, shown, chunk](size_t, httplib::DataSink& sink) {
          std::string out;
          bool last = false;
          {
            std::unique_lock<std::mutex> lock(mu_);
            while (*sent == r->tokens && !r->done) r->cv.wait_for(lock, std::chrono::seconds(1));
            for (; *sent < r->tokens; ++*sent) {
              const size_t end = std::max(*shown, r->shown_end(static_cast<size_t>(*sent) + 1));
              const size_t to = std::min(end, r->done ? r->text_end : end);
              std::string piece;
              if (to > *shown) {
                piece = valid_utf8(r->bytes.substr(*shown, to - *shown));
                *shown = to;
              }
              out += "data: " + chunk(piece, nullptr).dump() + "\n\n";
            }
            if (r->done) {
              last = true;
              if (r->error_status != 0) {
                out += "data: " + error_body(r->error_message, r->error_type).dump() + "\n\n";
              } else {
                const std::string rest =
                    r->text_end > *shown ? r->bytes.substr(*shown, r->text_end - *shown) : "";
                out += "data: " + chunk(valid_utf8(rest), r->finish_reason).dump() + "\n\n";
                out += "data: [DONE]\n\n";
              }
            }
          }
          if (!out.empty() && !sink.write(out.data(), out.size())) {
            cancel(*r);
            return false;
          }
          if (last) sink.done();
          return true;
        },
        [this, r](bool success) {
          if (!success) cancel(*r);
        });
  }

  /// The client went away: the request leaves the batch at the next step.
  void cancel(Completion& r) {
    std::lock_guard<std::mutex> lock(mu_);
    if (r.done) return;
    r.cancelled = true;
    r.done = true;
    work_.notify_all();
  }

  const ServeConfig& c_;
  std::string model_path_;
  std::string model_name_;
  GptCheckpointInfo info_;
  std::string api_key_;
  httplib::Server http_;
  int listen_fd_ = -1;
  std::unique_ptr<TensorParallel> engine_;

  std::mutex mu_;
  std::condition_variable work_;     // the scheduler waits for requests
  std::condition_variable drained_;  // drain() waits for the batch to empty
  std::condition_variable stopped_;  // run() waits for a signal when broken
  Status status_ = Status::kLoading;
  std::string reason_;
  bool stop_scheduler_ = false;
  bool draining_done_ = false;
  uint64_t next_id_ = 1;
  std::deque<std::shared_ptr<Completion>> waiting_;
  std::map<uint64_t, std::shared_ptr<Completion>> running_;

  serve::Metrics m_;  // guarded by mu_
};

}  // namespace

Command add_serve(CLI::App& app) {
  auto c = std::make_shared<ServeConfig>();
  auto* cmd = app.add_subcommand(
      "serve",
      "Serve a GPT checkpoint (model.pt + model.json, as `torchpar train --model gpt` writes it) "
      "over HTTP: OpenAI-style POST /v1/completions (streaming with server-sent events), GET "
      "/health, GET /metrics (Prometheus). Requests join and leave the running batch between "
      "decoding steps (continuous batching) on N tensor-parallel worker processes. SIGTERM "
      "drains.");
  cmd->add_option("--checkpoint", c->checkpoint,
                  "directory holding model.pt and model.json (or the model.pt file)")
      ->required();
  cmd->add_option("--tp,--tensor-parallel", c->tensor_parallel,
                  "worker processes the model is split over (divides the heads and widths)")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  cmd->add_option("--host", c->host,
                  "address to listen on; one that is not loopback needs --api-key-file")
      ->capture_default_str();
  cmd->add_option("--port", c->port, "TCP port; 0: any free one (printed)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  cmd->add_option("--max-batch", c->max_batch, "most sequences decoded together")
      ->check(CLI::Range(int64_t{1}, int64_t{4096}))
      ->capture_default_str();
  cmd->add_option("--max-queue", c->max_queue,
                  "most requests waiting for a batch slot; more are answered 503")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20))
      ->capture_default_str();
  cmd->add_option("--max-new-tokens", c->max_new_tokens, "the largest max_tokens a request may ask")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20))
      ->capture_default_str();
  cmd->add_option("--api-key-file", c->api_key_file,
                  "file holding the API key: every request then needs Authorization: Bearer <key>");
  add_worker_options(cmd, c->dtype, c->backend, c->threads_per_worker);
  cmd->add_option("--timeout", c->timeout,
                  "seconds: loading the model, and each decoding step (a worker that stops "
                  "answering breaks the server)")
      ->check(finite_number(0, kMaxTimeoutSeconds, /*lo_open=*/true))
      ->capture_default_str();
  cmd->add_option("--drain-timeout", c->drain_timeout,
                  "seconds SIGTERM waits for running and queued requests before failing them")
      ->check(finite_number(0, kMaxTimeoutSeconds))
      ->capture_default_str();
  auto* seed = cmd->add_option("--seed", c->seed,
                               "seed of sampling for requests without their own (default: random)")
                   ->check(decimal_integer<uint64_t>());
  return [c, seed] {
    c->has_seed = seed->count() > 0;
    Serve serve(*c);
    return serve.run();
  };
}

}  // namespace torchpar::cli
