// MSL math, common, geometric, relational and integer functions. Floating functions are
// computed in float (libm) and rounded back to the argument type; vectors apply them per
// component. metal::fast:: and metal::precise:: name the same functions.
#pragma once

namespace metal {

#define MSIM_FT template <class T, std::enable_if_t<msim::is_float_v<T>, int> = 0>
#define MSIM_IT template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>

#define MSIM_MATH1(NAME, EXPR)                                           \
  MSIM_FT inline T NAME(T x_) {                                          \
    const float x = float(x_);                                           \
    return T(EXPR);                                                      \
  }                                                                      \
  template <class T, int N>                                              \
  inline vec<T, N> NAME(const vec<T, N>& v) {                            \
    vec<T, N> r;                                                         \
    for (int i = 0; i < N; ++i) r.e[i] = NAME(v.e[i]);                   \
    return r;                                                            \
  }
MSIM_MATH1(exp, std::exp(x))
MSIM_MATH1(exp2, std::exp2(x))
MSIM_MATH1(exp10, std::pow(10.0f, x))
MSIM_MATH1(log, std::log(x))
MSIM_MATH1(log2, std::log2(x))
MSIM_MATH1(log10, std::log10(x))
MSIM_MATH1(log1p, std::log1p(x))
MSIM_MATH1(expm1, std::expm1(x))
MSIM_MATH1(sqrt, std::sqrt(x))
MSIM_MATH1(rsqrt, 1.0f / std::sqrt(x))
MSIM_MATH1(sin, std::sin(x))
MSIM_MATH1(cos, std::cos(x))
MSIM_MATH1(tan, std::tan(x))
MSIM_MATH1(asin, std::asin(x))
MSIM_MATH1(acos, std::acos(x))
MSIM_MATH1(atan, std::atan(x))
MSIM_MATH1(sinh, std::sinh(x))
MSIM_MATH1(cosh, std::cosh(x))
MSIM_MATH1(tanh, std::tanh(x))
MSIM_MATH1(asinh, std::asinh(x))
MSIM_MATH1(acosh, std::acosh(x))
MSIM_MATH1(atanh, std::atanh(x))
MSIM_MATH1(sinpi, std::sin(float(M_PI) * x))
MSIM_MATH1(cospi, std::cos(float(M_PI) * x))
MSIM_MATH1(tanpi, std::tan(float(M_PI) * x))
MSIM_MATH1(floor, std::floor(x))
MSIM_MATH1(ceil, std::ceil(x))
MSIM_MATH1(trunc, std::trunc(x))
MSIM_MATH1(round, std::round(x))
MSIM_MATH1(rint, std::nearbyint(x))
MSIM_MATH1(fract, std::fmin(x - std::floor(x), 0x1.fffffep-1f))
MSIM_MATH1(fabs, std::fabs(x))
MSIM_MATH1(saturate, std::fmin(std::fmax(x, 0.0f), 1.0f))
MSIM_MATH1(sign, (x > 0.0f ? 1.0f : x < 0.0f ? -1.0f : (x == x ? x : 0.0f)))
#undef MSIM_MATH1

#define MSIM_MATH2(NAME, EXPR)                                           \
  MSIM_FT inline T NAME(T x_, T y_) {                                    \
    const float x = float(x_), y = float(y_);                            \
    return T(EXPR);                                                      \
  }                                                                      \
  template <class T, int N>                                              \
  inline vec<T, N> NAME(const vec<T, N>& a, const vec<T, N>& b) {        \
    vec<T, N> r;                                                         \
    for (int i = 0; i < N; ++i) r.e[i] = NAME(a.e[i], b.e[i]);           \
    return r;                                                            \
  }
MSIM_MATH2(atan2, std::atan2(x, y))
MSIM_MATH2(pow, std::pow(x, y))
MSIM_MATH2(powr, std::pow(x, y))
MSIM_MATH2(fmod, std::fmod(x, y))
MSIM_MATH2(copysign, std::copysign(x, y))
MSIM_MATH2(fmin, std::fmin(x, y))
MSIM_MATH2(fmax, std::fmax(x, y))
MSIM_MATH2(fdim, std::fdim(x, y))
MSIM_MATH2(step, (y < x ? 0.0f : 1.0f))
MSIM_MATH2(divide, x / y)
#undef MSIM_MATH2

// min/max: fmin/fmax semantics for floating types (a NaN operand yields the other one).
MSIM_FT inline T min(T a, T b) { return fmin(a, b); }
MSIM_FT inline T max(T a, T b) { return fmax(a, b); }
MSIM_IT inline T min(T a, T b) { return b < a ? b : a; }
MSIM_IT inline T max(T a, T b) { return a < b ? b : a; }
MSIM_IT inline T abs(T a) { return a < 0 ? T(-a) : a; }
MSIM_FT inline T abs(T a) { return fabs(a); }
template <class T>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T>
inline T min3(T a, T b, T c) { return min(min(a, b), c); }
template <class T>
inline T max3(T a, T b, T c) { return max(max(a, b), c); }
template <class T>
inline T median3(T a, T b, T c) { return max(min(a, b), min(max(a, b), c)); }
MSIM_FT inline T mix(T x, T y, T a) { return T(float(x) + (float(y) - float(x)) * float(a)); }
MSIM_FT inline T fma(T a, T b, T c) { return T(std::fma(float(a), float(b), float(c))); }
MSIM_FT inline T smoothstep(T e0, T e1, T x_) {
  float t = std::fmin(std::fmax((float(x_) - float(e0)) / (float(e1) - float(e0)), 0.0f), 1.0f);
  return T(t * t * (3.0f - 2.0f * t));
}
MSIM_FT inline T ldexp(T x, int k) { return T(std::ldexp(float(x), k)); }
MSIM_FT inline T sincos(T x, T& c) {
  c = T(std::cos(float(x)));
  return T(std::sin(float(x)));
}

#define MSIM_VEC_LIFT2(NAME)                                                 \
  template <class T, int N>                                                  \
  inline vec<T, N> NAME(const vec<T, N>& a, const vec<T, N>& b) {            \
    vec<T, N> r;                                                             \
    for (int i = 0; i < N; ++i) r.e[i] = NAME(a.e[i], b.e[i]);               \
    return r;                                                                \
  }
#define MSIM_VEC_LIFT3(NAME)                                                          \
  template <class T, int N>                                                           \
  inline vec<T, N> NAME(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& c) { \
    vec<T, N> r;                                                                      \
    for (int i = 0; i < N; ++i) r.e[i] = NAME(a.e[i], b.e[i], c.e[i]);                \
    return r;                                                                         \
  }
MSIM_VEC_LIFT2(min)
MSIM_VEC_LIFT2(max)
MSIM_VEC_LIFT3(clamp)
MSIM_VEC_LIFT3(mix)
MSIM_VEC_LIFT3(fma)
MSIM_VEC_LIFT3(smoothstep)
MSIM_VEC_LIFT3(min3)
MSIM_VEC_LIFT3(max3)
MSIM_VEC_LIFT3(median3)
template <class T, int N>
inline vec<T, N> abs(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r.e[i] = abs(a.e[i]);
  return r;
}
template <class T, int N>
inline vec<T, N> clamp(const vec<T, N>& x, T lo, T hi) { return clamp(x, vec<T, N>(lo), vec<T, N>(hi)); }
template <class T, int N>
inline vec<T, N> mix(const vec<T, N>& x, const vec<T, N>& y, T a) { return mix(x, y, vec<T, N>(a)); }
#undef MSIM_VEC_LIFT2
#undef MSIM_VEC_LIFT3

// Relational.
#define MSIM_PRED(NAME, EXPR)                                              \
  MSIM_FT inline bool NAME(T x_) {                                         \
    const float x = float(x_);                                             \
    return EXPR;                                                           \
  }                                                                        \
  template <class T, int N>                                                \
  inline vec<bool, N> NAME(const vec<T, N>& v) {                           \
    vec<bool, N> r;                                                        \
    for (int i = 0; i < N; ++i) r.e[i] = NAME(v.e[i]);                     \
    return r;                                                              \
  }
MSIM_PRED(isnan, std::isnan(x))
MSIM_PRED(isinf, std::isinf(x))
MSIM_PRED(isfinite, std::isfinite(x))
MSIM_PRED(isnormal, std::isnormal(x))
MSIM_PRED(signbit, std::signbit(x))
#undef MSIM_PRED

// Geometric.
template <class T, int N>
inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  float s = 0.0f;
  for (int i = 0; i < N; ++i) s += float(a.e[i]) * float(b.e[i]);
  return T(s);
}
template <class T, int N>
inline T length_squared(const vec<T, N>& a) { return dot(a, a); }
template <class T, int N>
inline T length(const vec<T, N>& a) { return T(std::sqrt(float(dot(a, a)))); }
template <class T, int N>
inline T distance(const vec<T, N>& a, const vec<T, N>& b) { return length(a - b); }
template <class T, int N>
inline vec<T, N> normalize(const vec<T, N>& a) { return a * T(1.0f / std::sqrt(float(dot(a, a)))); }
template <class T>
inline vec<T, 3> cross(const vec<T, 3>& a, const vec<T, 3>& b) {
  return vec<T, 3>(a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x);
}

// Integer functions.
namespace detail {
template <class T>
using U = std::make_unsigned_t<T>;
template <class T>
constexpr int bits = int(sizeof(T) * 8);
}  // namespace detail
MSIM_IT inline T popcount(T x) { return T(__builtin_popcountll(uint64_t(detail::U<T>(x)))); }
MSIM_IT inline T clz(T x) {
  uint64_t u = uint64_t(detail::U<T>(x));
  return T(u == 0 ? detail::bits<T> : __builtin_clzll(u) - (64 - detail::bits<T>));
}
MSIM_IT inline T ctz(T x) {
  uint64_t u = uint64_t(detail::U<T>(x));
  return T(u == 0 ? detail::bits<T> : __builtin_ctzll(u));
}
MSIM_IT inline T reverse_bits(T x) {
  detail::U<T> u = detail::U<T>(x), r = 0;
  for (int i = 0; i < detail::bits<T>; ++i) r = detail::U<T>((r << 1) | ((u >> i) & 1u));
  return T(r);
}
MSIM_IT inline T extract_bits(T x, uint offset, uint count) {
  if (count == 0) return T(0);
  using UT = detail::U<T>;
  UT u = UT(UT(x) >> offset);
  if (int(count) < detail::bits<T>) u = UT(u & UT((UT(1) << count) - 1));
  if constexpr (std::is_signed_v<T>) {
    if (int(count) < detail::bits<T> && ((u >> (count - 1)) & 1u)) u = UT(u | UT(~UT(0) << count));
  }
  return T(u);
}
MSIM_IT inline T insert_bits(T base, T ins, uint offset, uint count) {
  if (count == 0) return base;
  using UT = detail::U<T>;
  UT mask = int(count) < detail::bits<T> ? UT((UT(1) << count) - 1) : UT(~UT(0));
  mask = UT(mask << offset);
  return T(UT((UT(base) & UT(~mask)) | (UT(UT(ins) << offset) & mask)));
}
MSIM_IT inline T mulhi(T a, T b) {
  if constexpr (sizeof(T) == 8) {
    using W = std::conditional_t<std::is_signed_v<T>, __int128, unsigned __int128>;
    return T((W(a) * W(b)) >> 64);
  } else {
    using W = std::conditional_t<std::is_signed_v<T>, int64_t, uint64_t>;
    return T((W(a) * W(b)) >> detail::bits<T>);
  }
}
MSIM_IT inline T rotate(T v, T i) {
  using UT = detail::U<T>;
  const int n = detail::bits<T>;
  int s = int(UT(i) % UT(n));
  UT u = UT(v);
  return T(s == 0 ? u : UT(UT(u << s) | UT(u >> (n - s))));
}
MSIM_IT inline T absdiff(T a, T b) { return a > b ? T(a - b) : T(b - a); }

#define MSIM_IVEC1(NAME)                                      \
  template <class T, int N, std::enable_if_t<std::is_integral_v<T>, int> = 0> \
  inline vec<T, N> NAME(const vec<T, N>& v) {                 \
    vec<T, N> r;                                              \
    for (int i = 0; i < N; ++i) r.e[i] = NAME(v.e[i]);        \
    return r;                                                 \
  }
MSIM_IVEC1(popcount)
MSIM_IVEC1(clz)
MSIM_IVEC1(ctz)
MSIM_IVEC1(reverse_bits)
#undef MSIM_IVEC1

#undef MSIM_FT
#undef MSIM_IT

namespace fast {
using namespace ::metal;
}
namespace precise {
using namespace ::metal;
}

}  // namespace metal
