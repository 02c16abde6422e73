#pragma once
// Shared by pickle.cpp (value model, keys, encoder) and pickle_decode.cpp (decoder): the
// opcodes and the integer helpers. Private to those two files.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "torchpar/manager/pickle.h"

namespace torchpar::pickle::impl {

// Every opcode of protocols 0-5 (Lib/pickle.py, Lib/pickletools.py): NAME, byte.
#define TORCHPAR_PICKLE_OPCODES(X) \
  X(MARK, '(')                     \
  X(STOP, '.')                     \
  X(POP, '0')                      \
  X(POP_MARK, '1')                 \
  X(DUP, '2')                      \
  X(FLOAT, 'F')                    \
  X(INT, 'I')                      \
  X(BININT, 'J')                   \
  X(BININT1, 'K')                  \
  X(LONG, 'L')                     \
  X(BININT2, 'M')                  \
  X(NONE, 'N')                     \
  X(PERSID, 'P')                   \
  X(BINPERSID, 'Q')                \
  X(REDUCE, 'R')                   \
  X(STRING, 'S')                   \
  X(BINSTRING, 'T')                \
  X(SHORT_BINSTRING, 'U')          \
  X(UNICODE, 'V')                  \
  X(BINUNICODE, 'X')               \
  X(APPEND, 'a')                   \
  X(BUILD, 'b')                    \
  X(GLOBAL, 'c')                   \
  X(DICT, 'd')                     \
  X(EMPTY_DICT, '}')               \
  X(APPENDS, 'e')                  \
  X(GET, 'g')                      \
  X(BINGET, 'h')                   \
  X(INST, 'i')                     \
  X(LONG_BINGET, 'j')              \
  X(LIST, 'l')                     \
  X(EMPTY_LIST, ']')               \
  X(OBJ, 'o')                      \
  X(PUT, 'p')                      \
  X(BINPUT, 'q')                   \
  X(LONG_BINPUT, 'r')              \
  X(SETITEM, 's')                  \
  X(TUPLE, 't')                    \
  X(EMPTY_TUPLE, ')')              \
  X(SETITEMS, 'u')                 \
  X(BINFLOAT, 'G')                 \
  X(PROTO, 0x80)                   \
  X(NEWOBJ, 0x81)                  \
  X(EXT1, 0x82)                    \
  X(EXT2, 0x83)                    \
  X(EXT4, 0x84)                    \
  X(TUPLE1, 0x85)                  \
  X(TUPLE2, 0x86)                  \
  X(TUPLE3, 0x87)                  \
  X(NEWTRUE, 0x88)                 \
  X(NEWFALSE, 0x89)                \
  X(LONG1, 0x8a)                   \
  X(LONG4, 0x8b)                   \
  X(BINBYTES, 'B')                 \
  X(SHORT_BINBYTES, 'C')           \
  X(SHORT_BINUNICODE, 0x8c)        \
  X(BINUNICODE8, 0x8d)             \
  X(BINBYTES8, 0x8e)               \
  X(EMPTY_SET, 0x8f)               \
  X(ADDITEMS, 0x90)                \
  X(FROZENSET, 0x91)               \
  X(NEWOBJ_EX, 0x92)               \
  X(STACK_GLOBAL, 0x93)            \
  X(MEMOIZE, 0x94)                 \
  X(FRAME, 0x95)                   \
  X(BYTEARRAY8, 0x96)              \
  X(NEXT_BUFFER, 0x97)             \
  X(READONLY_BUFFER, 0x98)

enum Opcode : unsigned char {
#define TORCHPAR_PICKLE_OPCODE_ENUM(NAME, BYTE) k##NAME = BYTE,
  TORCHPAR_PICKLE_OPCODES(TORCHPAR_PICKLE_OPCODE_ENUM)
#undef TORCHPAR_PICKLE_OPCODE_ENUM
};

/// "0x8c SHORT_BINUNICODE", "0xff (unknown)".
std::string opcode_name(int op);

/// UTF-8 as Python's 'surrogatepass' reads it (surrogates allowed, overlong forms not).
bool valid_utf8(std::string_view s);

/// Two's-complement little-endian integers (LONG1 / LONG4's form).
void normalize_le(std::string& b);  // drops redundant sign bytes; 0 becomes ""
bool negative_le(std::string_view b);
std::string magnitude_le(std::string_view b);                 // |b|, unsigned
std::string signed_le(std::string magnitude, bool negative);  // normalized
std::string le_of_int64(int64_t v);                           // normalized
Value integer_from_le(std::string bytes);  // an int64 Value when it fits, else BigInt
/// "[-+]digits" (at most 4300, as CPython 3.11) into *out; false if malformed.
bool integer_from_decimal(std::string_view text, Value* out);
std::string decimal_of_le(std::string_view le);

// pickle_text.cpp: protocol 0's text arguments.
/// Shortened to 100 bytes, non-printable bytes as \xhh (names from hostile input).
std::string printable(std::string_view s);
void append_utf8(std::string& out, uint32_t code_point);
/// protocol 2's _codecs.encode(text, 'latin1'); nullopt past U+00FF.
std::optional<std::string> latin1_of_utf8(std::string_view utf8);
/// STRING's quoted Python 2 literal, escapes decoded; nullopt with *error when malformed.
std::optional<std::string> python2_string_literal(std::string_view quoted, std::string* error);
/// UNICODE's 'raw-unicode-escape' text (latin-1 bytes, \uXXXX, \UXXXXXXXX) as UTF-8.
std::optional<std::string> raw_unicode_escape(std::string_view text);

// pickle_keys.cpp: Python's dict / set semantics on decoded items: a later key equal to an
// earlier one replaces the earlier one's value (`values`, when not null) and goes. Left as
// given when a key is not a key type.
void dedupe_keys(std::vector<Value>& keys, std::vector<Value>* values);

// ---- the decoder's arena (pickle_decode.cpp) and its STOP pass (pickle_tree.cpp) ----

/// One value the opcodes built. Containers hold the indices of their items, so that the
/// memo and the stack share one object as in Python (an APPENDS after a PUT is seen through
/// a later GET).
struct Node {
  Value::Kind kind = Value::Kind::kNone;
  bool new_object = false;  // kObject: NEWOBJ
  bool visiting = false;    // on the path of the STOP pass (a cycle if met again)
  union {
    int64_t i;      // kBool, kInt
    double f;       // kFloat
    uint32_t kids;  // containers: index into Arena::kids; kObject: [type, args, state?];
                    // kGlobal: index into Arena::globals
  } u{};
  std::string_view s;  // kStr, kBytes, kByteArray, kBigInt
};

/// The nodes of one decode; strings point into the input or the decoder's own storage.
struct Arena {
  std::vector<Node> nodes;
  std::vector<std::vector<uint32_t>> kids;
  std::vector<std::pair<std::string_view, std::string_view>> globals;  // module, name
};

/// The STOP pass: node `root` as a Value tree, each memo reference copied, with
/// options.max_depth, max_elements and max_bytes checked on the expanded tree and cycles
/// refused. Errors: PickleError at the STOP opcode (at `stop_offset`).
Value build_tree(Arena& arena, uint32_t root, const DecodeOptions& options, size_t stop_offset);

}  // namespace torchpar::pickle::impl
