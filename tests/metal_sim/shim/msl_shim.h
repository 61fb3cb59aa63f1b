// MSL shim for the Metal simulator: MSL as a C++20 header. Layer order matters:
// (1) standard headers, (2) runtime interface, (3) namespace metal, (4) MLX prelude subset,
// (5) MSL keyword macros, last.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <source_location>
#include <type_traits>
#include <utility>

#include "msim_runtime.h"

#include "msl_types.h"
#include "msl_vec.h"
#include "msl_math.h"
#include "msl_simd.h"
#include "msl_atomic.h"

#include "msl_mlx_prelude.h"

namespace msim {
// Storage for one `threadgroup T name[...]` declaration (the rewriter numbers them with ID).
template <class T, int ID>
inline T& tg_block() {
  static const char key = 0;
  return *static_cast<T*>(msim_tg_block(&key, sizeof(T), alignof(T)));
}
}  // namespace msim

#include "msl_keywords.h"
