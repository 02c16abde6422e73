#pragma once
// `torchpar serve`'s protocol: a completion request (its fields, checked, and the state the
// scheduler and the HTTP handler share), the error body, the metrics' histograms. Included by
// serve_cmd.cpp only.

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "text.h"
#include "torchpar/core/error.h"

namespace torchpar::cli::serve {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// ---- metrics ------------------------------------------------------------------------------------

/// A Prometheus histogram: cumulative buckets, sum and count.
struct Histogram {
  std::vector<double> bounds;
  std::vector<uint64_t> counts = std::vector<uint64_t>(bounds.size() + 1, 0);
  double sum = 0;
  uint64_t count = 0;

  void observe(double v) {
    const auto i = std::lower_bound(bounds.begin(), bounds.end(), v) - bounds.begin();
    ++counts[static_cast<size_t>(i)];
    sum += v;
    ++count;
  }
  void write(std::string& out, const std::string& name, const std::string& help) const {
    out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
    uint64_t cumulative = 0;
    for (size_t i = 0; i < bounds.size(); ++i) {
      cumulative += counts[i];
      out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds[i], cumulative);
    }
    out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, count, name,
                       sum, name, count);
  }
};

inline Histogram seconds_histogram() {
  return Histogram{
      .bounds = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}};
}

/// The server's counters and histograms (Prometheus names in text()). Not thread-safe: the
/// server guards it with its mutex.
struct Metrics {
  std::map<int, uint64_t> requests;  // by HTTP status
  uint64_t prompt_tokens = 0;
  uint64_t generated_tokens = 0;
  uint64_t steps = 0;
  Histogram batch_size{.bounds = {1, 2, 4, 8, 16, 32, 64, 128}};
  Histogram ttft = seconds_histogram();
  Histogram tpot = seconds_histogram();
  Histogram duration = seconds_histogram();

  /// The Prometheus text exposition (format 0.0.4), with the gauges given.
  std::string text(size_t queue_depth, size_t running, int64_t max_batch) const {
    std::string out =
        "# HELP torchpar_serve_requests_total HTTP requests answered, by status code.\n"
        "# TYPE torchpar_serve_requests_total counter\n";
    for (const auto& [code, n] : requests)
      out += fmt::format("torchpar_serve_requests_total{{code=\"{}\"}} {}\n", code, n);
    const auto one = [&](const char* type, const char* name, const char* help, double v) {
      out += fmt::format("# HELP {} {}\n# TYPE {} {}\n{} {}\n", name, help, name, type, name, v);
    };
    one("counter", "torchpar_serve_prompt_tokens_total", "Prompt tokens of admitted requests.",
        static_cast<double>(prompt_tokens));
    one("counter", "torchpar_serve_generated_tokens_total", "Tokens generated.",
        static_cast<double>(generated_tokens));
    one("counter", "torchpar_serve_steps_total", "Decoding steps of the running batch.",
        static_cast<double>(steps));
    one("gauge", "torchpar_serve_queue_depth", "Requests waiting for a batch slot.",
        static_cast<double>(queue_depth));
    one("gauge", "torchpar_serve_running", "Sequences in the running batch.",
        static_cast<double>(running));
    one("gauge", "torchpar_serve_max_batch", "Most sequences in the running batch (--max-batch).",
        static_cast<double>(max_batch));
    batch_size.write(out, "torchpar_serve_batch_size", "Sequences per decoding step.");
    ttft.write(out, "torchpar_serve_time_to_first_token_seconds",
               "From a request's arrival to its first token.");
    tpot.write(out, "torchpar_serve_time_per_token_seconds",
               "Between consecutive tokens of one request.");
    duration.write(out, "torchpar_serve_request_duration_seconds",
                   "From a request's arrival to its last token.");
    return out;
  }
};

/// "TensorParallel worker rank R (pid P) exited ..." for the first of `pids` (by rank) that is
/// gone or a zombie (its /proc/<pid>/stat state), else nullopt.
inline std::optional<std::string> dead_worker(const std::vector<int>& pids) {
  for (size_t rank = 0; rank < pids.size(); ++rank) {
    std::ifstream stat(fmt::format("/proc/{}/stat", pids[rank]));
    std::string line;
    std::getline(stat, line);
    const auto paren = line.rfind(')');
    if (!stat || paren == std::string::npos || paren + 2 >= line.size() || line[paren + 2] == 'Z' ||
        line[paren + 2] == 'X')
      return fmt::format("TensorParallel worker rank {} (pid {}) exited while the server was idle",
                         rank, pids[rank]);
  }
  return std::nullopt;
}

// ---- one request --------------------------------------------------------------------------------

/// One completion request, from admission to its last byte. Every field after `arrived` is
/// guarded by Serve::mu.
struct Completion {
  uint64_t id = 0;
  std::string prompt;
  int64_t max_tokens = 16;
  double temperature = 1.0;
  int64_t top_k = 0;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  bool stream = false;
  Clock::time_point arrived = Clock::now();

  std::string bytes;  // one byte per generated token
  int64_t tokens = 0;
  bool done = false;  // finished, failed or abandoned: it leaves the batch at the next step
  std::string finish_reason;
  size_t text_end = 0;  // done: the bytes that make the text (a stop string cut off)
  int error_status = 0;
  std::string error_type;
  std::string error_message;
  bool cancelled = false;  // the client went away
  std::optional<Clock::time_point> first_token;
  Clock::time_point last_token{};
  std::condition_variable cv;

  /// Bytes a stream may show now: not the end of `bytes` that could still turn into a stop
  /// string (or is one), nor an unfinished UTF-8 character.
  size_t shown_end(size_t len) const {
    size_t hold = 0;
    for (const auto& s : stop) {
      for (size_t k = std::min(s.size(), len); k > hold; --k) {
        if (bytes.compare(len - k, k, s, 0, k) == 0) {
          hold = k;
          break;
        }
      }
    }
    return utf8_complete_prefix(bytes.substr(0, len - hold));
  }
};

inline json error_body(const std::string& message, const std::string& type) {
  return json{{"error", {{"message", message}, {"type", type}, {"code", nullptr}}}};
}

/// A POST /v1/completions body, checked against the server's --max-new-tokens and the model's
/// n_positions. Errors: ValueError naming the problem (the server answers 400 with it).
inline std::shared_ptr<Completion> parse_completion(const std::string& body, int64_t max_new_tokens,
                                                    int64_t n_positions) {
  const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw ValueError("the body is not JSON");
  if (!j.is_object()) throw ValueError("the body must be a JSON object");
  auto r = std::make_shared<Completion>();
  bool has_prompt = false;
  for (const auto& [key, v] : j.items()) {
    if (key == "prompt") {
      if (!v.is_string()) throw ValueError("prompt must be a string");
      r->prompt = v.get<std::string>();
      has_prompt = true;
    } else if (key == "model") {
      if (!v.is_string()) throw ValueError("model must be a string");
    } else if (key == "max_tokens") {
      if (!v.is_number_integer() || v.get<int64_t>() < 0)
        throw ValueError("max_tokens must be an integer >= 0");
      r->max_tokens = v.get<int64_t>();
    } else if (key == "temperature") {
      if (!v.is_number() || !(v.get<double>() >= 0) || !std::isfinite(v.get<double>()))
        throw ValueError("temperature must be a finite number >= 0");
      r->temperature = v.get<double>();
    } else if (key == "top_k") {
      if (!v.is_number_integer() || v.get<int64_t>() < 0)
        throw ValueError("top_k must be an integer >= 0");
      r->top_k = v.get<int64_t>();
    } else if (key == "seed") {
      if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0))
        throw ValueError("seed must be an integer in [0, 2^64)");
      r->seed = v.get<uint64_t>();
    } else if (key == "stop") {
      if (v.is_string()) {
        r->stop.push_back(v.get<std::string>());
      } else if (v.is_array() && v.size() <= 4) {
        for (const auto& s : v) {
          if (!s.is_string()) throw ValueError("stop must be a string or up to 4 strings");
          r->stop.push_back(s.get<std::string>());
        }
      } else if (!v.is_null()) {
        throw ValueError("stop must be a string or up to 4 strings");
      }
      for (const auto& s : r->stop) {
        if (s.empty()) throw ValueError("a stop string is empty");
      }
    } else if (key == "stream") {
      if (!v.is_boolean()) throw ValueError("stream must be true or false");
      r->stream = v.get<bool>();
    } else {
      throw ValueError(fmt::format(
          "unknown field \"{}\" (this server takes prompt, model, max_tokens, temperature, "
          "top_k, seed, stop, stream)",
          key));
    }
  }
  if (!has_prompt || r->prompt.empty()) throw ValueError("prompt is missing or empty");
  if (r->max_tokens > max_new_tokens)
    throw ValueError(fmt::format("max_tokens {} is above this server's --max-new-tokens {}",
                                 r->max_tokens, max_new_tokens));
  const auto length = static_cast<int64_t>(r->prompt.size());
  if (length + r->max_tokens > n_positions)
    throw ValueError(fmt::format(
        "the prompt ({} tokens) and max_tokens {} exceed the model's context of {} positions "
        "(n_positions)",
        length, r->max_tokens, n_positions));
  return r;
}

}  // namespace torchpar::cli::serve
