#include "rpc/transport/tensorpipe/testing.h"

#include <fmt/format.h>
#include <tensorpipe/tensorpipe.h>

#include <algorithm>
#include <future>
#include <vector>

#include "core/auth_channel.h"
#include "rpc/transport/tensorpipe/pipe_channel.h"
#include "torchpar/core/error.h"

namespace torchpar::rpc::testing {

struct RawPeer::Impl {
  std::shared_ptr<tensorpipe::Context> ctx;
  std::vector<std::shared_ptr<tensorpipe::Pipe>> pipes;
  std::shared_future<void> last_closed;
};

namespace {

std::string uv_url(const std::string& address) {
  const std::string scheme = "tcp://";
  if (address.compare(0, scheme.size(), scheme) != 0) {
    throw ValueError(fmt::format("RawPeer: \"{}\" is not a tcp:// address", address));
  }
  return "uv://" + address.substr(scheme.size());
}

}  // namespace

RawPeer::RawPeer() : impl_(std::make_unique<Impl>()) {
  impl_->ctx = std::make_shared<tensorpipe::Context>(tensorpipe::ContextOptions().name("raw"));
  impl_->ctx->registerTransport(0, "uv", tensorpipe::transport::uv::create());
  impl_->ctx->registerChannel(0, "basic", tensorpipe::channel::basic::create());
}

RawPeer::~RawPeer() {
  impl_->ctx->close();
  impl_->ctx->join();
}

void RawPeer::connect_silent(const std::string& address) {
  impl_->pipes.push_back(impl_->ctx->connect(uv_url(address)));
}

void RawPeer::send_raw(const std::string& address, const AuthKey& key, const std::string& name,
                       const RawMessage& shape, std::chrono::duration<double> timeout) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(timeout);
  auto pipe = impl_->ctx->connect(uv_url(address));
  impl_->pipes.push_back(pipe);
  detail::PipeAuthChannel channel(pipe, "RawPeer");
  torchpar::detail::auth_connect(channel, key, deadline);
  channel.send(name, deadline);

  auto bytes = std::make_shared<std::vector<char>>(
      std::max(shape.payload_bytes, shape.tensor_bytes) + 1, 'r');
  tensorpipe::Message message;
  if (shape.tagged) message.metadata = std::string(detail::kMessageTag);
  for (size_t i = 0; i < shape.payloads; ++i) {
    tensorpipe::Message::Payload p;
    p.data = bytes->data();
    p.length = shape.payload_bytes;
    message.payloads.push_back(std::move(p));
  }
  for (size_t i = 0; i < shape.tensors; ++i) {
    tensorpipe::Message::Tensor t;
    t.buffer = tensorpipe::CpuBuffer{bytes->data()};
    t.length = shape.tensor_bytes;
    message.tensors.push_back(std::move(t));
  }
  auto written = std::make_shared<std::promise<std::string>>();
  auto done = written->get_future();
  pipe->write(std::move(message), [bytes, written](const tensorpipe::Error& error) {
    written->set_value(error ? detail::error_text(error) : std::string());
  });
  auto closed = std::make_shared<std::promise<void>>();
  impl_->last_closed = closed->get_future().share();
  pipe->readDescriptor([closed](const tensorpipe::Error& error, tensorpipe::Descriptor) {
    if (error) closed->set_value();  // a descriptor arriving would leave the promise unset
  });
  if (done.wait_until(deadline) != std::future_status::ready) {
    throw TimeoutError("RawPeer: the raw message was not written in time");
  }
  done.get();  // an error: the transport closed the pipe before all of it was written
}

bool RawPeer::closed_by_peer(std::chrono::duration<double> timeout) {
  return impl_->last_closed.valid() &&
         impl_->last_closed.wait_for(timeout) == std::future_status::ready;
}

}  // namespace torchpar::rpc::testing
