// The subset of MLX's Metal prelude (metal::utils(): kernels/utils.h and its includes) that
// custom-kernel bodies may use: float16_t, bfloat16_t, Limits<T>, both elem_to_loc overloads,
// ceildiv. Anything else from the prelude is deliberately missing (compile error).
#pragma once

using namespace metal;

typedef half float16_t;
typedef bfloat bfloat16_t;

template <typename U>
struct Limits;

#define MSIM_INT_LIMIT(type)                                                     \
  template <>                                                                    \
  struct Limits<type> {                                                          \
    static constexpr type max = metal::numeric_limits<type>::max();              \
    static constexpr type min = metal::numeric_limits<type>::min();              \
    static constexpr type finite_max = metal::numeric_limits<type>::max();       \
    static constexpr type finite_min = metal::numeric_limits<type>::min();       \
  };
MSIM_INT_LIMIT(uint8_t)
MSIM_INT_LIMIT(uint16_t)
MSIM_INT_LIMIT(uint32_t)
MSIM_INT_LIMIT(uint64_t)
MSIM_INT_LIMIT(int8_t)
MSIM_INT_LIMIT(int16_t)
MSIM_INT_LIMIT(int32_t)
MSIM_INT_LIMIT(int64_t)
#undef MSIM_INT_LIMIT

#define MSIM_FLOAT_LIMIT(type)                                                   \
  template <>                                                                    \
  struct Limits<type> {                                                          \
    static constexpr type max = metal::numeric_limits<type>::infinity();         \
    static constexpr type min = -metal::numeric_limits<type>::infinity();        \
    static constexpr type finite_max = metal::numeric_limits<type>::max();       \
    static constexpr type finite_min = -metal::numeric_limits<type>::max();      \
  };
MSIM_FLOAT_LIMIT(half)
MSIM_FLOAT_LIMIT(float)
MSIM_FLOAT_LIMIT(bfloat16_t)
#undef MSIM_FLOAT_LIMIT

template <>
struct Limits<bool> {
  static constexpr bool max = true;
  static constexpr bool min = false;
};

template <typename IdxT = int64_t>
inline IdxT elem_to_loc(IdxT elem, const int* shape, const int64_t* strides, int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += (elem % shape[i]) * IdxT(strides[i]);
    elem /= shape[i];
  }
  return loc;
}

template <typename IdxT = int64_t>
inline IdxT elem_to_loc(uint3 elem, const int* shape, const int64_t* strides, int ndim) {
  IdxT loc = elem.x * IdxT(strides[ndim - 1]) + elem.y * IdxT(strides[ndim - 2]);
  for (int d = ndim - 3; d >= 0; --d) {
    loc += (elem.z % shape[d]) * IdxT(strides[d]);
    elem.z /= shape[d];
  }
  return loc;
}

template <typename T, typename U>
inline T ceildiv(T N, U M) {
  return (N + M - 1) / M;
}
