#include "rpc/transport/tensorpipe/pipe_channel.h"

#include <fmt/format.h>

#include <future>
#include <utility>

#include "torchpar/core/error.h"

namespace torchpar::rpc::detail {
namespace {

/// How one asynchronous TensorPipe operation ended, as the waiting thread sees it.
struct Outcome {
  std::string error{};   // TensorPipe's error text; empty on success
  bool refused = false;  // the peer's frame broke the framing (error says how)
  std::string bytes{};   // recv: the frame
};

using OutcomePromise = std::shared_ptr<std::promise<Outcome>>;

/// Why `d` is not a handshake frame of at most `max_bytes`, or "".
std::string check_frame(const tensorpipe::Descriptor& d, size_t max_bytes) {
  if (!d.metadata.empty() || d.payloads.size() != 1 || !d.tensors.empty()) {
    return fmt::format(
        "expected a handshake frame (one payload, no tensors, no metadata), got {} payloads, "
        "{} tensors, {} bytes of metadata",
        d.payloads.size(), d.tensors.size(), d.metadata.size());
  }
  if (d.payloads[0].length > max_bytes) {
    return fmt::format("handshake frame of {} bytes (at most {} accepted)", d.payloads[0].length,
                       max_bytes);
  }
  return {};
}

}  // namespace

std::string error_text(const tensorpipe::Error& error) {
  std::string text = error.what();
  const auto tail = text.find(" (this error originated at");
  if (tail != std::string::npos) text.resize(tail);
  return text;
}

PipeAuthChannel::PipeAuthChannel(std::shared_ptr<tensorpipe::Pipe> pipe, std::string what)
    : pipe_(std::move(pipe)), what_(std::move(what)) {}

namespace {

/// Waits for `future` until `deadline`; past it closes `pipe` (TensorPipe then fails the
/// pending operation, whose callback still owns the promise) and throws TimeoutError.
Outcome wait_outcome(std::future<Outcome>& future, tensorpipe::Pipe& pipe, AuthDeadline deadline,
                     const std::string& what, std::string_view doing) {
  if (future.wait_until(deadline) != std::future_status::ready) {
    pipe.close();
    throw TimeoutError(fmt::format("{}: the peer did not {} in time", what, doing));
  }
  return future.get();
}

}  // namespace

void PipeAuthChannel::send(std::string_view bytes, AuthDeadline deadline) {
  // The write owns its bytes until its callback: a timeout returns before TensorPipe is done.
  auto frame = std::make_shared<std::string>(bytes);
  auto promise = std::make_shared<std::promise<Outcome>>();
  auto future = promise->get_future();
  tensorpipe::Message message;
  tensorpipe::Message::Payload payload;
  payload.data = frame->data();
  payload.length = frame->size();
  message.payloads.push_back(std::move(payload));
  pipe_->write(std::move(message), [frame, promise](const tensorpipe::Error& error) {
    promise->set_value(Outcome{.error = error ? error_text(error) : std::string()});
  });
  const Outcome out = wait_outcome(future, *pipe_, deadline, what_, "receive");
  if (!out.error.empty()) throw ClosedError(fmt::format("{}: {}", what_, out.error));
}

std::string PipeAuthChannel::recv(size_t max_bytes, AuthDeadline deadline) {
  auto promise = std::make_shared<std::promise<Outcome>>();
  auto future = promise->get_future();
  // The callbacks capture the pipe: TensorPipe always calls them (with an error once the pipe
  // closes), which drops that reference.
  pipe_->readDescriptor(
      [pipe = pipe_, promise, max_bytes](const tensorpipe::Error& error, tensorpipe::Descriptor d) {
        if (error) {
          promise->set_value(Outcome{.error = error_text(error)});
          return;
        }
        std::string why = check_frame(d, max_bytes);
        if (!why.empty()) {
          promise->set_value(Outcome{.error = std::move(why), .refused = true});
          return;
        }
        // At most max_bytes (the handshake's 256): allocating here cannot fail in practice, and
        // a bad_alloc would end the process like any allocation failure on this thread.
        auto frame = std::make_shared<std::string>(d.payloads[0].length, '\0');
        tensorpipe::Allocation allocation;
        allocation.payloads.push_back(tensorpipe::Allocation::Payload{frame->data()});
        pipe->read(std::move(allocation), [promise, frame](const tensorpipe::Error& read_error) {
          promise->set_value(read_error ? Outcome{.error = error_text(read_error)}
                                        : Outcome{.bytes = std::move(*frame)});
        });
      });
  Outcome out = wait_outcome(future, *pipe_, deadline, what_, "send");
  if (out.refused) {
    pipe_->close();
    throw AuthenticationError(fmt::format("{}: protocol error: {}", what_, out.error));
  }
  if (!out.error.empty()) throw ClosedError(fmt::format("{}: {}", what_, out.error));
  return std::move(out.bytes);
}

void wait_until_peer_closes(const std::shared_ptr<tensorpipe::Pipe>& pipe, AuthDeadline deadline) {
  auto ended = std::make_shared<std::promise<void>>();
  auto future = ended->get_future();
  pipe->readDescriptor(
      [ended](const tensorpipe::Error&, const tensorpipe::Descriptor&) { ended->set_value(); });
  future.wait_until(deadline);
}

}  // namespace torchpar::rpc::detail
