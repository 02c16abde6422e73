#pragma once
// Shared by pickle.cpp (value model, keys, encoder) and pickle_decode.cpp (decoder): the
// opcodes and the integer helpers. Private to those two files.

#include <string>
#include <string_view>

#include "manager/pickle.h"

namespace torchpar::detail::pickle::impl {

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

}  // namespace torchpar::detail::pickle::impl
