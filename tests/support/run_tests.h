#pragma once
// The end of every test program's main.

namespace torchpar::testing {

/// InitGoogleTest, then RUN_ALL_TESTS. With TORCHPAR_TEST_CENSUS=<file> set, each case that
/// ran also appends "<program> <Suite.Case> <milliseconds> <fork() calls>" to <file>
/// (scripts/test_census.py). Returns RUN_ALL_TESTS()'s result.
int run_tests(int argc, char** argv);

}  // namespace torchpar::testing
