// MSL keywords and MLX macros, defined last so that no standard header sees them. Address
// spaces are erased: the simulator does not check them (see README, limits).
#pragma once

#define device
#define constant
#define thread
#define threadgroup
#define METAL_FUNC inline
#define MTL_CONST
#define MLX_MTL_PRAGMA_UNROLL
