// c10::IValue <-> torchpar archive: None, bool, int, double, complex, string, tensor,
// list, dict and tuple, recursively (depth-limited on load).
#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>

#include <fmt/format.h>

#include "torchpar/core/error.h"
#include "torchpar/serialize/archive.h"

namespace torchpar::detail {
namespace {

enum class Tag : uint8_t {
  kNone = 0,
  kBool,
  kInt,
  kDouble,
  kComplex,
  kString,
  kTensor,
  kList,
  kDict,
  kTuple
};
enum class TypeCode : uint8_t { kAny = 0, kInt, kFloat, kBool, kTensor, kString, kComplex };

TypeCode code_of(const c10::TypePtr& t) {
  switch (t->kind()) {
    case c10::TypeKind::IntType:
      return TypeCode::kInt;
    case c10::TypeKind::FloatType:
      return TypeCode::kFloat;
    case c10::TypeKind::BoolType:
      return TypeCode::kBool;
    case c10::TypeKind::TensorType:
      return TypeCode::kTensor;
    case c10::TypeKind::StringType:
      return TypeCode::kString;
    case c10::TypeKind::ComplexType:
      return TypeCode::kComplex;
    default:
      return TypeCode::kAny;
  }
}

c10::TypePtr type_of(uint8_t code) {
  switch (static_cast<TypeCode>(code)) {
    case TypeCode::kAny:
      return c10::AnyType::get();
    case TypeCode::kInt:
      return c10::IntType::get();
    case TypeCode::kFloat:
      return c10::FloatType::get();
    case TypeCode::kBool:
      return c10::BoolType::get();
    case TypeCode::kTensor:
      return c10::TensorType::get();
    case TypeCode::kString:
      return c10::StringType::get();
    case TypeCode::kComplex:
      return c10::ComplexType::get();
  }
  throw SerializationError(fmt::format("invalid IValue type code {}", code));
}

bool matches(uint8_t code, const c10::IValue& v) {
  switch (static_cast<TypeCode>(code)) {
    case TypeCode::kAny:
      return true;
    case TypeCode::kInt:
      return v.isInt();
    case TypeCode::kFloat:
      return v.isDouble();
    case TypeCode::kBool:
      return v.isBool();
    case TypeCode::kTensor:
      return v.isTensor();
    case TypeCode::kString:
      return v.isString();
    case TypeCode::kComplex:
      return v.isComplexDouble();
  }
  return false;
}

bool hashable_key(const c10::IValue& v) {
  return v.isString() || v.isInt() || v.isBool() || v.isDouble() || v.isTensor();
}

template <class T>
void put(OutputArchive& ar, T v) {
  ar.saveBinary(&v, sizeof v);
}
template <class T>
T get(InputArchive& ar) {
  T v{};
  ar(v);  // arithmetic load validates bools
  return v;
}

}  // namespace

void save_ivalue(OutputArchive& ar, const c10::IValue& v) {
  if (v.isNone()) {
    put(ar, Tag::kNone);
  } else if (v.isBool()) {
    put(ar, Tag::kBool);
    ar(v.toBool());
  } else if (v.isInt()) {
    put(ar, Tag::kInt);
    put<int64_t>(ar, v.toInt());
  } else if (v.isDouble()) {
    put(ar, Tag::kDouble);
    put<double>(ar, v.toDouble());
  } else if (v.isComplexDouble()) {
    put(ar, Tag::kComplex);
    auto c = v.toComplexDouble();
    put<double>(ar, c.real());
    put<double>(ar, c.imag());
  } else if (v.isString()) {
    put(ar, Tag::kString);
    ar(std::string(v.toStringRef()));
  } else if (v.isTensor()) {
    put(ar, Tag::kTensor);
    ar(v.toTensor());
  } else if (v.isList()) {
    put(ar, Tag::kList);
    auto list = v.toList();
    put(ar, code_of(list.elementType()));
    ar(cereal::make_size_tag(static_cast<cereal::size_type>(list.size())));
    for (const auto& e : v.toListRef()) ar(e);
  } else if (v.isGenericDict()) {
    put(ar, Tag::kDict);
    auto dict = v.toGenericDict();
    put(ar, code_of(dict.keyType()));
    put(ar, code_of(dict.valueType()));
    ar(cereal::make_size_tag(static_cast<cereal::size_type>(dict.size())));
    for (const auto& e : dict) {
      ar(e.key());
      ar(e.value());
    }
  } else if (v.isTuple()) {
    put(ar, Tag::kTuple);
    const auto& elems = v.toTupleRef().elements();
    ar(cereal::make_size_tag(static_cast<cereal::size_type>(elems.size())));
    for (const auto& e : elems) ar(e);
  } else {
    throw ValueError(fmt::format(
        "dumps: IValue of kind {} is not supported (None, bool, int, double, complex, string, "
        "tensor, list, dict, tuple are)",
        v.tagKind()));
  }
}

void load_ivalue(InputArchive& ar, c10::IValue& v) {
  InputArchive::DepthGuard guard(ar);
  const auto tag = get<uint8_t>(ar);
  switch (static_cast<Tag>(tag)) {
    case Tag::kNone:
      v = c10::IValue();
      return;
    case Tag::kBool:
      v = get<bool>(ar);
      return;
    case Tag::kInt:
      v = get<int64_t>(ar);
      return;
    case Tag::kDouble:
      v = get<double>(ar);
      return;
    case Tag::kComplex: {
      double re = get<double>(ar), im = get<double>(ar);
      v = c10::complex<double>(re, im);
      return;
    }
    case Tag::kString: {
      std::string s;
      ar(s);
      v = std::move(s);
      return;
    }
    case Tag::kTensor: {
      at::Tensor t;
      ar(t);
      v = std::move(t);
      return;
    }
    case Tag::kList: {
      const auto code = get<uint8_t>(ar);
      c10::impl::GenericList list(type_of(code));
      cereal::size_type n = 0;
      ar(cereal::make_size_tag(n));
      list.reserve(std::min<cereal::size_type>(n, 1024));
      for (cereal::size_type i = 0; i < n; ++i) {
        c10::IValue e;
        ar(e);
        if (!matches(code, e)) throw SerializationError("IValue list element of the wrong type");
        list.push_back(std::move(e));
      }
      v = std::move(list);
      return;
    }
    case Tag::kDict: {
      const auto kc = get<uint8_t>(ar), vc = get<uint8_t>(ar);
      c10::impl::GenericDict dict(type_of(kc), type_of(vc));
      cereal::size_type n = 0;
      ar(cereal::make_size_tag(n));
      for (cereal::size_type i = 0; i < n; ++i) {
        c10::IValue key, value;
        ar(key);
        ar(value);
        if (!hashable_key(key) || !matches(kc, key) || !matches(vc, value))
          throw SerializationError("IValue dict entry of the wrong type");
        dict.insert_or_assign(std::move(key), std::move(value));
      }
      v = std::move(dict);
      return;
    }
    case Tag::kTuple: {
      cereal::size_type n = 0;
      ar(cereal::make_size_tag(n));
      std::vector<c10::IValue> elems;
      elems.reserve(std::min<cereal::size_type>(n, 1024));
      for (cereal::size_type i = 0; i < n; ++i) {
        c10::IValue e;
        ar(e);
        elems.push_back(std::move(e));
      }
      v = c10::ivalue::Tuple::create(std::move(elems));
      return;
    }
  }
  throw SerializationError(fmt::format("invalid IValue tag {}", tag));
}

}  // namespace torchpar::detail
