// Simulator runtime: runs a kernel over the grid. Threadgroups are taken from a shared counter
// by worker OS threads; within a threadgroup every thread is a fiber and a scheduler runs them
// in lockstep between synchronisation points (threadgroup_barrier, simdgroup_barrier, simd_* and
// quad_* calls). Built once into a shared library that every compiled kernel links against.
#include "msim_runtime.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

using namespace msim;

namespace {

enum LaneState { L_RUN, L_SIMD, L_TGBAR, L_DONE };

struct Worker;

struct Lane {
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t ctx;
#endif
  int state = L_DONE;
  int kind = 0;
  SimdFn fn = nullptr;
  void* in = nullptr;
  void* out = nullptr;
  const char* file = "";
  unsigned line = 0, col = 0;
  Attrs attrs;
  char* stack = nullptr;
  Worker* w = nullptr;
};

struct NeedFibers {};
struct Failure {
  std::string msg;
};

struct Shared {
  BodyFn body;
  void** bufs;
  const LaunchParams* p;
  int64_t G[3], D[3], N[3];
  std::vector<int64_t> order;
  std::atomic<int64_t> next{0};
  std::atomic<bool> abort{false};
  std::mutex mu;
  std::string err;
  bool need_fibers = false;
  int64_t stats[NSTATS] = {};
};

struct TgBlock {
  const void* key;
  void* ptr;
};

struct Worker {
  Shared* sh = nullptr;
  std::vector<Lane> lanes;
  size_t stack_bytes = 0;
#if defined(__x86_64__)
  void* sched_sp = nullptr;
#else
  ucontext_t sched_ctx;
#endif
  Lane* cur = nullptr;
  std::vector<TgBlock> blocks;
  size_t tg_bytes = 0;
  int64_t stats[NSTATS] = {};
  uint64_t rng = 0;
  bool fibers = false;
  bool failed = false;
  std::string err;
  int64_t g[3] = {0, 0, 0};
};

thread_local Worker* tl_w = nullptr;

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

template <class V>
void shuffle_vec(V& v, uint64_t& s) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[splitmix(s) % i]);
}

std::string where(const char* file, unsigned line) {
  return std::string(file ? file : "?") + ":" + std::to_string(line);
}

std::string group_str(const Worker& w) {
  return "threadgroup (" + std::to_string(w.g[0]) + "," + std::to_string(w.g[1]) + "," +
         std::to_string(w.g[2]) + ")";
}

std::string lane_str(const Lane& l) {
  const uint32_t* p = l.attrs.thread_position_in_threadgroup;
  return "thread (" + std::to_string(p[0]) + "," + std::to_string(p[1]) + "," +
         std::to_string(p[2]) + ")";
}

#include "msim_fiber.h"

// ---------------------------------------------------------------- failures
[[noreturn]] void lane_fail(Worker& w, const std::string& msg) {
  if (!w.fibers) throw Failure{msg};
  w.failed = true;
  w.err = msg;
  Lane* l = w.cur;
  l->state = L_DONE;
  to_sched(w, *l);
  std::abort();  // never resumed
}

void sched_fail(Worker& w, const std::string& msg) {
  w.failed = true;
  w.err = msg;
}

// ---------------------------------------------------------------- threadgroup memory
void free_blocks(Worker& w) {
  for (auto& b : w.blocks) std::free(b.ptr);
  w.blocks.clear();
  w.tg_bytes = 0;
}

// ---------------------------------------------------------------- one threadgroup
bool same_site(const Lane& a, const Lane& b) {
  return a.line == b.line && a.col == b.col && std::strcmp(a.file, b.file) == 0;
}
bool site_before(const Lane& a, const Lane& b) {
  int c = std::strcmp(a.file, b.file);
  if (c != 0) return c < 0;
  return a.line != b.line ? a.line < b.line : a.col < b.col;
}

void fill_attrs(const Shared& sh, const int64_t g[3], const int64_t A[3], int64_t t, Attrs& a) {
  const int64_t n = A[0] * A[1] * A[2];
  const int64_t nd = sh.D[0] * sh.D[1] * sh.D[2];
  int64_t p[3] = {t % A[0], (t / A[0]) % A[1], t / (A[0] * A[1])};
  for (int d = 0; d < 3; ++d) {
    a.dispatch_threads_per_threadgroup[d] = uint32_t(sh.D[d]);
    a.grid_origin[d] = 0;
    a.grid_size[d] = uint32_t(sh.G[d]);
    a.thread_position_in_grid[d] = uint32_t(g[d] * sh.D[d] + p[d]);
    a.thread_position_in_threadgroup[d] = uint32_t(p[d]);
    a.threadgroup_position_in_grid[d] = uint32_t(g[d]);
    a.threadgroups_per_grid[d] = uint32_t(sh.N[d]);
    a.threads_per_grid[d] = uint32_t(sh.G[d]);
    a.threads_per_threadgroup[d] = uint32_t(A[d]);
  }
  a.dispatch_quadgroups_per_threadgroup = uint32_t((nd + 3) / 4);
  a.dispatch_simdgroups_per_threadgroup = uint32_t((nd + 31) / 32);
  a.quadgroup_index_in_threadgroup = uint32_t(t / 4);
  a.quadgroups_per_threadgroup = uint32_t((n + 3) / 4);
  a.simdgroup_index_in_threadgroup = uint32_t(t / 32);
  a.simdgroups_per_threadgroup = uint32_t((n + 31) / 32);
  a.thread_execution_width = 32;
  a.thread_index_in_quadgroup = uint32_t(t % 4);
  a.thread_index_in_simdgroup = uint32_t(t % 32);
  a.thread_index_in_threadgroup = uint32_t(t);
  a.threads_per_simdgroup = 32;
}

void make_order(const LaunchParams* p, std::vector<int>& ord, int n, uint64_t& rng) {
  ord.resize(n);
  for (int i = 0; i < n; ++i) ord[i] = (p->schedule == SCHED_REVERSE) ? n - 1 - i : i;
  if (p->schedule == SCHED_SHUFFLE) shuffle_vec(ord, rng);
}

// Resolves the SIMD operations of one simdgroup; returns true if any lane was released.
bool resolve_simdgroup(Worker& w, int lo, int hi, bool strict) {
  Lane* first = nullptr;
  for (int i = lo; i < hi; ++i) {
    Lane& l = w.lanes[i];
    if (l.state == L_SIMD && (!first || site_before(l, *first))) first = &l;
  }
  if (!first) return false;
  // A SIMD operation is partial unless every thread of the simdgroup executes it: threads that
  // wait elsewhere *or have already returned* are inactive for it.
  uint32_t act = 0, all = 0;
  void* ins[32] = {};
  void* outs[32] = {};
  for (int i = lo; i < hi; ++i) {
    Lane& l = w.lanes[i];
    const uint32_t bit = 1u << (i - lo);
    all |= bit;
    if (l.state == L_SIMD && same_site(l, *first)) {
      if (l.fn != first->fn || l.kind != first->kind) {
        sched_fail(w, group_str(w) + ": different SIMD operations at one call site " +
                          where(first->file, first->line));
        return false;
      }
      act |= bit;
      ins[i - lo] = l.in;
      outs[i - lo] = l.out;
    }
  }
  if (act != all) {
    ++w.stats[STAT_PARTIAL_SIMD];
    if (strict) {
      char buf[160];
      std::snprintf(buf, sizeof buf,
                    ": SIMD operation executed by part of simdgroup %d (active lanes 0x%08x of "
                    "0x%08x)",
                    lo / 32, act, all);
      sched_fail(w, where(first->file, first->line) + ": " + group_str(w) + buf);
      return false;
    }
  }
  if (first->kind == SYNC_SIMD) {
    int64_t inactive = 0;
    first->fn(act, ins, outs, &inactive);
    ++w.stats[STAT_SIMD_OPS];
    if (inactive) {
      w.stats[STAT_INACTIVE_READS] += inactive;
      if (strict) {
        sched_fail(w, where(first->file, first->line) + ": " + group_str(w) +
                          ": SIMD shuffle read from an inactive or missing lane");
        return false;
      }
    }
  }
  for (int i = lo; i < hi; ++i)
    if ((act >> (i - lo)) & 1u) w.lanes[i].state = L_RUN;
  return true;
}

void run_group(Worker& w, int64_t linear) {
  Shared& sh = *w.sh;
  const LaunchParams* p = sh.p;
  int64_t g[3] = {linear % sh.N[0], (linear / sh.N[0]) % sh.N[1], linear / (sh.N[0] * sh.N[1])};
  int64_t A[3];
  for (int d = 0; d < 3; ++d) {
    w.g[d] = g[d];
    A[d] = std::min(sh.D[d], sh.G[d] - g[d] * sh.D[d]);
  }
  const int n = int(A[0] * A[1] * A[2]);
  if (int(w.lanes.size()) < n) w.lanes.resize(n);
  std::vector<int> ord;
  make_order(p, ord, n, w.rng);
  free_blocks(w);
  ++w.stats[STAT_GROUPS];

  if (!w.fibers) {  // direct mode: each thread is a plain call
    for (int t : ord) {
      Lane& l = w.lanes[t];
      fill_attrs(sh, g, A, t, l.attrs);
      w.cur = &l;
      sh.body(sh.bufs, &l.attrs);  // may throw NeedFibers / Failure
    }
    w.cur = nullptr;
    free_blocks(w);
    return;
  }

  for (int t = 0; t < n; ++t) {
    Lane& l = w.lanes[t];
    fill_attrs(sh, g, A, t, l.attrs);
    l.w = &w;
    l.state = L_RUN;
    lane_init(l, w.stack_bytes);
  }
  const bool strict = p->strict != 0;
  const int nsg = (n + 31) / 32;
  for (;;) {
    if (p->schedule == SCHED_SHUFFLE) shuffle_vec(ord, w.rng);
    for (int t : ord) {
      Lane& l = w.lanes[t];
      if (l.state != L_RUN) continue;
      w.cur = &l;
      to_lane(w, l);
      ++w.stats[STAT_SWITCHES];
      if (w.failed) goto out;
    }
    w.cur = nullptr;
    {
      bool progress = false;
      for (int s = 0; s < nsg; ++s) {
        progress |= resolve_simdgroup(w, s * 32, std::min(n, s * 32 + 32), strict);
        if (w.failed) goto out;
      }
      if (progress) continue;
    }
    {
      Lane* b = nullptr;
      int ndone = 0, nbar = 0;
      for (int t = 0; t < n; ++t) {
        Lane& l = w.lanes[t];
        if (l.state == L_DONE) {
          ++ndone;
        } else if (l.state == L_TGBAR) {
          ++nbar;
          if (!b) {
            b = &l;
          } else if (!same_site(l, *b)) {
            sched_fail(w, group_str(w) + ": divergent threadgroup_barrier: threads wait at " +
                              where(b->file, b->line) + " and at " + where(l.file, l.line));
            goto out;
          }
        }
      }
      if (nbar == 0) break;  // every thread finished
      if (ndone > 0) {
        ++w.stats[STAT_BARRIER_AFTER_EXIT];
        if (strict) {
          sched_fail(w, where(b->file, b->line) + ": " + group_str(w) +
                            ": threadgroup_barrier reached after " + std::to_string(ndone) +
                            " of " + std::to_string(n) + " threads returned");
          goto out;
        }
      }
      ++w.stats[STAT_BARRIERS];
      for (int t = 0; t < n; ++t)
        if (w.lanes[t].state == L_TGBAR) w.lanes[t].state = L_RUN;
    }
  }
out:
  w.cur = nullptr;
  free_blocks(w);
}

void worker_main(Shared* sh, Worker* w) {
  tl_w = w;
  StackSet* stacks = nullptr;
  const int64_t ngroups = int64_t(sh->order.size());
  const int64_t max_lanes = sh->D[0] * sh->D[1] * sh->D[2];
  if (w->fibers) {
    w->stack_bytes = size_t(std::max(sh->p->stack_kib, 16)) * 1024;
    stacks = acquire_stacks(w->stack_bytes);
    if (!grow_stacks(stacks, size_t(max_lanes))) {
      w->failed = true;
      w->err = "could not allocate fiber stacks";
    } else {
      w->lanes.resize(max_lanes);
      for (int64_t i = 0; i < max_lanes; ++i) w->lanes[i].stack = stacks->stacks[i];
    }
  }
  while (!w->failed && !sh->abort.load(std::memory_order_relaxed)) {
    int64_t k = sh->next.fetch_add(1);
    if (k >= ngroups) break;
    try {
      run_group(*w, sh->order[k]);
    } catch (const NeedFibers&) {
      free_blocks(*w);
      std::lock_guard<std::mutex> lk(sh->mu);
      sh->need_fibers = true;
      sh->abort = true;
      break;
    } catch (const Failure& f) {
      free_blocks(*w);
      w->failed = true;
      w->err = f.msg;
    }
  }
  if (w->failed) {
    std::lock_guard<std::mutex> lk(sh->mu);
    if (sh->err.empty()) sh->err = w->err;
    sh->abort = true;
  }
  {
    std::lock_guard<std::mutex> lk(sh->mu);
    for (int i = 0; i < NSTATS; ++i) {
      if (i == STAT_TG_BYTES_MAX)
        sh->stats[i] = std::max(sh->stats[i], w->stats[i]);
      else
        sh->stats[i] += w->stats[i];
    }
  }
  if (stacks) release_stacks(stacks);
  tl_w = nullptr;
}

}  // namespace

// ---------------------------------------------------------------- exported
extern "C" __attribute__((visibility("hidden"), used)) void msim_fiber_main(Lane* l) {
  Worker& w = *l->w;
  w.sh->body(w.sh->bufs, &l->attrs);
  l->state = L_DONE;
  to_sched(w, *l);
  std::abort();  // a finished lane is never resumed
}

extern "C" void msim_sync(int kind, SimdFn fn, void* in, void* out, const char* file,
                          unsigned line, unsigned col) {
  Worker* w = tl_w;
  if (!w || !w->cur) {
    std::fprintf(stderr, "metal_sim: synchronising call outside a kernel\n");
    std::abort();
  }
  if (!w->fibers) throw NeedFibers{};
  Lane& l = *w->cur;
  l.kind = kind;
  l.fn = fn;
  l.in = in;
  l.out = out;
  l.file = file;
  l.line = line;
  l.col = col;
  l.state = (kind == SYNC_TG_BARRIER) ? L_TGBAR : L_SIMD;
  to_sched(*w, l);
}

extern "C" void* msim_tg_block(const void* key, size_t bytes, size_t align) {
  Worker* w = tl_w;
  for (auto& b : w->blocks)
    if (b.key == key) return b.ptr;
  const int64_t limit = w->sh->p->tg_mem_limit;
  const size_t total = w->tg_bytes + bytes;
  if (limit > 0 && int64_t(total) > limit) {
    lane_fail(*w, group_str(*w) + ": threadgroup memory of " + std::to_string(total) +
                      " bytes exceeds the limit of " + std::to_string(limit) + " bytes");
  }
  const size_t al = std::max<size_t>(64, align);
  void* ptr = std::aligned_alloc(al, (bytes + al - 1) / al * al);
  std::memset(ptr, w->sh->p->poison ? 0xFF : 0x00, bytes);
  w->blocks.push_back({key, ptr});
  w->tg_bytes = total;
  w->stats[STAT_TG_BYTES_MAX] = std::max<int64_t>(w->stats[STAT_TG_BYTES_MAX], int64_t(total));
  return ptr;
}

extern "C" void msim_fail(const char* msg, const char* file, unsigned line) {
  Worker* w = tl_w;
  std::string m = where(file, line) + ": " + msg;
  if (w && w->cur) m += " (" + group_str(*w) + ", " + lane_str(*w->cur) + ")";
  lane_fail(*w, m);
}

extern "C" int msim_launch(BodyFn body, void** bufs, const LaunchParams* p, LaunchResult* r) {
  std::memset(r, 0, sizeof *r);
  Shared sh;
  sh.body = body;
  sh.bufs = bufs;
  sh.p = p;
  int64_t ngroups = 1;
  for (int d = 0; d < 3; ++d) {
    sh.G[d] = p->grid[d];
    if (sh.G[d] <= 0) return 0;  // empty grid: nothing runs
    sh.D[d] = std::max<int64_t>(1, std::min(p->tg[d], sh.G[d]));
    sh.N[d] = (sh.G[d] + sh.D[d] - 1) / sh.D[d];
    ngroups *= sh.N[d];
  }
  sh.order.resize(ngroups);
  for (int64_t i = 0; i < ngroups; ++i) sh.order[i] = i;
  uint64_t seed = p->seed ^ 0x5bd1e9955bd1e995ull;
  if (p->shuffle_groups) shuffle_vec(sh.order, seed);

  const int nw = int(std::max<int64_t>(1, std::min<int64_t>(p->workers, ngroups)));
  std::vector<Worker> workers(nw);
  for (int i = 0; i < nw; ++i) {
    workers[i].sh = &sh;
    workers[i].fibers = p->fibers != 0;
    workers[i].rng = p->seed * 0x9e3779b97f4a7c15ull + uint64_t(i) + 1;
  }
  if (nw == 1) {
    worker_main(&sh, &workers[0]);
  } else {
    std::vector<std::thread> th;
    for (int i = 0; i < nw; ++i) th.emplace_back(worker_main, &sh, &workers[i]);
    for (auto& t : th) t.join();
  }
  for (int i = 0; i < NSTATS; ++i) r->stats[i] = sh.stats[i];
  if (sh.need_fibers) return 2;
  if (!sh.err.empty()) {
    std::snprintf(r->err, sizeof r->err, "%s", sh.err.c_str());
    return 1;
  }
  return 0;
}
