// A C++ client and Python clients sharing dicts in one `torchpar manager`.
// Run (docs/manager.md, "Sharing objects with Python clients", has the Python side):
//   build/bin/torchpar manager --address 127.0.0.1:50000 --authkey-file key &
//   # a Python client: d = SyncManager(("127.0.0.1", 50000), key).dict(); print(d._token.id)
//   build/bin/example_python_shared_dict 127.0.0.1:50000 key IDENT
// The program reads what Python wrote in the dict IDENT, writes into it, then makes a dict
// of its own, prints "ident: <hex>" for Python to attach to, and, after a line on stdin,
// prints the "reply" Python stored there.
#include <torchpar/torchpar.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

namespace tp = torchpar;
using tp::pickle::Value;

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s ADDRESS AUTHKEY_FILE IDENT\n", argv[0]);
    return 2;
  }
  std::ifstream f(argv[2], std::ios::binary);
  std::stringstream key;
  key << f.rdbuf();
  std::string authkey = key.str();
  while (!authkey.empty() && (authkey.back() == '\n' || authkey.back() == '\r')) authkey.pop_back();

  auto manager = tp::Manager::connect(argv[1], tp::AuthKey(authkey));
  tp::PythonDictProxy shared = manager.python_dict(argv[3]);  // the Python client's dict
  for (const auto& [k, v] : shared.items()) {
    std::printf("python wrote: %s = %s\n", k.repr().c_str(), v.repr().c_str());
  }
  shared.set(Value::str("from_cpp"), Value::str("hello from C++"));
  shared.set(Value::tuple({Value::str("step"), 1}), 0.5);
  shared.set(Value::str("counts"), Value::list({1, 2, 3}));
  if (auto n = shared.get(Value::str("counter")); n && n->is<int64_t>()) {
    shared.set(Value::str("counter"), n->as<int64_t>() + 1);
  }

  tp::PythonDictProxy mine = manager.python_dict();  // one for Python to attach to
  mine.set(Value::str("answer"), 42);
  std::printf("ident: %s\n", mine.ident().c_str());
  std::fflush(stdout);
  std::string line;
  std::getline(std::cin, line);  // Python attached and replied (EOF: it gave up)
  const auto reply = mine.get(Value::str("reply"));
  std::printf("reply: %s\n", reply ? reply->repr().c_str() : "(none)");
  return 0;
}
