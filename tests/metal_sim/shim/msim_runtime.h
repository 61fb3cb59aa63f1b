// Interface between a compiled kernel and the simulator runtime (msim_runtime.cpp).
// Plain C++, no MSL: this file is included before any MSL keyword macro exists.
#pragma once
#include <cstddef>
#include <cstdint>

namespace msim {

enum SyncKind : int { SYNC_SIMD = 1, SYNC_SIMD_BARRIER = 2, SYNC_TG_BARRIER = 3 };

// Computes a SIMD/quad operation for the lanes of one simdgroup that wait at the same call site.
// `active` has bit i set for each such lane; in[i]/out[i] point at lane i's operand and result.
typedef void (*SimdFn)(uint32_t active, void* const* in, void* const* out, int64_t* inactive_reads);

// Per-thread attribute values (section 1.7 of the design note); uint3 values as uint32_t[3].
struct Attrs {
  uint32_t dispatch_threads_per_threadgroup[3];
  uint32_t grid_origin[3];
  uint32_t grid_size[3];
  uint32_t thread_position_in_grid[3];
  uint32_t thread_position_in_threadgroup[3];
  uint32_t threadgroup_position_in_grid[3];
  uint32_t threadgroups_per_grid[3];
  uint32_t threads_per_grid[3];
  uint32_t threads_per_threadgroup[3];
  uint32_t dispatch_quadgroups_per_threadgroup;
  uint32_t dispatch_simdgroups_per_threadgroup;
  uint32_t quadgroup_index_in_threadgroup;
  uint32_t quadgroups_per_threadgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t thread_execution_width;
  uint32_t thread_index_in_quadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t thread_index_in_threadgroup;
  uint32_t threads_per_simdgroup;
};

typedef void (*BodyFn)(void** bufs, const Attrs* attrs);

enum Schedule : int32_t { SCHED_FORWARD = 0, SCHED_REVERSE = 1, SCHED_SHUFFLE = 2 };

// Mirrored by runner.py (ctypes); keep the field order and types in sync.
struct LaunchParams {
  int64_t grid[3];
  int64_t tg[3];
  int32_t schedule;
  int32_t workers;
  uint64_t seed;
  int32_t fibers;
  int32_t poison;
  int32_t strict;
  int32_t stack_kib;
  int64_t tg_mem_limit;
  int32_t shuffle_groups;
  int32_t reserved;
};

enum Stat : int {
  STAT_GROUPS = 0,
  STAT_SWITCHES,
  STAT_PARTIAL_SIMD,
  STAT_BARRIER_AFTER_EXIT,
  STAT_INACTIVE_READS,
  STAT_TG_BYTES_MAX,
  STAT_BARRIERS,
  STAT_SIMD_OPS,
  NSTATS
};

struct LaunchResult {
  char err[2048];
  int64_t stats[NSTATS];
};

}  // namespace msim

extern "C" {
// Blocks the calling lane until the scheduler resolves the operation (fiber mode only).
void msim_sync(int kind, msim::SimdFn fn, void* in, void* out, const char* file, unsigned line,
               unsigned col);
// The calling threadgroup's block for `key` (one per threadgroup declaration), poisoned on first use.
void* msim_tg_block(const void* key, size_t bytes, size_t align);
// Reports an error from inside a kernel and abandons the launch.
[[noreturn]] void msim_fail(const char* msg, const char* file, unsigned line);
// Runs the whole grid. Returns 0 on success, 1 on error (message in r->err), 2 when a
// synchronising call was reached in direct mode (rerun with fibers).
int msim_launch(msim::BodyFn body, void** bufs, const msim::LaunchParams* p, msim::LaunchResult* r);
}
