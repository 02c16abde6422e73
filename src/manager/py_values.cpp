// What every object of a Python client shares: its exceptions, argument helpers, and
// Python's truth value (py_objects.h).
#include <fmt/format.h>

#include <algorithm>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "manager/py_objects.h"

namespace torchpar::detail::py {

PyException::PyException(std::string module, std::string name, const std::string& message)
    : PyException(std::move(module), std::move(name), {Value::str(message)}, message) {}

PyException::PyException(std::string module, std::string name, std::vector<Value> args,
                         const std::string& what)
    : std::runtime_error(what),
      module_(std::move(module)),
      name_(std::move(name)),
      args_(std::move(args)) {}

Value PyException::value() const { return Value::object(module_, name_, args_); }

void raise(const std::string& name, const std::string& message) {
  throw PyException("builtins", name, message);
}

namespace {

/// The items of a C++ client's pickled argument tuple ("" for none). Errors: ServedError
/// "PickleError" for a pickle that cannot be read, "TypeError" for one that is no tuple.
std::vector<Value> pickled_tuple(const std::string& bytes, const std::string& what) {
  if (bytes.empty()) return {};
  Value decoded;
  try {
    decoded = pickle::decode(bytes, {.max_elements = size_t{1} << 20});
  } catch (const pickle::PickleError& e) {
    throw ServedError("PickleError", e.what());
  }
  if (!decoded.is<pickle::Tuple>()) {
    throw ServedError("TypeError", fmt::format("the arguments of {} are a {}, not a tuple", what,
                                               decoded.type_name()));
  }
  return std::move(decoded.as<pickle::Tuple>().items);
}

}  // namespace

std::string PyServed::call(const std::string& method, const std::string& args,
                           const CallContext& context) {
  // A C++ client (PythonProxy): args are a pickled tuple, the result a pickle.
  std::vector<Value> argv = pickled_tuple(args, fmt::format("'{}'", method));
  try {
    const auto names = exposed();
    if (std::find(names.begin(), names.end(), method) == names.end()) {
      if (method == "#GETVALUE") return pickle::encode(value());
      throw ServedError("AttributeError", fmt::format("method '{}' is not exposed", method));
    }
    return pickle::encode(py_call(method, argv, pickle::Dict{}, context));
  } catch (const PyException& e) {
    throw ServedError(e.name(), e.what());
  }
}

Value PyServed::value() const { raise("TypeError", "this object has no value to send"); }

const Value& argument(const std::vector<Value>& args, const pickle::Dict& kwds, size_t index,
                      const char* name, const Value* fallback) {
  if (index < args.size()) return args[index];
  for (const auto& item : kwds.items) {
    if (item.key.is<pickle::Str>() && item.key.as<pickle::Str>().utf8 == name) return item.value;
  }
  if (fallback != nullptr) return *fallback;
  raise("TypeError", fmt::format("missing required argument '{}' (pos {})", name, index + 1));
}

int64_t to_int(const Value& v, const char* what) {
  if (v.is<int64_t>()) return v.as<int64_t>();
  if (v.is<bool>()) return v.as<bool>() ? 1 : 0;
  raise("TypeError", fmt::format("{} must be an int, not '{}'", what, v.type_name()));
}

std::optional<double> to_timeout(const Value& v, bool negative_is_none) {
  if (v.is<pickle::None>()) return std::nullopt;
  double s = 0;
  if (v.is<double>()) {
    s = v.as<double>();
  } else {
    s = static_cast<double>(to_int(v, "timeout"));
  }
  if (negative_is_none && s == -1) return std::nullopt;
  if (!(s >= 0)) raise("ValueError", "'timeout' must be a non-negative number");
  return s;
}

bool truthy(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kNone:
      return false;
    case Value::Kind::kBool:
      return v.as<bool>();
    case Value::Kind::kInt:
      return v.as<int64_t>() != 0;
    case Value::Kind::kFloat:
      return v.as<double>() != 0;
    case Value::Kind::kStr:
      return !v.as<pickle::Str>().utf8.empty();
    case Value::Kind::kBytes:
      return !v.as<pickle::Bytes>().data.empty();
    case Value::Kind::kTuple:
      return !v.as<pickle::Tuple>().items.empty();
    case Value::Kind::kList:
      return !v.as<pickle::List>().items.empty();
    case Value::Kind::kDict:
      return !v.as<pickle::Dict>().items.empty();
    default:
      return true;
  }
}

}  // namespace torchpar::detail::py

namespace torchpar::detail {

std::unique_ptr<ServedObject> make_python_object(const std::string& type_id,
                                                 const std::string& pickled_args) {
  auto args = py::pickled_tuple(pickled_args, fmt::format("a new '{}'", type_id));
  try {
    return py::make_py_object(type_id, std::move(args), pickle::Dict{});
  } catch (const py::PyException& e) {
    throw ServedError(e.name(), e.what());
  }
}

}  // namespace torchpar::detail
