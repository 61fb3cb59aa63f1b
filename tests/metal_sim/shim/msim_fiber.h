// Fibers for the simulator runtime (included by msim_runtime.cpp inside its anonymous
// namespace): the x86-64 context switch (ucontext elsewhere) and pooled, guarded lane stacks.
#pragma once

// ---------------------------------------------------------------- context switch
#if defined(__x86_64__)
extern "C" void msim_ctx_switch(void** save_sp, void* to_sp);
extern "C" void msim_fiber_entry();
extern "C" __attribute__((visibility("hidden"), used)) void msim_fiber_main(Lane* l);
asm(R"(
    .text
    .globl msim_ctx_switch
    .hidden msim_ctx_switch
    .type msim_ctx_switch,@function
msim_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size msim_ctx_switch, .-msim_ctx_switch

    .globl msim_fiber_entry
    .hidden msim_fiber_entry
    .type msim_fiber_entry,@function
msim_fiber_entry:
    movq %r12, %rdi
    call msim_fiber_main
    ud2
    .size msim_fiber_entry, .-msim_fiber_entry
)");

void lane_init(Lane& l, size_t bytes) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(l.stack) + bytes) & ~uintptr_t(15);
  uintptr_t x = top - 16;  // 16-aligned stack pointer after `ret` into msim_fiber_entry
  uint64_t* f = reinterpret_cast<uint64_t*>(x - 64);
  uint32_t csr[2];
  asm volatile("stmxcsr %0" : "=m"(csr[0]));
  asm volatile("fnstcw %0" : "=m"(csr[1]));
  std::memcpy(&f[0], csr, 8);                                 // mxcsr, x87 control word
  f[1] = f[2] = f[3] = 0;                                     // r15 r14 r13
  f[4] = reinterpret_cast<uint64_t>(&l);                      // r12: the lane
  f[5] = f[6] = 0;                                            // rbx rbp
  f[7] = reinterpret_cast<uint64_t>(&msim_fiber_entry);       // return address
  l.sp = f;
}
inline void to_lane(Worker& w, Lane& l) { msim_ctx_switch(&w.sched_sp, l.sp); }
inline void to_sched(Worker& w, Lane& l) { msim_ctx_switch(&l.sp, w.sched_sp); }
#else
extern "C" void msim_fiber_main(Lane* l);
void ucontext_entry(unsigned hi, unsigned lo) {
  msim_fiber_main(reinterpret_cast<Lane*>((uintptr_t(hi) << 32) | uintptr_t(lo)));
}
void lane_init(Lane& l, size_t bytes) {
  getcontext(&l.ctx);
  l.ctx.uc_stack.ss_sp = l.stack;
  l.ctx.uc_stack.ss_size = bytes;
  l.ctx.uc_link = nullptr;
  uintptr_t p = reinterpret_cast<uintptr_t>(&l);
  makecontext(&l.ctx, reinterpret_cast<void (*)()>(&ucontext_entry), 2, unsigned(p >> 32),
              unsigned(p & 0xffffffffu));
}
inline void to_lane(Worker& w, Lane& l) { swapcontext(&w.sched_ctx, &l.ctx); }
inline void to_sched(Worker& w, Lane& l) { swapcontext(&l.ctx, &w.sched_ctx); }
#endif

// ---------------------------------------------------------------- stacks (pooled across launches)
struct StackSet {
  size_t bytes = 0;
  std::vector<char*> stacks;  // usable region; a PROT_NONE guard page sits below each
};
std::mutex g_pool_mu;
std::vector<StackSet*> g_pool;
const size_t kGuard = 4096;

StackSet* acquire_stacks(size_t bytes) {
  std::lock_guard<std::mutex> g(g_pool_mu);
  for (size_t i = 0; i < g_pool.size(); ++i)
    if (g_pool[i]->bytes == bytes) {
      StackSet* s = g_pool[i];
      g_pool.erase(g_pool.begin() + i);
      return s;
    }
  StackSet* s = new StackSet;
  s->bytes = bytes;
  return s;
}
void release_stacks(StackSet* s) {
  std::lock_guard<std::mutex> g(g_pool_mu);
  g_pool.push_back(s);
}
bool grow_stacks(StackSet* s, size_t n) {
  while (s->stacks.size() < n) {
    void* m = mmap(nullptr, s->bytes + kGuard, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return false;
    mprotect(m, kGuard, PROT_NONE);
    s->stacks.push_back(static_cast<char*>(m) + kGuard);
  }
  return true;
}

