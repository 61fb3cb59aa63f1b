// MSL atomics: atomic<T> is storage-compatible with T; the *_explicit functions use GCC
// __atomic builtins (sequentially consistent, whatever order is requested). Floating
// read-modify-write operations use a compare-and-swap loop.
#pragma once

namespace metal {

enum memory_order {
  memory_order_relaxed = 0,
  memory_order_acquire = 2,
  memory_order_release = 3,
  memory_order_acq_rel = 4,
  memory_order_seq_cst = 5,
};
enum thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };

template <class T>
struct atomic {
  T msim_value;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<bool> atomic_bool;
typedef atomic<float> atomic_float;
typedef atomic<ulong> atomic_ulong;
typedef atomic<long> atomic_long;

namespace detail {
template <class T>
inline T* ptr(const volatile atomic<T>* o) { return const_cast<T*>(&o->msim_value); }
template <class T, class F>
inline T rmw(const volatile atomic<T>* o, F f) {
  T* p = ptr(o);
  T old, nw;
  __atomic_load(p, &old, __ATOMIC_SEQ_CST);
  do {
    nw = f(old);
  } while (!__atomic_compare_exchange(p, &old, &nw, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
  return old;
}
}  // namespace detail

template <class T>
using msim_val_t = std::type_identity_t<T>;

template <class T>
inline void atomic_store_explicit(volatile atomic<T>* o, msim_val_t<T> v, memory_order = memory_order_relaxed) {
  __atomic_store(detail::ptr(o), &v, __ATOMIC_SEQ_CST);
}
template <class T>
inline T atomic_load_explicit(const volatile atomic<T>* o, memory_order = memory_order_relaxed) {
  T r;
  __atomic_load(detail::ptr(o), &r, __ATOMIC_SEQ_CST);
  return r;
}
template <class T>
inline T atomic_exchange_explicit(volatile atomic<T>* o, msim_val_t<T> v, memory_order = memory_order_relaxed) {
  T r;
  __atomic_exchange(detail::ptr(o), &v, &r, __ATOMIC_SEQ_CST);
  return r;
}
template <class T>
inline bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* o, msim_val_t<T>* expected,
                                                  msim_val_t<T> desired, memory_order = memory_order_relaxed,
                                                  memory_order = memory_order_relaxed) {
  return __atomic_compare_exchange(detail::ptr(o), expected, &desired, false, __ATOMIC_SEQ_CST,
                                   __ATOMIC_SEQ_CST);
}
template <class T>
inline bool atomic_compare_exchange_strong_explicit(volatile atomic<T>* o, msim_val_t<T>* expected,
                                                    msim_val_t<T> desired, memory_order = memory_order_relaxed,
                                                    memory_order = memory_order_relaxed) {
  return __atomic_compare_exchange(detail::ptr(o), expected, &desired, false, __ATOMIC_SEQ_CST,
                                   __ATOMIC_SEQ_CST);
}

#define MSIM_ATOMIC_RMW(NAME, EXPR)                                                              \
  template <class T>                                                                           \
  inline T atomic_##NAME##_explicit(volatile atomic<T>* o, msim_val_t<T> v,                    \
                                    memory_order = memory_order_relaxed) {                     \
    return detail::rmw(o, [v](T a) { return T(EXPR); });                                       \
  }
MSIM_ATOMIC_RMW(fetch_add, a + v)
MSIM_ATOMIC_RMW(fetch_sub, a - v)
MSIM_ATOMIC_RMW(fetch_and, a & v)
MSIM_ATOMIC_RMW(fetch_or, a | v)
MSIM_ATOMIC_RMW(fetch_xor, a ^ v)
MSIM_ATOMIC_RMW(fetch_min, v < a ? v : a)
MSIM_ATOMIC_RMW(fetch_max, a < v ? v : a)
#undef MSIM_ATOMIC_RMW

inline void atomic_thread_fence(mem_flags, memory_order = memory_order_seq_cst, thread_scope = thread_scope_device) {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

}  // namespace metal
