// The pickle encoder (see pickle.h): protocols 2 to 5, as CPython's _Pickler writes them,
// without memo.
#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "manager/pickle_impl.h"
#include "torchpar/manager/pickle.h"

namespace torchpar::pickle {

// ---- encoder -----------------------------------------------------------------------------------

namespace {

using namespace impl;  // NOLINT(google-build-using-namespace): the opcode names

constexpr size_t kMaxEncodeDepth = 10000;
constexpr size_t kBatch = 1000;  // items per APPENDS / SETITEMS / ADDITEMS, as pickle.py

class Encoder {
 public:
  explicit Encoder(int protocol) : proto_(protocol) {}

  std::string run(const Value& v) {
    out_.push_back(static_cast<char>(kPROTO));
    out_.push_back(static_cast<char>(proto_));
    size_t frame_at = 0;
    if (proto_ >= 4) {
      out_.push_back(static_cast<char>(kFRAME));
      frame_at = out_.size();
      out_.append(8, '\0');
    }
    save(v, 0);
    op(kSTOP);
    if (proto_ >= 4) {
      const uint64_t n = out_.size() - frame_at - 8;
      for (size_t i = 0; i < 8; ++i) out_[frame_at + i] = static_cast<char>((n >> (8 * i)) & 0xff);
    }
    return std::move(out_);
  }

 private:
  void op(unsigned char c) { out_.push_back(static_cast<char>(c)); }
  void le(uint64_t v, size_t n) {
    for (size_t i = 0; i < n; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }

  void save_str(std::string_view s) {
    if (!valid_utf8(s)) throw PickleError("a str is not valid UTF-8");
    if (proto_ >= 4 && s.size() < 256) {
      op(kSHORT_BINUNICODE);
      le(s.size(), 1);
    } else if (s.size() <= 0xffffffffu) {
      op(kBINUNICODE);
      le(s.size(), 4);
    } else if (proto_ >= 4) {
      op(kBINUNICODE8);
      le(s.size(), 8);
    } else {
      throw PickleError(fmt::format("a str of {} bytes needs protocol 4", s.size()));
    }
    out_.append(s);
  }

  void save_global(std::string_view module, std::string_view name) {
    if (proto_ >= 4) {
      save_str(module);
      save_str(name);
      op(kSTACK_GLOBAL);
      return;
    }
    if (module.find('\n') != std::string_view::npos || name.find('\n') != std::string_view::npos)
      throw PickleError("a global's module or name contains a newline");
    op(kGLOBAL);
    out_.append(module).append("\n").append(name).append("\n");
  }

  void save_bytes(std::string_view b) {
    if (proto_ < 3) {  // protocol 2 has no bytes: _codecs.encode(latin-1 text, 'latin1')
      save_global("_codecs", "encode");
      std::string text;
      for (char ch : b) {
        const auto c = static_cast<uint8_t>(ch);
        if (c < 0x80) {
          text.push_back(ch);
        } else {
          text.push_back(static_cast<char>(0xc0 | (c >> 6)));
          text.push_back(static_cast<char>(0x80 | (c & 0x3f)));
        }
      }
      save_str(text);
      save_str("latin1");
      op(kTUPLE2);
      op(kREDUCE);
      return;
    }
    if (b.size() < 256) {
      op(kSHORT_BINBYTES);
      le(b.size(), 1);
    } else if (b.size() <= 0xffffffffu) {
      op(kBINBYTES);
      le(b.size(), 4);
    } else if (proto_ >= 4) {
      op(kBINBYTES8);
      le(b.size(), 8);
    } else {
      throw PickleError(fmt::format("bytes of {} bytes need protocol 4", b.size()));
    }
    out_.append(b);
  }

  void save_int(int64_t v) {
    if (v >= 0 && v <= 0xff) {
      op(kBININT1);
      le(static_cast<uint64_t>(v), 1);
    } else if (v >= 0 && v <= 0xffff) {
      op(kBININT2);
      le(static_cast<uint64_t>(v), 2);
    } else if (v >= std::numeric_limits<int32_t>::min() &&
               v <= std::numeric_limits<int32_t>::max()) {
      op(kBININT);
      le(static_cast<uint64_t>(v), 4);
    } else {
      save_long(le_of_int64(v));
    }
  }

  void save_long(std::string_view bytes) {
    if (bytes.size() < 256) {
      op(kLONG1);
      le(bytes.size(), 1);
    } else if (bytes.size() <= 0x7fffffffu) {
      op(kLONG4);
      le(bytes.size(), 4);
    } else {
      throw PickleError(fmt::format("an int of {} bytes is too large to pickle", bytes.size()));
    }
    out_.append(bytes);
  }

  void save_float(double d) {
    uint64_t bits;
    std::memcpy(&bits, &d, 8);
    op(kBINFLOAT);
    for (int i = 7; i >= 0; --i) out_.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
  }

  void save_items(const std::vector<Value>& items, size_t depth) {
    for (const Value& x : items) save(x, depth);
  }

  void save_tuple(const std::vector<Value>& items, size_t depth) {
    switch (items.size()) {
      case 0:
        op(kEMPTY_TUPLE);
        return;
      case 1:
      case 2:
      case 3:
        save_items(items, depth);
        op(items.size() == 1 ? kTUPLE1 : items.size() == 2 ? kTUPLE2 : kTUPLE3);
        return;
      default:
        op(kMARK);
        save_items(items, depth);
        op(kTUPLE);
    }
  }

  /// EMPTY_LIST then batches of APPENDS (APPEND for a batch of one).
  void save_list(const std::vector<Value>& items, size_t depth) {
    op(kEMPTY_LIST);
    for (size_t at = 0; at < items.size(); at += kBatch) {
      const size_t n = std::min(kBatch, items.size() - at);
      if (n == 1) {
        save(items[at], depth);
        op(kAPPEND);
        continue;
      }
      op(kMARK);
      for (size_t i = at; i < at + n; ++i) save(items[i], depth);
      op(kAPPENDS);
    }
  }

  void save_set(const std::vector<Value>& items, bool frozen, size_t depth) {
    if (proto_ < 4) {  // builtins.set([items]) / frozenset([items])
      save_global("builtins", frozen ? "frozenset" : "set");
      save_list(items, depth);
      op(kTUPLE1);
      op(kREDUCE);
      return;
    }
    if (frozen) {
      op(kMARK);
      save_items(items, depth);
      op(kFROZENSET);
      return;
    }
    op(kEMPTY_SET);
    for (size_t at = 0; at < items.size(); at += kBatch) {
      const size_t n = std::min(kBatch, items.size() - at);
      op(kMARK);
      for (size_t i = at; i < at + n; ++i) save(items[i], depth);
      op(kADDITEMS);
    }
  }

  void save(const Value& v, size_t depth) {
    if (depth > kMaxEncodeDepth)
      throw PickleError(fmt::format("a value nested deeper than {} levels", kMaxEncodeDepth));
    std::visit(
        [&](const auto& x) {
          using T = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<T, None>) {
            op(kNONE);
          } else if constexpr (std::is_same_v<T, bool>) {
            op(x ? kNEWTRUE : kNEWFALSE);
          } else if constexpr (std::is_same_v<T, int64_t>) {
            save_int(x);
          } else if constexpr (std::is_same_v<T, BigInt>) {
            save_long(x.bytes);
          } else if constexpr (std::is_same_v<T, double>) {
            save_float(x);
          } else if constexpr (std::is_same_v<T, Str>) {
            save_str(x.utf8);
          } else if constexpr (std::is_same_v<T, Bytes>) {
            save_bytes(x.data);
          } else if constexpr (std::is_same_v<T, ByteArray>) {
            if (proto_ >= 5) {
              op(kBYTEARRAY8);
              le(x.data.size(), 8);
              out_.append(x.data);
            } else {
              save_global("builtins", "bytearray");
              save_bytes(x.data);
              op(kTUPLE1);
              op(kREDUCE);
            }
          } else if constexpr (std::is_same_v<T, Tuple>) {
            save_tuple(x.items, depth + 1);
          } else if constexpr (std::is_same_v<T, List>) {
            save_list(x.items, depth + 1);
          } else if constexpr (std::is_same_v<T, Dict>) {
            op(kEMPTY_DICT);
            for (size_t at = 0; at < x.items.size(); at += kBatch) {
              const size_t n = std::min(kBatch, x.items.size() - at);
              if (n > 1) op(kMARK);
              for (size_t i = at; i < at + n; ++i) {
                save(x.items[i].key, depth + 1);
                save(x.items[i].value, depth + 1);
              }
              op(n > 1 ? kSETITEMS : kSETITEM);
            }
          } else if constexpr (std::is_same_v<T, Set>) {
            save_set(x.items, false, depth + 1);
          } else if constexpr (std::is_same_v<T, FrozenSet>) {
            save_set(x.items, true, depth + 1);
          } else if constexpr (std::is_same_v<T, Global>) {
            save_global(x.module, x.name);
          } else {
            save_global(x.type.module, x.type.name);
            save_tuple(x.args, depth + 1);
            op(x.new_object ? kNEWOBJ : kREDUCE);
            if (x.state) {
              save(*x.state, depth + 1);
              op(kBUILD);
            }
          }
        },
        v.data());
  }

  int proto_;
  std::string out_;
};

}  // namespace

std::string encode(const Value& value, int protocol) {
  if (protocol < 2 || protocol > 5)
    throw PickleError(fmt::format("cannot encode protocol {} (2 to 5 are written)", protocol));
  return Encoder(protocol).run(value);
}

}  // namespace torchpar::pickle
