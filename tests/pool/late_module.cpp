// A module the pool tests dlopen() after the workers started, so no worker has it loaded
// (fork children copied the parent before; spawn and forkserver children exec the test).
extern "C" int late_triple(int x) { return 3 * x; }
