// MSL scalar types: uint/ushort/uchar/ulong, half (= _Float16), bfloat (a 2-byte struct),
// numeric_limits and as_type.
#pragma once

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;

namespace metal {
using ::half;
using ::uchar;
using ::uint;
using ::ulong;
using ::ushort;
struct bfloat;
}  // namespace metal

namespace msim {
template <class T>
inline constexpr bool is_half_v = std::is_same_v<std::remove_cv_t<T>, _Float16>;
template <class T>
inline constexpr bool is_bfloat_v = std::is_same_v<std::remove_cv_t<T>, metal::bfloat>;
// Floating types of MSL (double is rejected before compilation).
template <class T>
inline constexpr bool is_float_v =
    std::is_same_v<std::remove_cv_t<T>, float> || is_half_v<T> || is_bfloat_v<T>;
// Built-in arithmetic types (bfloat excluded: it is a class).
template <class T>
inline constexpr bool is_arith_v =
    std::is_integral_v<T> || std::is_floating_point_v<T> || is_half_v<T>;
template <class T>
inline constexpr bool is_scalar_v = is_arith_v<T> || is_bfloat_v<T>;
}  // namespace msim

namespace metal {

// bfloat16 as on Metal: conversion from float rounds to nearest even and keeps NaN quiet;
// arithmetic goes through float and rounds back; mixed with a floating type the result is float,
// mixed with an integer the result is bfloat.
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  template <class U, std::enable_if_t<msim::is_arith_v<U>, int> = 0>
  constexpr bfloat(U v) : bits(from_float(float(v))) {}
  constexpr operator float() const { return std::bit_cast<float>(uint32_t(bits) << 16); }
  static constexpr bfloat from_bits(uint16_t b) {
    bfloat r{};
    r.bits = b;
    return r;
  }
  static constexpr uint16_t from_float(float f) {
    uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
  }
  template <class U>
  constexpr bfloat& operator+=(U o) { return *this = bfloat(float(*this) + float(o)); }
  template <class U>
  constexpr bfloat& operator-=(U o) { return *this = bfloat(float(*this) - float(o)); }
  template <class U>
  constexpr bfloat& operator*=(U o) { return *this = bfloat(float(*this) * float(o)); }
  template <class U>
  constexpr bfloat& operator/=(U o) { return *this = bfloat(float(*this) / float(o)); }
  constexpr bfloat& operator++() { return *this += 1; }
  constexpr bfloat& operator--() { return *this -= 1; }
  constexpr bfloat operator++(int) { bfloat r = *this; *this += 1; return r; }
  constexpr bfloat operator--(int) { bfloat r = *this; *this -= 1; return r; }
};

constexpr bfloat operator-(bfloat a) { return bfloat::from_bits(uint16_t(a.bits ^ 0x8000u)); }
constexpr bfloat operator+(bfloat a) { return a; }

#define MSIM_BF_ARITH(OP)                                                                   \
  constexpr bfloat operator OP(bfloat a, bfloat b) { return bfloat(float(a) OP float(b)); } \
  template <class U, std::enable_if_t<std::is_integral_v<U>, int> = 0>                      \
  constexpr bfloat operator OP(bfloat a, U b) { return bfloat(float(a) OP float(b)); }      \
  template <class U, std::enable_if_t<std::is_integral_v<U>, int> = 0>                      \
  constexpr bfloat operator OP(U a, bfloat b) { return bfloat(float(a) OP float(b)); }      \
  template <class U, std::enable_if_t<msim::is_arith_v<U> && !std::is_integral_v<U>, int> = 0> \
  constexpr float operator OP(bfloat a, U b) { return float(a) OP float(b); }               \
  template <class U, std::enable_if_t<msim::is_arith_v<U> && !std::is_integral_v<U>, int> = 0> \
  constexpr float operator OP(U a, bfloat b) { return float(a) OP float(b); }
MSIM_BF_ARITH(+)
MSIM_BF_ARITH(-)
MSIM_BF_ARITH(*)
MSIM_BF_ARITH(/)
#undef MSIM_BF_ARITH

#define MSIM_BF_CMP(OP)                                                              \
  constexpr bool operator OP(bfloat a, bfloat b) { return float(a) OP float(b); }    \
  template <class U, std::enable_if_t<msim::is_arith_v<U>, int> = 0>                 \
  constexpr bool operator OP(bfloat a, U b) { return float(a) OP float(b); }         \
  template <class U, std::enable_if_t<msim::is_arith_v<U>, int> = 0>                 \
  constexpr bool operator OP(U a, bfloat b) { return float(a) OP float(b); }
MSIM_BF_CMP(==)
MSIM_BF_CMP(!=)
MSIM_BF_CMP(<)
MSIM_BF_CMP(>)
MSIM_BF_CMP(<=)
MSIM_BF_CMP(>=)
#undef MSIM_BF_CMP

// metal::numeric_limits: std's for built-in types, hand-written for half and bfloat.
template <class T>
struct numeric_limits : std::numeric_limits<T> {};

#define MSIM_LIMITS(T, MAKE, MIN, MAX, LOWEST, EPS, INF, QNAN, DMIN, DIG)      \
  template <>                                                                 \
  struct numeric_limits<T> {                                                  \
    static constexpr bool is_specialized = true;                              \
    static constexpr bool is_signed = true;                                   \
    static constexpr bool is_integer = false;                                 \
    static constexpr bool has_infinity = true;                                \
    static constexpr bool has_quiet_NaN = true;                               \
    static constexpr int digits = DIG;                                        \
    static constexpr T min() { return MAKE(MIN); }                            \
    static constexpr T max() { return MAKE(MAX); }                            \
    static constexpr T lowest() { return MAKE(LOWEST); }                      \
    static constexpr T epsilon() { return MAKE(EPS); }                        \
    static constexpr T infinity() { return MAKE(INF); }                       \
    static constexpr T quiet_NaN() { return MAKE(QNAN); }                     \
    static constexpr T denorm_min() { return MAKE(DMIN); }                    \
  };
#define MSIM_HALF_BITS(b) std::bit_cast<half>(uint16_t(b))
MSIM_LIMITS(half, MSIM_HALF_BITS, 0x0400, 0x7BFF, 0xFBFF, 0x1400, 0x7C00, 0x7E00, 0x0001, 11)
MSIM_LIMITS(bfloat, bfloat::from_bits, 0x0080, 0x7F7F, 0xFF7F, 0x3C00, 0x7F80, 0x7FC0, 0x0001, 8)
#undef MSIM_HALF_BITS
#undef MSIM_LIMITS

}  // namespace metal
