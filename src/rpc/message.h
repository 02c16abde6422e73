#pragma once
// What RPC messages carry besides their body: the header of docs/wire_format.md ("RPC
// messages"), encoded with torchpar's serializer.

#include <cstdint>
#include <string>

namespace torchpar::detail {

/// Kinds of RPC message.
enum RpcKind : uint8_t { kRpcCall = 1, kRpcReply = 2, kRpcFetch = 3, kRpcDelete = 4 };
/// Status of a reply: what the caller rethrows.
enum RpcStatus : uint8_t { kRpcOk = 0, kRpcRemote = 1, kRpcNotFound = 2, kRpcGone = 3 };

struct RpcHeader {
  uint8_t kind = 0;    ///< RpcKind
  uint64_t id = 0;     ///< call id (call, fetch -> its reply)
  uint8_t target = 0;  ///< call: 0 function by name, 1 service of `group`
  uint8_t status = 0;  ///< reply: RpcStatus
  std::string group, name;
  std::string rref;  ///< call: keep the result as this RRef; fetch, delete: which RRef
  std::string error_type, error;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(kind, id, target, status, group, name, rref, error_type, error);
  }
};

/// Decodes a header. Errors: SerializationError for bytes that are not one.
RpcHeader decode_rpc_header(std::string bytes);
std::string encode_rpc_header(const RpcHeader& h);

}  // namespace torchpar::detail
