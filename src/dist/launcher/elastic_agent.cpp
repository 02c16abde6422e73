// The elastic agent: one per node, rounds of rendezvous through torchpar's authenticated
// store, the node's ranks started per round and watched, heartbeats, growth and restarts.
//
// Store layout (every key under "elastic/<rdzv_id>/"; docs/distributed.md, "Elastic jobs"):
//   current          the round being gathered or run (decimal; missing: 0)
//   r<R>/joined      counter: a node's join index is the value its add() returned, minus 1
//   alive/<id>       counter: the agent <id>'s heartbeat, advanced every monitor interval
//                    while it gathers, waits or runs a round
//   conn/<id>        set by agent <id> as an ephemeral key: the store erases it when the
//                    agent's connection ends, so a killed agent is known gone at once
//   r<R>/node<i>     {"addr","host","nproc","id"} of join index i
//   r<R>/expect      nodes the round waits for before closing early (set when R-1 ended)
//   r<R>/closed      the number of nodes in the round (first compareSet wins); join indices
//                    below it are the round's nodes, in group-rank order; later ones wait
//   r<R>/master      {"addr","port","restarts"}: group rank 0's MASTER_ADDR/PORT, restarts used
//   r<R>/done        counter: nodes whose ranks all exited 0
//   r<R>/waiting     counter: nodes that arrived after the round closed
//   r<R>/end         {"kind","code","rank","node","what"}: why the round ended (first wins);
//                    kind: done | grow | failed | lost | left
//   r<R>/exited      counter: agents that exited after R ended (the store's host waits)
#include "dist/launcher/elastic_agent.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "dist/launcher/local_ranks.h"
#include "dist/store.h"
#include "torchpar/core/auth.h"
#include "torchpar/core/error.h"
#include "torchpar/core/fd.h"
#include "torchpar/core/syscall.h"
#include "torchpar/dist/elastic_state.h"
#include "torchpar/dist/world.h"

namespace torchpar::detail {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

struct Endpoint {
  std::string host;
  int port = 0;
};

Endpoint parse_endpoint(const std::string& text) {
  const auto colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size()) {
    throw ValueError(fmt::format("--rdzv-endpoint '{}': expected host:port", text));
  }
  Endpoint e;
  e.host = text.substr(0, colon);
  if (e.host.size() > 2 && e.host.front() == '[' && e.host.back() == ']')
    e.host = e.host.substr(1, e.host.size() - 2);
  char* end = nullptr;
  const long port = std::strtol(text.c_str() + colon + 1, &end, 10);
  if (*end != '\0' || port < 1 || port > 65535) {
    throw ValueError(fmt::format("--rdzv-endpoint '{}': the port must be in 1..65535", text));
  }
  e.port = static_cast<int>(port);
  return e;
}

/// The local address of the route to `host` (a connected UDP socket; nothing is sent).
std::string route_source(const Endpoint& to) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(to.host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) {
    throw Error(fmt::format("cannot resolve the rendezvous host '{}' (IPv4)", to.host));
  }
  sockaddr_in a{};
  std::memcpy(&a, res->ai_addr, sizeof a);
  ::freeaddrinfo(res);
  a.sin_port = htons(static_cast<uint16_t>(to.port));
  UniqueFd fd(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!fd) throw_system_error("socket", errno, "route to the rendezvous endpoint");
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    throw_system_error("connect", errno, fmt::format("route to {}", to.host));
  }
  sockaddr_in me{};
  socklen_t len = sizeof me;
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&me), &len) != 0) {
    throw_system_error("getsockname", errno, "route to the rendezvous endpoint");
  }
  char buf[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &me.sin_addr, buf, sizeof buf);
  return buf;
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "unknown";
  return buf;
}

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

/// Why a round ended (r<R>/end).
struct RoundEnd {
  std::string kind;  // done | grow | failed | lost | left
  int code = 0;      // failed: the rank's exit code; lost: 1
  int rank = -1;
  int node = -1;
  std::string what;

  bool failure() const { return kind == "failed" || kind == "lost"; }
  bool node_gone() const { return kind == "lost" || kind == "left"; }
  std::string dump() const {
    return json{{"kind", kind}, {"code", code}, {"rank", rank}, {"node", node}, {"what", what}}
        .dump();
  }
  static RoundEnd parse(const std::string& text) {
    const auto j = json::parse(text);
    return {j.at("kind"), j.at("code"), j.at("rank"), j.at("node"), j.at("what")};
  }
};

/// One closed round as this node takes part in it.
struct Round {
  int64_t number = 0;
  int node = 0;   // group rank: the join index
  int nodes = 0;  // nodes in the round
  int world_size = 0;
  int first_rank = 0;  // this node's first global rank
  std::string master_addr;
  int master_port = 0;
  int restarts = 0;  // restarts used before this round
};

/// How the agent stops: an exit code (for the launcher) after the job ended for this node.
struct Exit {
  int code = 0;
};

class Agent {
 public:
  explicit Agent(const LaunchOptions& o) : o_(o) {}

  int run() {
    const Endpoint ep =
        parse_endpoint(o_.rdzv_endpoint.empty() ? "127.0.0.1:29400" : o_.rdzv_endpoint);
    endpoint_ = fmt::format("{}:{}", ep.host, ep.port);
    local_addr_ = o_.local_addr.empty() ? route_source(ep) : o_.local_addr;
    host_ = host_name();
    id_ = fmt::format("{}/{}/{}", host_, ::getpid(), to_hex(random_authkey(4)));
    prefix_ = fmt::format("elastic/{}/", o_.rdzv_id);
    const AuthKey key = authkey_from_env().value_or(AuthKey{});
    const auto join_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::duration<double>(o_.rdzv_join_seconds));
    // The agent that can listen at the endpoint hosts the store; the others connect.
    try {
      server_ = std::make_unique<StoreServer>(ep.host, ep.port, key, std::chrono::seconds(10));
    } catch (const Error&) {
      server_.reset();  // not this node's address, or another agent listens there already
    }
    // Connect in short tries, so that a signal is seen while the endpoint is not up yet.
    const auto connect_by = Clock::now() + join_ms;
    const std::string role =
        fmt::format("the rendezvous store of job '{}'{}", o_.rdzv_id,
                    server_ ? ", hosted by this agent" : ", hosted by the endpoint's agent");
    for (;;) {
      if (const int sig = o_.pending_signal()) return 128 + sig;
      try {
        store_ = c10::make_intrusive<StoreClient>(ep.host, ep.port, key,
                                                  std::chrono::milliseconds(2000), role);
        break;
      } catch (const TimeoutError&) {
        if (Clock::now() > connect_by) throw;
      }
    }
    store_->setTimeout(std::chrono::seconds(30));
    for (int local = 0; local < o_.nproc_per_node; ++local) {
      for (int s = 0; s < 2; ++s) {
        UniqueFd fd(::memfd_create("torchpar-elastic-state", MFD_CLOEXEC));
        if (!fd) throw_system_error("memfd_create", errno, "elastic state slot");
        slots_.push_back(std::move(fd));
      }
    }
    store_->set_ephemeral(prefix_ + "conn/" + id_, bytes_of(host_));
    if (!has(prefix_ + "current")) cas(prefix_ + "current", "", "0");
    for (;;) {
      Round r;
      if (auto stop = join(&r)) return leave(r.number, *stop);
      std::optional<RoundEnd> end;
      if (auto stop = watch(r, &end)) return leave(r.number, *stop);
      if (end->kind == "done") return leave(r.number, Exit{0});
      if (end->kind == "lost" && end->node == r.node) {
        say("{}: the other nodes lost this node's heartbeat; it leaves the job", end->what);
        return leave(r.number, Exit{1});
      }
      const int next = r.restarts + (end->failure() ? 1 : 0);
      if (end->failure() && next > o_.max_restarts) {
        say("{}; no restart left ({} of {} used): the job fails", end->what, r.restarts,
            o_.max_restarts);
        return leave(r.number, Exit{end->code});
      }
      if (end->failure()) {
        say("round {} ended: {}; restart {} of {}: new rendezvous", r.number, end->what, next,
            o_.max_restarts);
      } else {
        say("round {} ended: {}; new rendezvous (no restart used)", r.number, end->what);
      }
      prepare_next(r.number, *end, r.nodes);
    }
  }

 private:
  template <typename... Args>
  void say(fmt::format_string<Args...> f, Args&&... args) const {
    std::fprintf(stderr, "torchpar run: %s\n", fmt::format(f, std::forward<Args>(args)...).c_str());
  }

  std::string key(int64_t round, const std::string& name) const {
    return fmt::format("{}r{}/{}", prefix_, round, name);
  }
  bool has(const std::string& k) { return store_->check({k}); }
  std::string get(const std::string& k) {
    const auto v = store_->get(k);
    return {v.begin(), v.end()};
  }
  void set(const std::string& k, const std::string& v) { store_->set(k, bytes_of(v)); }
  int64_t add(const std::string& k, int64_t delta) { return store_->add(k, delta); }
  std::string cas(const std::string& k, const std::string& expected, const std::string& desired) {
    const auto v = store_->compareSet(k, bytes_of(expected), bytes_of(desired));
    return {v.begin(), v.end()};
  }

  /// Advances this agent's heartbeat, at most once per monitor interval.
  void beat() {
    const auto now = Clock::now();
    if (now - last_beat_ < seconds(o_.monitor_interval_seconds)) return;
    add(prefix_ + "alive/" + id_, 1);
    last_beat_ = now;
  }

  /// Why the agent `id` is gone, if it is: its connection to the store ended (it died, on a
  /// host that is still up: known at once), or its heartbeat has stood still for the
  /// heartbeat timeout as this agent watched it (an unreachable or stopped host).
  std::optional<std::string> gone(const std::string& id) {
    if (!has(prefix_ + "conn/" + id)) return "its agent's connection to the store closed";
    const int64_t v = add(prefix_ + "alive/" + id, 0);
    const auto now = Clock::now();
    // This agent could not look for a while (the store's host or this agent was stopped):
    // the others' heartbeats could not be seen to move either, so their clocks restart.
    if (now - last_look_ > seconds(o_.heartbeat_timeout_seconds / 2)) {
      for (auto& entry : seen_) entry.second.second = now;
    }
    last_look_ = now;
    auto it = seen_.find(id);
    if (it == seen_.end() || it->second.first != v) {
      seen_[id] = {v, now};
      return std::nullopt;
    }
    if (now - it->second.second <= seconds(o_.heartbeat_timeout_seconds)) return std::nullopt;
    return fmt::format("no heartbeat for {} s", o_.heartbeat_timeout_seconds);
  }

  /// The ids of round R's nodes (join indices below `count` whose record is there yet).
  std::vector<std::string> node_ids(int64_t round, int64_t count) {
    std::vector<std::string> ids;
    for (int64_t i = 0; i < count; ++i) {
      const std::string k = key(round, fmt::format("node{}", i));
      ids.push_back(has(k) ? json::parse(get(k)).at("id").get<std::string>() : "");
    }
    return ids;
  }

  /// The agents of round R-1's nodes that round R may wait for: all but this one and the
  /// one R-1's end named gone (empty for round 0).
  std::vector<std::string> previous_nodes(int64_t R) {
    std::vector<std::string> out;
    if (R == 0 || !has(key(R - 1, "closed"))) return out;
    const auto prev = node_ids(R - 1, std::stoll(get(key(R - 1, "closed"))));
    const auto end = RoundEnd::parse(get(key(R - 1, "end")));
    for (size_t i = 0; i < prev.size(); ++i) {
      if (prev[i].empty() || prev[i] == id_) continue;
      if (end.node_gone() && end.node == static_cast<int>(i)) continue;
      out.push_back(prev[i]);
    }
    return out;
  }

  /// Of `previous` (previous_nodes), those not among round R's first `joined` nodes whose
  /// agents are gone (heartbeat still for the timeout): round R need not wait for them.
  int64_t gone_since_last_round(const std::vector<std::string>& previous, int64_t R,
                                int64_t joined) {
    if (previous.empty()) return 0;
    const auto now_in = node_ids(R, joined);
    int64_t gone = 0;
    for (const auto& id : previous) {
      if (std::find(now_in.begin(), now_in.end(), id) != now_in.end()) continue;
      if (this->gone(id)) ++gone;
    }
    return gone;
  }

  std::optional<Exit> check_signal() {
    const int sig = o_.pending_signal();
    if (sig == 0) return std::nullopt;
    say("got signal {}; this node leaves the job", sig);
    return Exit{128 + sig};
  }

  /// Restarts used before round R: those before R-1, plus one when R-1 ended in a failure.
  /// (A round that ended before it started has no master record: its own count is taken
  /// from the round before.)
  int restarts_before(int64_t round) {
    if (round == 0) return 0;
    const auto end = RoundEnd::parse(get(key(round - 1, "end")));
    const int before = has(key(round - 1, "master"))
                           ? json::parse(get(key(round - 1, "master"))).at("restarts").get<int>()
                           : restarts_before(round - 1);
    return before + (end.failure() ? 1 : 0);
  }

  /// After round R ended: how many nodes R+1 waits for before closing early, and `current`.
  void prepare_next(int64_t round, const RoundEnd& end, int nodes) {
    // Late joiners (join indices past `closed`) are the nodes waiting for the next round,
    // counted also when they had not yet said so.
    const int64_t late = std::max<int64_t>(0, add(key(round, "joined"), 0) - nodes);
    const int64_t expect = nodes - (end.node_gone() ? 1 : 0) + late;
    cas(key(round + 1, "expect"), "", std::to_string(std::max<int64_t>(expect, 1)));
    cas(prefix_ + "current", std::to_string(round), std::to_string(round + 1));
  }

  /// Joins rounds until one closes with this node in it (*r filled), or the job ends for
  /// this node (the returned Exit).
  std::optional<Exit> join(Round* r) {
    const auto pause = std::chrono::milliseconds(50);
    for (;;) {
      const auto deadline = Clock::now() + seconds(o_.rdzv_join_seconds);
      const int64_t R = std::stoll(get(prefix_ + "current"));
      r->number = R;
      const int idx = static_cast<int>(add(key(R, "joined"), 1) - 1);
      set(key(R, fmt::format("node{}", idx)),
          json{{"addr", local_addr_}, {"host", host_}, {"nproc", o_.nproc_per_node}, {"id", id_}}
              .dump());
      std::optional<Clock::time_point> min_since;
      bool told = false;
      const auto previous = previous_nodes(R);
      while (!has(key(R, "closed"))) {
        if (auto stop = check_signal()) return stop;
        beat();
        if (Clock::now() > deadline) {
          say("round {}: {} of at least {} node(s) joined within {} s (--rdzv-join-timeout); "
              "giving up",
              R, add(key(R, "joined"), 0), o_.min_nodes, o_.rdzv_join_seconds);
          return Exit{1};
        }
        const int64_t n = add(key(R, "joined"), 0);
        // A node of the last round that is gone (its agent's heartbeat stands still: killed
        // with its ranks, whose peers' failure ended that round) is not waited for either.
        const int64_t expect =
            (has(key(R, "expect")) ? std::stoll(get(key(R, "expect"))) : o_.max_nodes) -
            gone_since_last_round(previous, R, n);
        if (n >= o_.max_nodes || (n >= o_.min_nodes && n >= expect)) {
          cas(key(R, "closed"), "", std::to_string(std::min<int64_t>(n, o_.max_nodes)));
        } else if (n >= o_.min_nodes) {
          if (!min_since) min_since = Clock::now();
          if (Clock::now() - *min_since >= seconds(o_.rdzv_last_call_seconds))
            cas(key(R, "closed"), "", std::to_string(n));
        } else if (!told) {
          say("round {}: {} of at least {} node(s) joined; waiting for more", R, n, o_.min_nodes);
          told = true;
        }
        std::this_thread::sleep_for(pause);
      }
      const int closed = std::stoi(get(key(R, "closed")));
      if (idx >= closed) {
        say("round {} runs with {} node(s); this node waits to join the next round", R, closed);
        add(key(R, "waiting"), 1);
        while (!has(key(R, "end"))) {
          if (auto stop = check_signal()) {
            add(key(R, "waiting"), -1);  // nobody to grow the job for
            return stop;
          }
          beat();
          if (Clock::now() > deadline) {
            say("round {} did not end within {} s (--rdzv-join-timeout) for this node to "
                "join; giving up",
                R, o_.rdzv_join_seconds);
            add(key(R, "waiting"), -1);
            return Exit{1};
          }
          std::this_thread::sleep_for(seconds(o_.monitor_interval_seconds));
        }
        const auto end = RoundEnd::parse(get(key(R, "end")));
        if (end.kind == "done") {
          say("the job finished while this node waited to join");
          return Exit{0};
        }
        const int used = restarts_before(R);
        if (end.failure() && used + 1 > o_.max_restarts) {
          say("{}; no restart left ({} of {} used): the job fails", end.what, used,
              o_.max_restarts);
          return Exit{end.code};
        }
        prepare_next(R, end, closed);
        continue;
      }
      // The round's records: every node's, then group rank 0's master. A node of the round
      // that is gone before the round starts (it died or quit while the round gathered, or
      // never published itself) ends the round as "left": no restart used, a new round.
      if (auto stop = await_records(R, idx, closed)) return stop;
      if (has(key(R, "end"))) {
        const auto end = RoundEnd::parse(get(key(R, "end")));
        say("round {} ended before it started: {}; new rendezvous", R, end.what);
        prepare_next(R, end, closed);
        continue;
      }
      r->node = idx;
      r->nodes = closed;
      r->world_size = 0;
      r->first_rank = 0;
      for (int i = 0; i < closed; ++i) {
        const int nproc = json::parse(get(key(R, fmt::format("node{}", i)))).at("nproc");
        if (i < idx) r->first_rank += nproc;
        r->world_size += nproc;
      }
      const auto m = json::parse(get(key(R, "master")));
      r->master_addr = m.at("addr");
      r->master_port = m.at("port");
      r->restarts = m.at("restarts");
      return std::nullopt;
    }
  }

  /// Waits until round R (closed with `closed` nodes, this one at `idx`) has every node's
  /// record and its master (published here when idx is 0), or has ended: a node gone, or
  /// one whose record did not come within the heartbeat timeout, ends it as "left".
  std::optional<Exit> await_records(int64_t R, int idx, int closed) {
    const std::string end_key = key(R, "end");
    const auto left = [&](int node, const std::string& why) {
      cas(end_key, "",
          RoundEnd{"left", 0, -1, node, fmt::format("node {} left: {}", node, why)}.dump());
    };
    const auto by = Clock::now() + seconds(o_.heartbeat_timeout_seconds);
    for (;;) {
      if (auto stop = check_signal()) {
        left(idx, fmt::format("its agent got signal {}", stop->code - 128));
        return stop;
      }
      beat();
      if (has(end_key)) return std::nullopt;
      bool all = true;
      for (int i = 0; i < closed && !has(end_key); ++i) {
        const std::string k = key(R, fmt::format("node{}", i));
        if (!has(k)) {
          all = false;
          if (Clock::now() > by) left(i, "it never published itself");
          continue;
        }
        const auto id = json::parse(get(k)).at("id").get<std::string>();
        if (id == id_) continue;
        if (const auto why = gone(id)) left(i, *why);
      }
      if (all && idx == 0 && !has(key(R, "master"))) {
        set(key(R, "master"), json{{"addr", local_addr_},
                                   {"port", find_free_port(/*loopback_only=*/false)},
                                   {"restarts", restarts_before(R)}}
                                  .dump());
      }
      if (all && has(key(R, "master"))) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  std::vector<RankLaunch> launches(const Round& r) const {
    std::vector<RankLaunch> out;
    const char* rpc_addr = std::getenv("TORCHPAR_RPC_ADDR");
    for (int local = 0; local < o_.nproc_per_node; ++local) {
      const int rank = r.first_rank + local;
      const int a = slots_[2 * static_cast<size_t>(local)].get();
      const int b = slots_[2 * static_cast<size_t>(local) + 1].get();
      RankLaunch l{rank,
                   {
                       fmt::format("RANK={}", rank),
                       fmt::format("WORLD_SIZE={}", r.world_size),
                       fmt::format("LOCAL_RANK={}", local),
                       fmt::format("LOCAL_WORLD_SIZE={}", o_.nproc_per_node),
                       fmt::format("GROUP_RANK={}", r.node),
                       fmt::format("GROUP_WORLD_SIZE={}", r.nodes),
                       fmt::format("ROLE_RANK={}", rank),
                       fmt::format("ROLE_WORLD_SIZE={}", r.world_size),
                       fmt::format("MASTER_ADDR={}", r.master_addr),
                       fmt::format("MASTER_PORT={}", r.master_port),
                       fmt::format("TORCHELASTIC_RESTART_COUNT={}", r.restarts),
                       fmt::format("TORCHELASTIC_MAX_RESTARTS={}", o_.max_restarts),
                       fmt::format("TORCHELASTIC_RUN_ID={}", o_.rdzv_id),
                       fmt::format("TORCHPAR_RDZV_ROUND={}", r.number),
                       fmt::format("{}={},{}", kElasticStateFdsEnv, a, b),
                   },
                   {a, b}};
      // RPC listeners bind where the other nodes reach this one, unless the caller chose.
      if (rpc_addr == nullptr || *rpc_addr == '\0')
        l.env.push_back(fmt::format("TORCHPAR_RPC_ADDR={}", local_addr_));
      out.push_back(std::move(l));
    }
    return out;
  }

  /// Runs this node's ranks for round r until the round ends (*end) or the job ends for
  /// this node (the returned Exit).
  std::optional<Exit> watch(const Round& r, std::optional<RoundEnd>* end) {
    const int64_t R = r.number;
    say("round {}: {} node(s), world size {}, restarts used {} of {}; this node is group rank "
        "{} (ranks {}..{}), master {}:{}",
        R, r.nodes, r.world_size, r.restarts, o_.max_restarts, r.node, r.first_rank,
        r.first_rank + o_.nproc_per_node - 1, r.master_addr, r.master_port);
    LocalRanks ranks(o_.program, launches(r), std::chrono::duration<double>(o_.grace_seconds),
                     o_.prefix_output);
    const auto interval = std::chrono::milliseconds(
        std::max<int64_t>(1, static_cast<int64_t>(o_.monitor_interval_seconds * 1000)));
    const auto ids = node_ids(R, r.nodes);
    bool done = false;
    Clock::time_point last_pass{};
    const std::string end_key = key(R, "end");
    const auto finish = [&](const RoundEnd& e) { cas(end_key, "", e.dump()); };
    for (;;) {
      if (auto stop = check_signal()) {
        finish({"left", 0, -1, r.node,
                fmt::format("node {} ({}) left: its agent got signal {}", r.node, host_,
                            stop->code - 128)});
        ranks.terminate(stop->code - 128);
        while (!ranks.finished()) {
          ranks.poll(std::chrono::milliseconds(50));
          beat();
        }
        return stop;
      }
      ranks.poll(interval);
      // The store work below once per interval, however often the ranks' output wakes us.
      if (Clock::now() - last_pass < interval && !ranks.failure() && !ranks.all_exited()) continue;
      last_pass = Clock::now();
      beat();
      if (const auto& f = ranks.failure()) {
        finish({"failed", exit_code_of(f->status), f->rank, r.node,
                fmt::format("rank {} (pid {}) on node {} ({}) {}", f->rank, f->pid, r.node, host_,
                            describe_wait_status(f->status))});
      }
      if (!done && ranks.all_succeeded()) {
        add(key(R, "done"), 1);
        done = true;
      }
      if (done && add(key(R, "done"), 0) >= r.nodes) finish({"done", 0, -1, -1, "every rank done"});
      for (int i = 0; i < r.nodes; ++i) {
        if (i == r.node) continue;
        if (const auto why = gone(ids[static_cast<size_t>(i)])) {
          const auto info = json::parse(get(key(R, fmt::format("node{}", i))));
          finish({"lost", 1, -1, i,
                  fmt::format("node {} ({}, {}) lost: {}", i, info.at("host").get<std::string>(),
                              info.at("addr").get<std::string>(), *why)});
        }
      }
      if (!done && r.nodes < o_.max_nodes && add(key(R, "waiting"), 0) > 0) {
        finish({"grow", 0, -1, -1, "a node is waiting to join"});
      }
      if (has(end_key)) break;
    }
    *end = RoundEnd::parse(get(end_key));
    ranks.terminate(SIGTERM);    // and SIGKILL after the grace; beating meanwhile, so that
    while (!ranks.finished()) {  // slow-stopping ranks do not make this node look lost
      ranks.poll(std::chrono::milliseconds(50));
      beat();
    }
    return std::nullopt;
  }

  /// Leaves the job with `exit`: counts this agent out of round R; the store's host waits
  /// (bounded) until the others did, so none loses the store while it reads the end.
  int leave(int64_t round, Exit exit) {
    try {
      add(key(round, "exited"), 1);
      if (server_) {
        const auto deadline = Clock::now() + seconds(o_.heartbeat_timeout_seconds);
        const int64_t expected =
            (has(key(round, "closed")) ? std::stoll(get(key(round, "closed"))) : 1) +
            add(key(round, "waiting"), 0);
        while (add(key(round, "exited"), 0) < expected && Clock::now() < deadline)
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    } catch (const Error&) {
      // the store is gone: nobody is left to wait for
    }
    return exit.code;
  }

  const LaunchOptions& o_;
  std::string endpoint_, local_addr_, host_, prefix_;
  std::string id_;  // this agent, in the store: host/pid/random
  Clock::time_point last_beat_{};
  Clock::time_point last_look_{};
  std::map<std::string, std::pair<int64_t, Clock::time_point>> seen_;  // id: heartbeat, since
  std::unique_ptr<StoreServer> server_;
  c10::intrusive_ptr<StoreClient> store_;
  std::vector<UniqueFd> slots_;  // two memfds per local rank: ElasticState's snapshots
};

}  // namespace

int run_elastic(const LaunchOptions& options) {
  try {
    Agent agent(options);
    return agent.run();
  } catch (const ValueError& e) {
    std::fprintf(stderr, "torchpar run: %s\n", e.what_without_backtrace());
    return 2;
  } catch (const std::exception& e) {
    const auto* err = dynamic_cast<const c10::Error*>(&e);
    std::fprintf(stderr, "torchpar run: the elastic agent stops: %s\n",
                 err ? err->what_without_backtrace() : e.what());
    return 1;
  }
}

}  // namespace torchpar::detail
