// libFuzzer target for what an RPC member decodes from a peer that passed the handshake:
// the message header (decode_rpc_header) and a body with its out-of-band storages, decoded
// as the argument and result types RPC handlers typically take. Every input must give a
// value or a SerializationError: never a crash, an out-of-bounds read or a runaway
// allocation.
//
// An input: 2-byte big-endian header length, the header, 1 byte of storage count (at most
// 8), 2 bytes of size per storage (their bytes are zeros: what TensorPipe delivers is
// bytes of a given length), then the body.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "rpc/message.h"
#include "torchpar/torchpar.h"

namespace {

namespace tp = torchpar;

template <class T>
void try_decode(const tp::detail::RpcValue& v) {
  try {
    (void)tp::detail::rpc_decode<T>(v);
  } catch (const tp::SerializationError&) {
  }
}

void write_seed(std::string& out, const tp::detail::RpcHeader& h,
                const tp::detail::RpcValue& body) {
  const std::string hb = tp::detail::encode_rpc_header(h);
  out.push_back(static_cast<char>(hb.size() >> 8));
  out.push_back(static_cast<char>(hb.size() & 0xff));
  out += hb;
  out.push_back(static_cast<char>(body.storages.size()));
  for (const auto& s : body.storages) {
    out.push_back(static_cast<char>(s.nbytes() >> 8));
    out.push_back(static_cast<char>(s.nbytes() & 0xff));
  }
  out += body.bytes;
}

}  // namespace

// Seeds: a call of add(1, 2), a call with a small tensor, a reply with an error.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) {
    // Also prove the seeds decode (cheap, and keeps the encoders in the binary).
    tp::detail::RpcHeader h;
    h.kind = tp::detail::kRpcCall;
    h.name = "add";
    std::string seed;
    write_seed(seed, h, tp::detail::rpc_encode(std::tuple<int, int>{1, 2}, false));
    write_seed(seed, h,
               tp::detail::rpc_encode(std::tuple<at::Tensor, double>{at::ones({4}), 2.0}, false));
    return 0;
  }
  size_t pos = 0;
  const size_t hlen = (size_t{data[0]} << 8) | data[1];
  pos = 2;
  if (hlen > size - pos) return 0;
  try {
    (void)tp::detail::decode_rpc_header(
        std::string(reinterpret_cast<const char*>(data + pos), hlen));
  } catch (const tp::SerializationError&) {
  }
  pos += hlen;
  if (pos >= size) return 0;
  const size_t n = std::min<size_t>(data[pos++], 8);
  tp::detail::RpcValue v;
  for (size_t i = 0; i < n && pos + 2 <= size; ++i, pos += 2) {
    const size_t nbytes = (size_t{data[pos]} << 8) | data[pos + 1];
    c10::Storage st(c10::Storage::use_byte_size_t(), nbytes, at::getCPUAllocator(), false);
    if (nbytes) std::memset(st.data(), 0, nbytes);
    v.storages.push_back(std::move(st));
  }
  if (pos > size) return 0;
  v.bytes.assign(reinterpret_cast<const char*>(data + pos), size - pos);
  try_decode<std::tuple<int, int>>(v);
  try_decode<std::tuple<at::Tensor, double>>(v);
  try_decode<std::tuple<std::string>>(v);
  try_decode<std::vector<at::Tensor>>(v);
  try_decode<std::map<std::string, at::Tensor>>(v);
  try_decode<c10::IValue>(v);
  return 0;
}
