// MSL vectors: vec<T, N> (N = 2, 3, 4) with x/y/z/w and r/g/b/a members, MSL sizes and
// alignment (sizeof(float3) == 16), elementwise operators, flattening constructors, the
// swizzle proxy used by the rewriter (`v.xy` -> `v.template swz<0, 1>()`), packed_* types,
// all/any/select and as_type.
#pragma once

namespace metal {

template <class T, int N>
struct vec;

template <class T, int N, int A>
struct vec_storage;
template <class T, int A>
struct alignas(A) vec_storage<T, 2, A> {
  union {
    struct { T x, y; };
    struct { T r, g; };
    T e[2];
  };
};
template <class T, int A>
struct alignas(A) vec_storage<T, 3, A> {
  union {
    struct { T x, y, z; };
    struct { T r, g, b; };
    T e[3];
  };
};
template <class T, int A>
struct alignas(A) vec_storage<T, 4, A> {
  union {
    struct { T x, y, z, w; };
    struct { T r, g, b, a; };
    T e[4];
  };
};

template <class T, int N, int... I>
struct swz_ref;

}  // namespace metal

namespace msim {
// Number of components a constructor argument contributes (vectors and swizzle proxies: N).
template <class U, int M>
constexpr int ncomp_of(const metal::vec<U, M>*) { return M; }
constexpr int ncomp_of(...) { return 1; }
template <class X>
inline constexpr int ncomp = ncomp_of(static_cast<std::decay_t<X>*>(nullptr));

template <class X>
struct is_vec : std::false_type {};
template <class U, int M>
struct is_vec<metal::vec<U, M>> : std::true_type {};
}  // namespace msim

namespace metal {

template <class T, int N>
struct vec : vec_storage<T, N, int(sizeof(T)) * (N == 3 ? 4 : N)> {
  using value_type = T;
  static constexpr int size = N;

  vec() = default;
  template <class U, std::enable_if_t<msim::is_scalar_v<U>, int> = 0>
  constexpr vec(U s) {
    for (int i = 0; i < N; ++i) this->e[i] = T(s);
  }
  template <class A, class B, class... R,
            std::enable_if_t<(msim::ncomp<A> + msim::ncomp<B> + (0 + ... + msim::ncomp<R>)) == N,
                             int> = 0>
  constexpr vec(const A& a, const B& b, const R&... r) {
    int k = 0;
    put(k, a);
    put(k, b);
    (put(k, r), ...);
  }
  template <class U, std::enable_if_t<!std::is_same_v<U, T>, int> = 0>
  explicit constexpr vec(const vec<U, N>& o) {
    for (int i = 0; i < N; ++i) this->e[i] = T(o.e[i]);
  }

  constexpr T& operator[](int i) { return this->e[i]; }
  constexpr const T& operator[](int i) const { return this->e[i]; }

  template <int... I>
  swz_ref<T, N, I...> swz();
  template <int... I>
  vec<T, int(sizeof...(I))> swz() const;

#define MSIM_VEC_CASSIGN(OP)                                        \
  constexpr vec& operator OP##=(const vec& o) {                     \
    for (int i = 0; i < N; ++i) this->e[i] = T(this->e[i] OP o.e[i]); \
    return *this;                                                   \
  }                                                                 \
  template <class U, std::enable_if_t<msim::is_scalar_v<U>, int> = 0> \
  constexpr vec& operator OP##=(U s) {                              \
    for (int i = 0; i < N; ++i) this->e[i] = T(this->e[i] OP T(s)); \
    return *this;                                                   \
  }
  MSIM_VEC_CASSIGN(+)
  MSIM_VEC_CASSIGN(-)
  MSIM_VEC_CASSIGN(*)
  MSIM_VEC_CASSIGN(/)
  MSIM_VEC_CASSIGN(%)
  MSIM_VEC_CASSIGN(&)
  MSIM_VEC_CASSIGN(|)
  MSIM_VEC_CASSIGN(^)
  MSIM_VEC_CASSIGN(<<)
  MSIM_VEC_CASSIGN(>>)
#undef MSIM_VEC_CASSIGN

 private:
  template <class X>
  constexpr void put(int& k, const X& x) {
    if constexpr (msim::ncomp<X> == 1) {
      this->e[k++] = T(x);
    } else {
      for (int j = 0; j < msim::ncomp<X>; ++j) this->e[k++] = T(x.e[j]);
    }
  }
};

// A swizzle of an lvalue: a copy of the selected components (so it *is* a vec for template
// deduction and operators) that writes back into the source vector when assigned to.
template <class T, int N, int... I>
struct swz_ref : vec<T, int(sizeof...(I))> {
  using base = vec<T, int(sizeof...(I))>;
  vec<T, N>* src;
  explicit swz_ref(vec<T, N>* s) : base(s->e[I]...), src(s) {}
  swz_ref(const swz_ref&) = default;
  void writeback() {
    int k = 0;
    ((src->e[I] = this->e[k++]), ...);
  }
  swz_ref& operator=(const base& v) {
    base::operator=(v);
    writeback();
    return *this;
  }
  swz_ref& operator=(const swz_ref& o) { return *this = static_cast<const base&>(o); }
  template <class U, std::enable_if_t<msim::is_scalar_v<U>, int> = 0>
  swz_ref& operator=(U s) { return *this = base(s); }
#define MSIM_SWZ_CASSIGN(OP)                                   \
  template <class U>                                          \
  swz_ref& operator OP##=(const U& o) {                       \
    base::operator OP##=(o);                                   \
    writeback();                                              \
    return *this;                                             \
  }
  MSIM_SWZ_CASSIGN(+)
  MSIM_SWZ_CASSIGN(-)
  MSIM_SWZ_CASSIGN(*)
  MSIM_SWZ_CASSIGN(/)
  MSIM_SWZ_CASSIGN(%)
  MSIM_SWZ_CASSIGN(&)
  MSIM_SWZ_CASSIGN(|)
  MSIM_SWZ_CASSIGN(^)
  MSIM_SWZ_CASSIGN(<<)
  MSIM_SWZ_CASSIGN(>>)
#undef MSIM_SWZ_CASSIGN
};

template <class T, int N>
template <int... I>
swz_ref<T, N, I...> vec<T, N>::swz() {
  static_assert(((I < N) && ...), "swizzle component out of range for this vector");
  return swz_ref<T, N, I...>(this);
}
template <class T, int N>
template <int... I>
vec<T, int(sizeof...(I))> vec<T, N>::swz() const {
  static_assert(((I < N) && ...), "swizzle component out of range for this vector");
  return vec<T, int(sizeof...(I))>(this->e[I]...);
}

// Elementwise operators; a scalar operand is broadcast (converted to the element type).
#define MSIM_VEC_BINOP(OP)                                                          \
  template <class T, int N>                                                         \
  constexpr vec<T, N> operator OP(const vec<T, N>& a, const vec<T, N>& b) {         \
    vec<T, N> r;                                                                    \
    for (int i = 0; i < N; ++i) r.e[i] = T(a.e[i] OP b.e[i]);                       \
    return r;                                                                       \
  }                                                                                 \
  template <class T, int N, class U, std::enable_if_t<msim::is_scalar_v<U>, int> = 0> \
  constexpr vec<T, N> operator OP(const vec<T, N>& a, U b) {                        \
    vec<T, N> r;                                                                    \
    for (int i = 0; i < N; ++i) r.e[i] = T(a.e[i] OP T(b));                         \
    return r;                                                                       \
  }                                                                                 \
  template <class T, int N, class U, std::enable_if_t<msim::is_scalar_v<U>, int> = 0> \
  constexpr vec<T, N> operator OP(U a, const vec<T, N>& b) {                        \
    vec<T, N> r;                                                                    \
    for (int i = 0; i < N; ++i) r.e[i] = T(T(a) OP b.e[i]);                         \
    return r;                                                                       \
  }
MSIM_VEC_BINOP(+)
MSIM_VEC_BINOP(-)
MSIM_VEC_BINOP(*)
MSIM_VEC_BINOP(/)
MSIM_VEC_BINOP(%)
MSIM_VEC_BINOP(&)
MSIM_VEC_BINOP(|)
MSIM_VEC_BINOP(^)
MSIM_VEC_BINOP(<<)
MSIM_VEC_BINOP(>>)
#undef MSIM_VEC_BINOP

#define MSIM_VEC_CMPOP(OP)                                                          \
  template <class T, int N>                                                         \
  constexpr vec<bool, N> operator OP(const vec<T, N>& a, const vec<T, N>& b) {      \
    vec<bool, N> r;                                                                 \
    for (int i = 0; i < N; ++i) r.e[i] = a.e[i] OP b.e[i];                          \
    return r;                                                                       \
  }                                                                                 \
  template <class T, int N, class U, std::enable_if_t<msim::is_scalar_v<U>, int> = 0> \
  constexpr vec<bool, N> operator OP(const vec<T, N>& a, U b) {                     \
    vec<bool, N> r;                                                                 \
    for (int i = 0; i < N; ++i) r.e[i] = a.e[i] OP T(b);                            \
    return r;                                                                       \
  }                                                                                 \
  template <class T, int N, class U, std::enable_if_t<msim::is_scalar_v<U>, int> = 0> \
  constexpr vec<bool, N> operator OP(U a, const vec<T, N>& b) {                     \
    vec<bool, N> r;                                                                 \
    for (int i = 0; i < N; ++i) r.e[i] = T(a) OP b.e[i];                            \
    return r;                                                                       \
  }
MSIM_VEC_CMPOP(==)
MSIM_VEC_CMPOP(!=)
MSIM_VEC_CMPOP(<)
MSIM_VEC_CMPOP(>)
MSIM_VEC_CMPOP(<=)
MSIM_VEC_CMPOP(>=)
MSIM_VEC_CMPOP(&&)
MSIM_VEC_CMPOP(||)
#undef MSIM_VEC_CMPOP

template <class T, int N>
constexpr vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r.e[i] = T(-a.e[i]);
  return r;
}
template <class T, int N>
constexpr vec<T, N> operator+(const vec<T, N>& a) { return a; }
template <class T, int N>
constexpr vec<T, N> operator~(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r.e[i] = T(~a.e[i]);
  return r;
}
template <class T, int N>
constexpr vec<bool, N> operator!(const vec<T, N>& a) {
  vec<bool, N> r;
  for (int i = 0; i < N; ++i) r.e[i] = !a.e[i];
  return r;
}

template <int N>
constexpr bool all(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i) if (!v.e[i]) return false;
  return true;
}
template <int N>
constexpr bool any(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i) if (v.e[i]) return true;
  return false;
}
constexpr bool all(bool b) { return b; }
constexpr bool any(bool b) { return b; }

template <class T, std::enable_if_t<msim::is_scalar_v<T>, int> = 0>
constexpr T select(T a, T b, bool c) { return c ? b : a; }
template <class T, int N>
constexpr vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, const vec<bool, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r.e[i] = c.e[i] ? b.e[i] : a.e[i];
  return r;
}
template <class T, int N>
constexpr vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, bool c) { return c ? b : a; }

// packed_* vectors: element alignment, no padding. Element access and conversion to and from
// vec only; convert to vec for arithmetic.
template <class T, int N>
struct packed_vec : vec_storage<T, N, int(alignof(T))> {
  packed_vec() = default;
  constexpr packed_vec(const vec<T, N>& v) {
    for (int i = 0; i < N; ++i) this->e[i] = v.e[i];
  }
  template <class A, class... R, std::enable_if_t<(sizeof...(R) > 0 || msim::is_scalar_v<A>), int> = 0>
  constexpr packed_vec(const A& a, const R&... r) : packed_vec(vec<T, N>(a, r...)) {}
  constexpr operator vec<T, N>() const {
    vec<T, N> v;
    for (int i = 0; i < N; ++i) v.e[i] = this->e[i];
    return v;
  }
  constexpr T& operator[](int i) { return this->e[i]; }
  constexpr const T& operator[](int i) const { return this->e[i]; }
};

#define MSIM_VEC_TYPEDEFS(T, NAME)          \
  typedef vec<T, 2> NAME##2;                \
  typedef vec<T, 3> NAME##3;                \
  typedef vec<T, 4> NAME##4;                \
  typedef packed_vec<T, 2> packed_##NAME##2; \
  typedef packed_vec<T, 3> packed_##NAME##3; \
  typedef packed_vec<T, 4> packed_##NAME##4;
MSIM_VEC_TYPEDEFS(float, float)
MSIM_VEC_TYPEDEFS(half, half)
MSIM_VEC_TYPEDEFS(bfloat, bfloat)
MSIM_VEC_TYPEDEFS(int32_t, int)
MSIM_VEC_TYPEDEFS(uint32_t, uint)
MSIM_VEC_TYPEDEFS(int16_t, short)
MSIM_VEC_TYPEDEFS(uint16_t, ushort)
MSIM_VEC_TYPEDEFS(int8_t, char)
MSIM_VEC_TYPEDEFS(uint8_t, uchar)
MSIM_VEC_TYPEDEFS(int64_t, long)
MSIM_VEC_TYPEDEFS(uint64_t, ulong)
MSIM_VEC_TYPEDEFS(bool, bool)
#undef MSIM_VEC_TYPEDEFS

// as_type<To>(x): reinterpret the bits (sizes must match, as in MSL).
template <class To, class From>
constexpr To as_type(const From& f) {
  if constexpr (msim::ncomp<From> > 1 && !msim::is_vec<From>::value) {
    using V = vec<typename From::value_type, msim::ncomp<From>>;
    return as_type<To>(static_cast<const V&>(f));
  } else {
    static_assert(sizeof(To) == sizeof(From), "as_type: source and destination sizes differ");
    return std::bit_cast<To>(f);
  }
}

}  // namespace metal

namespace msim {
inline metal::uint3 u3(const uint32_t* v) { return metal::uint3(v[0], v[1], v[2]); }
}  // namespace msim
