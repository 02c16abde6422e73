// run_tests: what every test program's main ends with (gtest's, plus the census that
// tests/cases.txt is made from). tests/support/main.cpp is the main of the programs without
// one of their own.
//
// With TORCHPAR_TEST_CENSUS=<file> set, each case that ran appends one line to <file>:
//   <program> <Suite.Case> <milliseconds> <processes started>
// "Processes started" counts the fork() calls made while the case ran (or while its suite
// was set up) by the test process and by every process of this program it started: every
// process torchpar or a test starts goes through fork() (the start methods, the forkserver
// and its children, exec's children, the shm cleaner, the tests' own children). A
// pthread_atfork handler, registered before main in each process image of the program
// (forked children inherit it; spawned children and the forkserver, exec'd from the program,
// register it again), appends a byte to <file>.forks; a case's count is that file's growth.
// scripts/test_census.py runs every program this way, one at a time, and writes the labels
// each case gets (tests/CMakeLists.txt: `fast` is a single-process case under a second).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "support/run_tests.h"

namespace {

int g_fork_log = -1;  // <census>.forks, O_APPEND: one byte per fork() anywhere in the tree

void count_fork() {
  const char byte = 'f';
  if (g_fork_log >= 0) (void)!::write(g_fork_log, &byte, 1);
}

std::string census_path() {
  const char* path = std::getenv("TORCHPAR_TEST_CENSUS");
  return path != nullptr ? path : "";
}

__attribute__((constructor)) void count_forks_from_the_start() {
  const std::string path = census_path();
  if (path.empty()) return;
  g_fork_log = ::open((path + ".forks").c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
  if (g_fork_log >= 0) ::pthread_atfork(count_fork, nullptr, nullptr);
}

long forks_so_far() {
  struct stat st {};
  return g_fork_log >= 0 && ::fstat(g_fork_log, &st) == 0 ? static_cast<long>(st.st_size) : 0;
}

class Census : public ::testing::EmptyTestEventListener {
 public:
  Census(std::FILE* out, std::string program) : out_(out), program_(std::move(program)) {}

  void OnTestSuiteStart(const ::testing::TestSuite&) override {
    suite_forks_ = forks_so_far();
    suite_started_processes_ = false;
  }

  void OnTestStart(const ::testing::TestInfo&) override {
    // A suite whose set-up started processes: each of its cases runs beside them.
    if (forks_so_far() > suite_forks_) suite_started_processes_ = true;
    forks_ = forks_so_far();
    start_ = std::chrono::steady_clock::now();
  }

  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (!info.should_run()) return;
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::steady_clock::now() - start_)
                        .count();
    const long forks = forks_so_far() - forks_ + (suite_started_processes_ ? 1 : 0);
    std::fprintf(out_, "%s %s.%s %lld %ld\n", program_.c_str(), info.test_suite_name(), info.name(),
                 static_cast<long long>(ms), forks);
    std::fflush(out_);
    suite_forks_ = forks_so_far();
  }

 private:
  std::FILE* out_;
  std::string program_;
  long forks_ = 0;
  long suite_forks_ = 0;
  bool suite_started_processes_ = false;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace

int torchpar::testing::run_tests(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (const std::string path = census_path(); !path.empty()) {
    std::FILE* out = std::fopen(path.c_str(), "ae");
    if (out == nullptr || g_fork_log < 0) {
      std::perror(path.c_str());
      return 2;
    }
    ::testing::UnitTest::GetInstance()->listeners().Append(
        new Census(out, std::filesystem::path(argv[0]).filename().string()));
  }
  return RUN_ALL_TESTS();
}
