// The main of the test programs that have none of their own (the others call run_tests too).
#include "support/run_tests.h"

int main(int argc, char** argv) { return torchpar::testing::run_tests(argc, argv); }
