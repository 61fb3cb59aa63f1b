// Example helper header: plain MSL, usable by several bodies.
#include <metal_stdlib>
using namespace metal;

template <typename T>
inline float example_load(const device T* p, uint i) {
  return float(p[i]);
}
