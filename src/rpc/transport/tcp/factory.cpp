// create_tcp_transport (factory.h).

#include "rpc/transport/tcp/factory.h"

#include "rpc/transport/tcp/transport_impl.h"

namespace torchpar::rpc {

std::unique_ptr<Transport> create_tcp_transport(TransportOptions options,
                                                TransportHandlers handlers) {
  return std::make_unique<tcp::TcpTransport>(std::move(options), std::move(handlers));
}

}  // namespace torchpar::rpc
