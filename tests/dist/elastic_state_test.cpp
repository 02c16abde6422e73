// ElasticState with real processes, real memfds and real files: the bytes round trip; a
// snapshot restored by a new process (a restarted rank) through the slots the test hands over
// in TORCHPAR_ELASTIC_STATE_FDS as the launcher's agent would; three ranks where only rank 2
// holds a snapshot (auto and gloo); a corrupt newest slot falling back to the older one;
// checkpoints when no rank holds a snapshot (and which of the two wins); nothing anywhere;
// mismatching states; torn temporary checkpoint files; World's restart count and round.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>

#include "support/ranks.h"
#include "support/run_tests.h"
#include "torchpar/dist/elastic_state.h"
#include "torchpar/torchpar.h"

namespace tp = torchpar;
using tp::testing::free_port;
using tp::testing::run_ranks;

namespace {

/// A training loop's state: a Linear, SGD with momentum (so the optimizer has state), two
/// counters, all registered.
struct Toy {
  explicit Toy(int64_t seed, int64_t in_features = 4) {
    torch::manual_seed(seed);
    lin = torch::nn::Linear(in_features, 3);
    opt = std::make_unique<torch::optim::SGD>(lin->parameters(),
                                              torch::optim::SGDOptions(0.1).momentum(0.9));
    state.add("model", *lin);
    state.add("optimizer", *opt);
    state.add_counter("epoch", &epoch);
    state.add_counter("position", &position);
  }
  /// `steps` optimizer steps on fixed data; the counters move with them.
  void train(int steps) {
    const at::Tensor x = at::arange(8 * lin->options.in_features(), at::kFloat)
                             .view({8, lin->options.in_features()})
                             .div(10);
    for (int i = 0; i < steps; ++i) {
      opt->zero_grad();
      lin->forward(x).pow(2).sum().backward();
      opt->step();
      position += 8;
      if (position % 24 == 0) ++epoch;
    }
  }

  torch::nn::Linear lin{nullptr};
  std::unique_ptr<torch::optim::SGD> opt;
  int64_t epoch = 0, position = 0;
  tp::ElasticState state;  // last: made after the variable is set, registered objects first
};

/// The state Toy(1) reaches after `steps` steps.
std::unique_ptr<Toy> trained(int steps) {
  auto t = std::make_unique<Toy>(1);
  t->train(steps);
  return t;
}

/// Whether `a` and `b` hold the same state: parameters, counters, and (one more step on
/// both) the optimizer's momentum.
std::string differs(Toy& a, Toy& b) {
  if (a.epoch != b.epoch || a.position != b.position) {
    return fmt::format("counters ({}, {}) vs ({}, {})", a.epoch, a.position, b.epoch, b.position);
  }
  for (int pass = 0; pass < 2; ++pass) {
    auto pa = a.lin->parameters(), pb = b.lin->parameters();
    for (size_t i = 0; i < pa.size(); ++i) {
      if (!pa[i].equal(pb[i])) return fmt::format("parameter {} after {} more steps", i, pass);
    }
    a.train(1);
    b.train(1);
  }
  return "";
}

/// Two memfds as the launcher's agent makes them (inherited by the ranks).
struct Slots {
  Slots() : a(::memfd_create("elastic-test-a", 0)), b(::memfd_create("elastic-test-b", 0)) {
    if (!a || !b) throw std::runtime_error("memfd_create failed");
  }
  std::string env() const { return fmt::format("{},{}", a.get(), b.get()); }
  tp::UniqueFd a, b;
};

/// Sets (or, for "", unsets) the slots variable in this process.
void use_slots(const std::string& value) {
  if (value.empty()) {
    ::unsetenv(tp::kElasticStateFdsEnv);
  } else {
    ::setenv(tp::kElasticStateFdsEnv, value.c_str(), 1);
  }
}

tp::World make_world(int rank, int world, int port) {
  return tp::World(tp::WorldOptions{.rank = rank,
                                    .world_size = world,
                                    .master_addr = "127.0.0.1",
                                    .master_port = port,
                                    .timeout = std::chrono::seconds(60)});
}

std::string temp_dir(const std::string& what) {
  const auto dir = std::filesystem::temp_directory_path() /
                   fmt::format("torchpar_elastic_{}_{}_{}", what, ::getpid(),
                               std::chrono::steady_clock::now().time_since_epoch().count());
  std::filesystem::create_directories(dir);
  return dir.string();
}

// ---- rank bodies ------------------------------------------------------------------------------

/// A rank that trains `steps` steps and snapshots after each.
void snapshot_rank(int, std::string slots, int steps) {
  use_slots(slots);
  Toy t(1);
  TORCHPAR_RCHECK(t.state.has_memory(), "no slots from {}", slots);
  for (int s = 1; s <= steps; ++s) {
    t.train(1);
    t.state.snapshot(s);
  }
}

/// A restarted rank: fresh objects (another seed), restore, then the state of `want_steps`.
void restore_rank(int rank, int n, int port, std::string slots, std::string backend, int want_steps,
                  int want_from) {
  use_slots(slots);
  auto world = make_world(rank, n, port);
  auto group = world.create_collective_group({}, tp::backend_from_string(backend));
  Toy t(100 + rank);
  const auto r = t.state.restore(group);
  TORCHPAR_RCHECK(r.source == tp::StateSource::kMemory, "source {}", static_cast<int>(r.source));
  TORCHPAR_RCHECK(r.step == want_steps, "step {} want {}", r.step, want_steps);
  TORCHPAR_RCHECK(r.from_rank == want_from, "from_rank {} want {}", r.from_rank, want_from);
  TORCHPAR_RCHECK(r.seconds > 0 && r.seconds < 60, "seconds {}", r.seconds);
  auto want = trained(want_steps);
  const std::string d = differs(t, *want);
  TORCHPAR_RCHECK(d.empty(), "rank {}: restored state differs: {}", rank, d);
}

/// Writes checkpoints of Toy(1) after each of `steps` steps, keeping `keep`.
void checkpoint_writer(int, std::string dir, int steps, int keep) {
  use_slots("");
  Toy t(1);
  for (int s = 1; s <= steps; ++s) {
    t.train(1);
    t.state.save_checkpoint(dir, s, keep);
  }
}

/// No snapshot anywhere: rank 0 names `dir`. Wants `want` (kCheckpoint: the state of
/// `want_step` steps from step_<want_step>.pt; kNone: the objects untouched).
void checkpoint_rank(int rank, int n, int port, std::string dir, int want, int want_step) {
  use_slots("");
  auto world = make_world(rank, n, port);
  auto group = world.create_collective_group();
  Toy t(100 + rank);
  t.epoch = 7;
  t.position = 9;
  const auto before = t.lin->weight.clone();
  // Only rank 0's directory counts: the others pass a path that does not exist.
  const auto r = t.state.restore(group, rank == 0 ? dir : std::string("/nonexistent/elsewhere"));
  TORCHPAR_RCHECK(static_cast<int>(r.source) == want, "source {} want {}",
                  static_cast<int>(r.source), want);
  if (want == static_cast<int>(tp::StateSource::kNone)) {
    TORCHPAR_RCHECK(r.step == 0 && r.from_rank == -1 && r.checkpoint_path.empty(), "result");
    TORCHPAR_RCHECK(t.lin->weight.equal(before) && t.epoch == 7 && t.position == 9,
                    "objects changed");
    return;
  }
  TORCHPAR_RCHECK(r.step == want_step, "step {} want {}", r.step, want_step);
  TORCHPAR_RCHECK(r.from_rank == -1, "from_rank {}", r.from_rank);
  const std::string file = fmt::format("step_{}.pt", want_step);
  TORCHPAR_RCHECK(r.checkpoint_path.ends_with(file), "path {} want {}", r.checkpoint_path, file);
  auto ref = trained(want_step);
  const std::string d = differs(t, *ref);
  TORCHPAR_RCHECK(d.empty(), "rank {}: restored state differs: {}", rank, d);
}

/// A checkpoint of another model shape: every rank raises SerializationError naming the
/// parameter and the file.
void mismatch_rank(int rank, int n, int port, std::string dir) {
  use_slots("");
  auto world = make_world(rank, n, port);
  auto group = world.create_collective_group();
  Toy t(5, /*in_features=*/5);
  try {
    t.state.restore(group, dir);
  } catch (const tp::SerializationError& e) {
    const std::string what = e.what();
    TORCHPAR_RCHECK(what.find("'weight'") != std::string::npos &&
                        what.find("step_2.pt") != std::string::npos &&
                        what.find("[3, 5]") != std::string::npos,
                    "message: {}", what);
    return;
  }
  throw std::runtime_error("no SerializationError");
}

/// One rank, slots and a checkpoint directory: which of the two restore() takes.
void memory_vs_checkpoint_rank(int, int port, std::string slots, std::string dir, int want,
                               int want_step) {
  use_slots(slots);
  auto world = make_world(0, 1, port);
  auto group = world.create_collective_group();
  Toy t(100);
  const auto r = t.state.restore(group, dir);
  TORCHPAR_RCHECK(static_cast<int>(r.source) == want && r.step == want_step,
                  "source {} step {}; want {} step {}", static_cast<int>(r.source), r.step, want,
                  want_step);
  auto ref = trained(want_step);
  const std::string d = differs(t, *ref);
  TORCHPAR_RCHECK(d.empty(), "restored state differs: {}", d);
}

void three_ranks_restore(int rank, std::vector<std::string> slots, int port, std::string backend) {
  restore_rank(rank, 3, port, slots[static_cast<size_t>(rank)], backend, 4, 2);
}

void world_counts_rank(int, int port) {
  ::unsetenv("TORCHELASTIC_RESTART_COUNT");
  ::unsetenv("TORCHPAR_RDZV_ROUND");
  auto w = make_world(0, 1, port);
  TORCHPAR_RCHECK(w.restart_count() == 0 && w.rendezvous_round() == 0, "unset");
  ::setenv("TORCHELASTIC_RESTART_COUNT", "2", 1);
  TORCHPAR_RCHECK(w.restart_count() == 2 && w.rendezvous_round() == 2, "torchrun's");
  ::setenv("TORCHPAR_RDZV_ROUND", "5", 1);
  TORCHPAR_RCHECK(w.restart_count() == 2 && w.rendezvous_round() == 5, "ours");
  ::setenv("TORCHELASTIC_RESTART_COUNT", "x", 1);
  try {
    (void)w.restart_count();
  } catch (const tp::ValueError& e) {
    TORCHPAR_RCHECK(std::string(e.what()).find("TORCHELASTIC_RESTART_COUNT") != std::string::npos,
                    "message {}", e.what());
    return;
  }
  throw std::runtime_error("no ValueError");
}

void expect_all_ok(const std::vector<tp::testing::RankResult>& res) {
  for (size_t r = 0; r < res.size(); ++r) {
    EXPECT_EQ(res[r].exitcode, 0) << "rank " << r << ": " << res[r].error;
  }
}

uint64_t slot_sequence(int fd) {
  uint64_t seq = 0;
  EXPECT_EQ(::pread(fd, &seq, sizeof seq, 8), static_cast<ssize_t>(sizeof seq));
  return seq;
}

}  // namespace

TEST(ElasticState, BytesRoundTrip) {
  use_slots("");
  auto a = trained(3);
  const std::string bytes = a->state.to_bytes(3);
  Toy b(42);
  EXPECT_FALSE(b.state.has_memory());
  EXPECT_EQ(b.state.from_bytes(bytes), 3);
  EXPECT_EQ(differs(*a, b), "");
}

TEST(ElasticState, MismatchesNameWhatDiffers) {
  use_slots("");
  auto a = trained(1);
  const std::string bytes = a->state.to_bytes(1);
  {  // another shape: nothing changes
    Toy b(2, 5);
    const auto before = b.lin->weight.clone();
    try {
      b.state.from_bytes(bytes);
      ADD_FAILURE() << "no error";
    } catch (const tp::SerializationError& e) {
      EXPECT_NE(std::string(e.what()).find("module 'model': parameter 'weight' is Float [3, 5] "
                                           "here but Float [3, 4]"),
                std::string::npos)
          << e.what();
    }
    EXPECT_TRUE(b.lin->weight.equal(before));
  }
  {  // a registered name the bytes lack
    Toy b(2);
    int64_t extra = 0;
    b.state.add_counter("extra", &extra);
    try {
      b.state.from_bytes(bytes);
      ADD_FAILURE() << "no error";
    } catch (const tp::SerializationError& e) {
      EXPECT_NE(std::string(e.what()).find("'extra' (counter) is registered but not in the saved"),
                std::string::npos)
          << e.what();
    }
  }
  {  // a kind that differs
    use_slots("");
    torch::manual_seed(1);
    torch::nn::Linear lin(4, 3);
    int64_t fake = 0;
    tp::ElasticState s;
    s.add("model", *lin);
    s.add_counter("optimizer", &fake);
    int64_t e = 0, p = 0;
    s.add_counter("epoch", &e);
    s.add_counter("position", &p);
    EXPECT_THROW(
        {
          try {
            s.from_bytes(bytes);
          } catch (const tp::SerializationError& err) {
            EXPECT_NE(std::string(err.what())
                          .find("'optimizer' is registered as a counter but saved as a optimizer"),
                      std::string::npos)
                << err.what();
            throw;
          }
        },
        tp::SerializationError);
  }
  EXPECT_THROW(Toy(1).state.from_bytes("not an archive"), tp::SerializationError);
  EXPECT_THROW(Toy(1).state.from_bytes(bytes.substr(0, bytes.size() / 2)), tp::SerializationError);
  Toy c(1);
  EXPECT_THROW(c.state.add("model", *c.lin), tp::ValueError);
  EXPECT_THROW(c.state.add_counter("", &c.epoch), tp::ValueError);
}

TEST(ElasticState, BadSlotsVariableIsRefusedNamingIt) {
  for (const std::string bad : {"3", "a,b", "7,7", "9999,9998", ",1"}) {
    use_slots(bad);
    try {
      tp::ElasticState s;
      ADD_FAILURE() << bad << ": no error";
    } catch (const tp::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(tp::kElasticStateFdsEnv), std::string::npos) << e.what();
    }
  }
  use_slots("");
}

TEST(ElasticState, SnapshotRestoredByARestartedRank) {
  Slots slots;
  expect_all_ok(run_ranks(1, 60, snapshot_rank, slots.env(), 5));
  // The "restarted rank": a new process, fresh objects, the same slots.
  expect_all_ok(
      run_ranks(1, 60, restore_rank, 1, free_port(), slots.env(), std::string("auto"), 5, 0));
}

TEST(ElasticState, OnlyRank2HoldsASnapshotAndEveryRankGetsIt) {
  for (const std::string backend : {"auto", "gloo"}) {
    SCOPED_TRACE(backend);
    Slots s0, s1, s2;
    expect_all_ok(run_ranks(1, 60, snapshot_rank, s2.env(), 4));
    const int port = free_port();
    const std::vector<std::string> env = {s0.env(), s1.env(), s2.env()};
    auto res = run_ranks(3, 90, three_ranks_restore, env, port, backend);
    expect_all_ok(res);
  }
}

TEST(ElasticState, CorruptNewestSlotFallsBackToTheOlder) {
  Slots slots;
  expect_all_ok(run_ranks(1, 60, snapshot_rank, slots.env(), 2));  // slot a: step 1, b: step 2
  const int newer =
      slot_sequence(slots.a.get()) > slot_sequence(slots.b.get()) ? slots.a.get() : slots.b.get();
  char byte = 0;
  ASSERT_EQ(::pread(newer, &byte, 1, 64 + 100), 1);
  byte = static_cast<char>(byte ^ 0x5a);
  ASSERT_EQ(::pwrite(newer, &byte, 1, 64 + 100), 1);
  expect_all_ok(
      run_ranks(1, 60, restore_rank, 1, free_port(), slots.env(), std::string("auto"), 1, 0));
}

TEST(ElasticState, CheckpointWhenNoRankHoldsASnapshot) {
  const std::string dir = temp_dir("ckpt");
  expect_all_ok(run_ranks(1, 60, checkpoint_writer, dir, 4, 2));
  // keep = 2: steps 3 and 4 remain.
  EXPECT_FALSE(std::filesystem::exists(dir + "/step_2.pt"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/step_3.pt"));
  EXPECT_EQ(tp::latest_checkpoint(dir), dir + "/step_4.pt");
  expect_all_ok(run_ranks(2, 90, checkpoint_rank, 2, free_port(), dir,
                          static_cast<int>(tp::StateSource::kCheckpoint), 4));
  std::filesystem::remove_all(dir);
}

TEST(ElasticState, NothingAnywhereLeavesTheObjectsAlone) {
  const std::string dir = temp_dir("empty");
  expect_all_ok(run_ranks(2, 90, checkpoint_rank, 2, free_port(), dir,
                          static_cast<int>(tp::StateSource::kNone), 0));
  std::filesystem::remove_all(dir);
  EXPECT_EQ(tp::latest_checkpoint(dir), std::nullopt);  // also for a missing directory
}

TEST(ElasticState, MismatchingCheckpointRaisesOnEveryRank) {
  const std::string dir = temp_dir("mismatch");
  expect_all_ok(run_ranks(1, 60, checkpoint_writer, dir, 2, 1));
  expect_all_ok(run_ranks(2, 90, mismatch_rank, 2, free_port(), dir));
  std::filesystem::remove_all(dir);
}

TEST(ElasticState, SnapshotBeatsACheckpointOfEqualOrLowerStep) {
  Slots slots;
  expect_all_ok(run_ranks(1, 60, snapshot_rank, slots.env(), 4));
  const std::string dir = temp_dir("race");
  expect_all_ok(run_ranks(1, 60, checkpoint_writer, dir, 6, 3));  // steps 4, 5, 6
  const int mem = static_cast<int>(tp::StateSource::kMemory);
  const int ckpt = static_cast<int>(tp::StateSource::kCheckpoint);
  expect_all_ok(
      run_ranks(1, 60, memory_vs_checkpoint_rank, free_port(), slots.env(), dir, ckpt, 6));
  std::filesystem::remove(dir + "/step_6.pt");
  std::filesystem::remove(dir + "/step_5.pt");
  expect_all_ok(run_ranks(1, 60, memory_vs_checkpoint_rank, free_port(), slots.env(), dir, mem, 4));
  std::filesystem::remove_all(dir);
}

TEST(ElasticState, TornTemporaryCheckpointIsIgnored) {
  const std::string dir = temp_dir("torn");
  expect_all_ok(run_ranks(1, 60, checkpoint_writer, dir, 2, 5));
  // A writer killed mid-write leaves its temporary file: half of a newer checkpoint.
  const std::string whole = dir + "/step_2.pt";
  const auto size = std::filesystem::file_size(whole);
  std::filesystem::copy_file(whole, dir + "/step_9.pt.tmp.12345");
  std::filesystem::resize_file(dir + "/step_9.pt.tmp.12345", size / 2);
  std::ofstream(dir + "/step_10.pt").close();  // empty: not complete either
  EXPECT_EQ(tp::latest_checkpoint(dir), whole);
  expect_all_ok(run_ranks(2, 90, checkpoint_rank, 2, free_port(), dir,
                          static_cast<int>(tp::StateSource::kCheckpoint), 2));
  // The next save of a later step removes the stale temporary file of an older one.
  use_slots("");
  auto t = trained(11);
  t->state.save_checkpoint(dir, 11, 5);
  EXPECT_FALSE(std::filesystem::exists(dir + "/step_9.pt.tmp.12345"));
  EXPECT_EQ(tp::latest_checkpoint(dir), dir + "/step_11.pt");
  EXPECT_THROW(t->state.save_checkpoint(dir, 12, 0), tp::ValueError);
  std::filesystem::remove_all(dir);
}

TEST(ElasticState, WorldRestartCountAndRound) {
  auto res = run_ranks(1, 60, world_counts_rank, free_port());
  expect_all_ok(res);
}

int main(int argc, char** argv) {
  tp::init(argc, argv);
  return tp::testing::run_tests(argc, argv);
}
