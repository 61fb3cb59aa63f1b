// Barriers and SIMD-group / quad-group functions. Every call blocks the calling lane in the
// runtime; the scheduler computes the result over the lanes that wait at the same call site
// (the active lanes) with the functions below. A hidden trailing std::source_location argument
// names the call site.
#pragma once

namespace metal {

enum class mem_flags : uint {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(uint(a) | uint(b)); }
constexpr mem_flags operator&(mem_flags a, mem_flags b) { return mem_flags(uint(a) & uint(b)); }

using msim_loc = std::source_location;

inline void threadgroup_barrier(mem_flags, msim_loc l = msim_loc::current()) {
  msim_sync(msim::SYNC_TG_BARRIER, nullptr, nullptr, nullptr, l.file_name(), l.line(), l.column());
}
inline void simdgroup_barrier(mem_flags, msim_loc l = msim_loc::current()) {
  msim_sync(msim::SYNC_SIMD_BARRIER, nullptr, nullptr, nullptr, l.file_name(), l.line(),
            l.column());
}

// simd_vote / quad_vote: a ballot over the active lanes.
struct simd_vote {
  using vote_t = uint64_t;
  vote_t v = 0;
  vote_t act = ~vote_t(0);
  constexpr simd_vote() = default;
  constexpr explicit simd_vote(vote_t x) : v(x) {}
  constexpr simd_vote(vote_t x, vote_t a) : v(x), act(a) {}
  constexpr explicit operator vote_t() const { return v; }
  constexpr bool all() const { return (v & act) == act; }
  constexpr bool any() const { return v != 0; }
};
using quad_vote = simd_vote;

}  // namespace metal

namespace msim {

template <class T>
inline void simd_call(SimdFn fn, void* in, T* out, const std::source_location& l) {
  static_assert(std::is_trivially_copyable_v<T>, "SIMD operands must be trivially copyable");
  msim_sync(SYNC_SIMD, fn, in, out, l.file_name(), l.line(), l.column());
}

struct OpAdd { template <class T> static T f(const T& a, const T& b) { return T(a + b); } template <class T> static T id() { return T(0); } };
struct OpMul { template <class T> static T f(const T& a, const T& b) { return T(a * b); } template <class T> static T id() { return T(1); } };
struct OpMin { template <class T> static T f(const T& a, const T& b) { return metal::min(a, b); } };
struct OpMax { template <class T> static T f(const T& a, const T& b) { return metal::max(a, b); } };
struct OpAnd { template <class T> static T f(const T& a, const T& b) { return T(a & b); } };
struct OpOr  { template <class T> static T f(const T& a, const T& b) { return T(a | b); } };
struct OpXor { template <class T> static T f(const T& a, const T& b) { return T(a ^ b); } };

// Reduction over the active lanes of each W-lane segment (W = 32: simdgroup, W = 4: quad).
template <class T, class Op, int W>
void red_fn(uint32_t act, void* const* in, void* const* out, int64_t*) {
  for (int s = 0; s < 32; s += W) {
    bool have = false;
    T acc{};
    for (int i = s; i < s + W; ++i)
      if ((act >> i) & 1u) {
        const T& v = *static_cast<const T*>(in[i]);
        acc = have ? Op::f(acc, v) : v;
        have = true;
      }
    for (int i = s; i < s + W; ++i)
      if ((act >> i) & 1u) *static_cast<T*>(out[i]) = acc;
  }
}

// Prefix scan in lane order over the active lanes of each segment.
template <class T, class Op, int W, bool Inclusive>
void scan_fn(uint32_t act, void* const* in, void* const* out, int64_t*) {
  for (int s = 0; s < 32; s += W) {
    T acc = Op::template id<T>();
    for (int i = s; i < s + W; ++i)
      if ((act >> i) & 1u) {
        const T v = *static_cast<const T*>(in[i]);
        if (!Inclusive) *static_cast<T*>(out[i]) = acc;
        acc = Op::f(acc, v);
        if (Inclusive) *static_cast<T*>(out[i]) = acc;
      }
  }
}

enum ShufKind { SH_IDX, SH_DOWN, SH_UP, SH_XOR, SH_ROT_DOWN, SH_ROT_UP, SH_FILL_DOWN, SH_FILL_UP, SH_FIRST };

template <class T>
struct ShIn {
  T v;
  T fill;
  int32_t a;
  int32_t m;
};

// Shuffles. Reading a lane that is not active (or does not exist) returns the caller's own
// value and counts an inactive read; shuffle_down/up past the segment edge keep the own value.
template <class T, int K, int W>
void shuf_fn(uint32_t act, void* const* in, void* const* out, int64_t* inactive) {
  for (int i = 0; i < 32; ++i) {
    if (!((act >> i) & 1u)) continue;
    const ShIn<T>& me = *static_cast<const ShIn<T>*>(in[i]);
    const int base = i - i % W, li = i % W;
    int src = -1;  // -1: keep own value; -2: invalid source (counted)
    bool use_fill = false;
    switch (K) {
      case SH_IDX: src = (me.a >= 0 && me.a < W) ? base + me.a : -2; break;
      case SH_DOWN: src = (li + me.a < W) ? i + me.a : -1; break;
      case SH_UP: src = (li - me.a >= 0) ? i - me.a : -1; break;
      case SH_XOR: { int j = li ^ me.a; src = (j >= 0 && j < W) ? base + j : -2; } break;
      case SH_ROT_DOWN: src = base + (((li + me.a) % W) + W) % W; break;
      case SH_ROT_UP: src = base + (((li - me.a) % W) + W) % W; break;
      case SH_FILL_DOWN:
      case SH_FILL_UP: {
        const int m = (me.m > 0 && me.m <= W) ? me.m : W;
        const int mb = li - li % m;
        const int j = (K == SH_FILL_DOWN) ? li % m + me.a : li % m - me.a;
        if (j >= 0 && j < m) {
          src = base + mb + j;
        } else {
          src = base + mb + (K == SH_FILL_DOWN ? j - m : j + m);
          use_fill = true;
          if (src < base + mb || src >= base + mb + m) src = -2;
        }
      } break;
      case SH_FIRST: {
        src = -2;
        for (int j = base; j < base + W; ++j)
          if ((act >> j) & 1u) { src = j; break; }
      } break;
    }
    T r;
    if (src == -1) {
      r = me.v;
    } else if (src < 0 || !((act >> src) & 1u)) {
      r = me.v;
      ++*inactive;
    } else {
      const ShIn<T>& o = *static_cast<const ShIn<T>*>(in[src]);
      r = use_fill ? o.fill : o.v;
    }
    *static_cast<T*>(out[i]) = r;
  }
}

enum VoteKind { V_BALLOT, V_ALL, V_ANY, V_IS_FIRST, V_ACTIVE };

template <int K, int W>
void vote_fn(uint32_t act, void* const* in, void* const* out, int64_t*) {
  for (int s = 0; s < 32; s += W) {
    uint64_t seg_act = 0, yes = 0;
    int first = -1;
    for (int i = s; i < s + W; ++i)
      if ((act >> i) & 1u) {
        seg_act |= uint64_t(1) << (i - s);
        if (first < 0) first = i;
        if ((K == V_BALLOT || K == V_ALL || K == V_ANY) && *static_cast<const bool*>(in[i]))
          yes |= uint64_t(1) << (i - s);
      }
    for (int i = s; i < s + W; ++i) {
      if (!((act >> i) & 1u)) continue;
      switch (K) {
        case V_BALLOT: *static_cast<metal::simd_vote*>(out[i]) = metal::simd_vote(yes, seg_act); break;
        case V_ACTIVE: *static_cast<metal::simd_vote*>(out[i]) = metal::simd_vote(seg_act, seg_act); break;
        case V_ALL: *static_cast<bool*>(out[i]) = (yes == seg_act); break;
        case V_ANY: *static_cast<bool*>(out[i]) = (yes != 0); break;
        case V_IS_FIRST: *static_cast<bool*>(out[i]) = (i == first); break;
      }
    }
  }
}

template <class T, int K, int W>
inline T shuffle(const T& v, const T& fill, int a, int m, const std::source_location& l) {
  ShIn<T> x{v, fill, a, m};
  T r;
  simd_call(&shuf_fn<T, K, W>, &x, &r, l);
  return r;
}

}  // namespace msim

namespace metal {

#define MSIM_RED(NAME, OP, W)                                        \
  template <class T>                                                 \
  inline T NAME(T x, msim_loc l = msim_loc::current()) {             \
    T r;                                                             \
    msim::simd_call(&msim::red_fn<T, msim::OP, W>, &x, &r, l);       \
    return r;                                                        \
  }
MSIM_RED(simd_sum, OpAdd, 32)
MSIM_RED(simd_product, OpMul, 32)
MSIM_RED(simd_min, OpMin, 32)
MSIM_RED(simd_max, OpMax, 32)
MSIM_RED(simd_and, OpAnd, 32)
MSIM_RED(simd_or, OpOr, 32)
MSIM_RED(simd_xor, OpXor, 32)
MSIM_RED(quad_sum, OpAdd, 4)
MSIM_RED(quad_product, OpMul, 4)
MSIM_RED(quad_min, OpMin, 4)
MSIM_RED(quad_max, OpMax, 4)
MSIM_RED(quad_and, OpAnd, 4)
MSIM_RED(quad_or, OpOr, 4)
MSIM_RED(quad_xor, OpXor, 4)
#undef MSIM_RED

#define MSIM_SCAN(NAME, OP, W, INCL)                                   \
  template <class T>                                                   \
  inline T NAME(T x, msim_loc l = msim_loc::current()) {               \
    T r;                                                               \
    msim::simd_call(&msim::scan_fn<T, msim::OP, W, INCL>, &x, &r, l);  \
    return r;                                                          \
  }
MSIM_SCAN(simd_prefix_inclusive_sum, OpAdd, 32, true)
MSIM_SCAN(simd_prefix_exclusive_sum, OpAdd, 32, false)
MSIM_SCAN(simd_prefix_inclusive_product, OpMul, 32, true)
MSIM_SCAN(simd_prefix_exclusive_product, OpMul, 32, false)
MSIM_SCAN(quad_prefix_inclusive_sum, OpAdd, 4, true)
MSIM_SCAN(quad_prefix_exclusive_sum, OpAdd, 4, false)
MSIM_SCAN(quad_prefix_inclusive_product, OpMul, 4, true)
MSIM_SCAN(quad_prefix_exclusive_product, OpMul, 4, false)
#undef MSIM_SCAN

#define MSIM_SHUF(PFX, W)                                                                       \
  template <class T>                                                                            \
  inline T PFX##_shuffle(T x, ushort lane, msim_loc l = msim_loc::current()) {                  \
    return msim::shuffle<T, msim::SH_IDX, W>(x, x, lane, 0, l);                                 \
  }                                                                                             \
  template <class T>                                                                            \
  inline T PFX##_broadcast(T x, ushort lane, msim_loc l = msim_loc::current()) {                \
    return msim::shuffle<T, msim::SH_IDX, W>(x, x, lane, 0, l);                                 \
  }                                                                                             \
  template <class T>                                                                            \
  inline T PFX##_shuffle_down(T x, ushort d, msim_loc l = msim_loc::current()) {                \
    return msim::shuffle<T, msim::SH_DOWN, W>(x, x, d, 0, l);                                   \
  }                                                                                             \
  template <class T>                                                                            \
  inline T PFX##_shuffle_up(T x, ushort d, msim_loc l = msim_loc::current()) {                  \
    return msim::shuffle<T, msim::SH_UP, W>(x, x, d, 0, l);                                     \
  }                                                                                             \
  template <class T>                                                                            \
  inline T PFX##_shuffle_xor(T x, ushort m, msim_loc l = msim_loc::current()) {                 \
    return msim::shuffle<T, msim::SH_XOR, W>(x, x, m, 0, l);                                    \
  }                                                                                             \
  template <class T>                                                                            \
  inline T PFX##_shuffle_rotate_down(T x, ushort d, msim_loc l = msim_loc::current()) {         \
    return msim::shuffle<T, msim::SH_ROT_DOWN, W>(x, x, d, 0, l);                               \
  }                                                                                             \
  template <class T>                                                                            \
  inline T PFX##_shuffle_rotate_up(T x, ushort d, msim_loc l = msim_loc::current()) {           \
    return msim::shuffle<T, msim::SH_ROT_UP, W>(x, x, d, 0, l);                                 \
  }                                                                                             \
  template <class T>                                                                            \
  inline T PFX##_shuffle_and_fill_down(T x, T fill, ushort d, msim_loc l = msim_loc::current()) { \
    return msim::shuffle<T, msim::SH_FILL_DOWN, W>(x, fill, d, W, l);                           \
  }                                                                                             \
  template <class T>                                                                            \
  inline T PFX##_shuffle_and_fill_down(T x, T fill, ushort d, ushort m,                         \
                                       msim_loc l = msim_loc::current()) {                      \
    return msim::shuffle<T, msim::SH_FILL_DOWN, W>(x, fill, d, m, l);                           \
  }                                                                                             \
  template <class T>                                                                            \
  inline T PFX##_shuffle_and_fill_up(T x, T fill, ushort d, msim_loc l = msim_loc::current()) { \
    return msim::shuffle<T, msim::SH_FILL_UP, W>(x, fill, d, W, l);                             \
  }                                                                                             \
  template <class T>                                                                            \
  inline T PFX##_shuffle_and_fill_up(T x, T fill, ushort d, ushort m,                           \
                                     msim_loc l = msim_loc::current()) {                        \
    return msim::shuffle<T, msim::SH_FILL_UP, W>(x, fill, d, m, l);                             \
  }                                                                                             \
  template <class T>                                                                            \
  inline T PFX##_broadcast_first(T x, msim_loc l = msim_loc::current()) {                       \
    return msim::shuffle<T, msim::SH_FIRST, W>(x, x, 0, 0, l);                                  \
  }                                                                                             \
  inline simd_vote PFX##_ballot(bool b, msim_loc l = msim_loc::current()) {                     \
    simd_vote r;                                                                                \
    msim::simd_call(&msim::vote_fn<msim::V_BALLOT, W>, &b, &r, l);                              \
    return r;                                                                                   \
  }                                                                                             \
  inline simd_vote PFX##_active_threads_mask(msim_loc l = msim_loc::current()) {                \
    simd_vote r;                                                                                \
    msim::simd_call(&msim::vote_fn<msim::V_ACTIVE, W>, nullptr, &r, l);                         \
    return r;                                                                                   \
  }                                                                                             \
  inline bool PFX##_all(bool b, msim_loc l = msim_loc::current()) {                             \
    bool r;                                                                                     \
    msim::simd_call(&msim::vote_fn<msim::V_ALL, W>, &b, &r, l);                                 \
    return r;                                                                                   \
  }                                                                                             \
  inline bool PFX##_any(bool b, msim_loc l = msim_loc::current()) {                             \
    bool r;                                                                                     \
    msim::simd_call(&msim::vote_fn<msim::V_ANY, W>, &b, &r, l);                                 \
    return r;                                                                                   \
  }                                                                                             \
  inline bool PFX##_is_first(msim_loc l = msim_loc::current()) {                                \
    bool r;                                                                                     \
    msim::simd_call(&msim::vote_fn<msim::V_IS_FIRST, W>, nullptr, &r, l);                       \
    return r;                                                                                   \
  }
MSIM_SHUF(simd, 32)
MSIM_SHUF(quad, 4)
#undef MSIM_SHUF

}  // namespace metal
