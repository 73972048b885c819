// A CPU emulation of the small part of CUDA our kernels use, so `kernels/*.cu` run unchanged on
// machines without a GPU (engine/tests/kernel_emu.rs). Every thread of a block is a fiber
// (ucontext) with its own stack, run in a shuffled order between barriers; blocks run one after
// another, in a shuffled order. `__syncthreads` waits for every live thread of the block, warp
// shuffles and `__syncwarp` for every lane of the warp; threads waiting at different barriers
// (two `__syncthreads` call sites, a shuffle with lanes missing or ended) are reported as an
// error instead of hanging. `__shared__` variables are function statics: one copy, shared by
// the block that is running, filled with 0xFF bytes when the block's first thread reaches the
// declaration (tests/emu/mod.rs adds the EMU_POISON after each), so reading shared memory no
// thread of the block wrote shows.
//
// What it checks is the kernels' arithmetic, indexing and synchronization; not timing, memory
// coalescing or the hardware's rounding of fast-math intrinsics (`__expf` is `expf` here).
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#define SLUICE_EMU 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
};

struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

inline uint3 threadIdx;
inline uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

namespace emu {

enum class State { Run, BlockBarrier, WarpBarrier, Done };

// An asynchronous copy a thread queued (cp_async_16), done when a wait covers its group.
struct Copy {
    void* dst;
    const void* src;
    unsigned group;
};

struct Fiber {
    ucontext_t ctx;
    State state;
    unsigned tid;
    int line;  // the source line of the __syncthreads it waits at
    std::vector<Copy> copies;  // queued, not yet done
    unsigned committed;        // groups committed so far
};

constexpr size_t STACK = 256 * 1024;

struct Block {
    std::vector<Fiber> fibers;
    Fiber* cur = nullptr;
    ucontext_t sched;
    const std::function<void()>* body = nullptr;
    unsigned long long xchg[32][32];
    std::set<const void*> poisoned;  // shared variables this block has filled
    std::string error;               // the first misuse a thread made (it ended there)
};

inline Block* g_block = nullptr;
// Fiber stacks, kept across blocks and launches (lazily committed by the OS).
inline std::vector<std::unique_ptr<char[]>> g_stacks;

inline void trampoline() {
    (*g_block->body)();
    g_block->cur->state = State::Done;
    // Returning resumes uc_link, the scheduler.
}

inline void wait(State s) {
    Fiber* f = g_block->cur;
    f->state = s;
    swapcontext(&f->ctx, &g_block->sched);
}

inline unsigned linear_tid() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

// Runs one block of `n` threads, each calling `body`; an empty string when every thread ended.
inline std::string run_block(unsigned n, const std::function<void()>& body) {
    if (n == 0 || n > 1024) {
        return "block size " + std::to_string(n) + " outside 1..1024";
    }
    while (g_stacks.size() < n) {
        g_stacks.emplace_back(new char[STACK]);
    }
    Block b;
    b.body = &body;
    b.fibers.resize(n);
    g_block = &b;
    for (unsigned i = 0; i < n; ++i) {
        Fiber& f = b.fibers[i];
        f.tid = i;
        f.state = State::Run;
        f.committed = 0;
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = g_stacks[i].get();
        f.ctx.uc_stack.ss_size = STACK;
        f.ctx.uc_link = &b.sched;
        makecontext(&f.ctx, trampoline, 0);
    }
    const unsigned warps = (n + 31) / 32;
    // Threads run in a new order on every pass between barriers (seeded by the block index),
    // so a read that depends on another thread's write without a barrier between them sees
    // the write missing in some order and the result changes.
    std::vector<unsigned> order(n);
    for (unsigned i = 0; i < n; ++i) {
        order[i] = i;
    }
    unsigned long long rng =
        0x9E3779B97F4A7C15ull ^ (blockIdx.x + 0x10001ull * blockIdx.y + 0x100000001ull * blockIdx.z);
    for (;;) {
        for (unsigned i = n - 1; i > 0; --i) {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            std::swap(order[i], order[rng % (i + 1)]);
        }
        for (unsigned idx : order) {
            Fiber& f = b.fibers[idx];
            if (f.state != State::Run) {
                continue;
            }
            b.cur = &f;
            threadIdx.x = f.tid % blockDim.x;
            threadIdx.y = (f.tid / blockDim.x) % blockDim.y;
            threadIdx.z = f.tid / (blockDim.x * blockDim.y);
            swapcontext(&b.sched, &f.ctx);
        }
        if (!b.error.empty()) {
            return b.error;
        }
        // Every thread now waits or has ended.
        unsigned done = 0, at_block = 0;
        bool released = false;
        for (unsigned w = 0; w < warps; ++w) {
            unsigned lo = w * 32, hi = std::min(n, lo + 32), at_warp = 0, warp_done = 0;
            for (unsigned i = lo; i < hi; ++i) {
                at_warp += b.fibers[i].state == State::WarpBarrier;
                warp_done += b.fibers[i].state == State::Done;
            }
            done += warp_done;
            at_block += (hi - lo) - at_warp - warp_done;
            if (at_warp == 0) {
                continue;
            }
            if (hi - lo < 32) {
                return "warp " + std::to_string(w) + " has " + std::to_string(hi - lo) +
                       " lanes: a full-mask shuffle or __syncwarp needs 32";
            }
            if (at_warp != hi - lo) {
                return "warp " + std::to_string(w) + ": " + std::to_string(at_warp) + " of " +
                       std::to_string(hi - lo) +
                       " lanes at a shuffle or __syncwarp, the others at __syncthreads or ended";
            }
            for (unsigned i = lo; i < hi; ++i) {
                b.fibers[i].state = State::Run;
            }
            released = true;
        }
        if (released) {
            continue;
        }
        if (done == n) {
            return "";
        }
        // Only __syncthreads waiters are left (ended threads count as arrived); all at the same
        // one, or the kernel diverged.
        (void)at_block;
        int line = -1;
        for (const Fiber& f : b.fibers) {
            if (f.state != State::BlockBarrier) {
                continue;
            }
            if (line >= 0 && f.line != line) {
                return "threads wait at different __syncthreads (lines " + std::to_string(line) +
                       " and " + std::to_string(f.line) + ")";
            }
            line = f.line;
        }
        for (Fiber& f : b.fibers) {
            if (f.state == State::BlockBarrier) {
                f.state = State::Run;
            }
        }
    }
}

// Ends the calling thread with `what` as the block's error (the launch fails with it).
[[noreturn]] inline void fail(const std::string& what) {
    Fiber* f = g_block->cur;
    if (g_block->error.empty()) {
        g_block->error = "thread " + std::to_string(f->tid) + ": " + what;
    }
    f->state = State::Done;
    setcontext(&g_block->sched);
    std::abort();  // setcontext does not return
}

// Lane `lane` of the warp gets `v` from lane `src(lane)`.
template <class T, class F>
inline T shuffle(T v, F src) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    const unsigned tid = linear_tid();
    const unsigned lane = tid & 31, warp = tid >> 5;
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    g_block->xchg[warp][lane] = bits;
    wait(State::WarpBarrier);
    bits = g_block->xchg[warp][src(lane) & 31];
    wait(State::WarpBarrier);
    T r;
    std::memcpy(&r, &bits, sizeof(T));
    return r;
}

}  // namespace emu

namespace emu {
// The first thread of a block to reach a __shared__ declaration fills the variable with 0xFF
// bytes (shared memory starts undefined on the device; this makes reading it before any
// thread wrote it show up as NaN or -1).
inline void poison(void* p, size_t n) {
    if (g_block->poisoned.insert(p).second) {
        std::memset(p, 0xFF, n);
    }
}
inline void sync_block(int line) {
    g_block->cur->line = line;
    wait(State::BlockBarrier);
}
}  // namespace emu
#define __syncthreads() emu::sync_block(__LINE__)
#define EMU_POISON(v) emu::poison(&(v), sizeof(v))
inline void __syncwarp(unsigned = 0xffffffffu) { emu::wait(emu::State::WarpBarrier); }

template <class T>
inline T __shfl_xor_sync(unsigned, T v, int mask) {
    return emu::shuffle(v, [mask](unsigned lane) { return lane ^ (unsigned)mask; });
}
template <class T>
inline T __shfl_sync(unsigned, T v, int src) {
    return emu::shuffle(v, [src](unsigned) { return (unsigned)src; });
}
template <class T>
inline T __shfl_down_sync(unsigned, T v, unsigned d) {
    return emu::shuffle(v, [d](unsigned lane) { return lane + d < 32 ? lane + d : lane; });
}

template <class To, class From>
inline To bit_cast_(From v) {
    static_assert(sizeof(To) == sizeof(From), "same size");
    To t;
    std::memcpy(&t, &v, sizeof t);
    return t;
}
inline float __int_as_float(int i) { return bit_cast_<float>(i); }
inline int __float_as_int(float f) { return bit_cast_<int>(f); }
inline float __uint_as_float(unsigned u) { return bit_cast_<float>(u); }
inline unsigned __float_as_uint(float f) { return bit_cast_<unsigned>(f); }
inline float __expf(float x) { return std::exp(x); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
// Blocks run one after another, so every write is visible to the blocks after it.
inline void __threadfence() {}
// Fibers switch only at barriers, so a read-modify-write is atomic here.
inline int atomicMin(int* p, int v) {
    int old = *p;
    if (v < old) {
        *p = v;
    }
    return old;
}
inline int atomicAdd(int* p, int v) {
    int old = *p;
    *p = old + v;
    return old;
}
inline float atomicAdd(float* p, float v) {
    float old = *p;
    *p = old + v;
    return old;
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 for the warp, from the PTX ISA's fragment
// layouts (group = lane / 4, quad = lane % 4; the lower-indexed element of a pair in the low 16
// bits): A (16x16, row-major) a[0] = (group, 2quad..+1), a[1] = (group + 8, 2quad..+1),
// a[2] = (group, 2quad + 8..+9), a[3] = (group + 8, 2quad + 8..+9); B (16x8, K x N)
// b[0] = (k 2quad..+1, n group), b[1] = (k 2quad + 8..+9, n group); C/D (16x8)
// d[0..1] = (group, 2quad..+1), d[2..3] = (group + 8, 2quad..+1). d += A B, in f32.
inline void mma_bf16_16816(float* d, const unsigned* a, const unsigned* b) {
    const unsigned tid = emu::linear_tid();
    const unsigned lane = tid & 31, warp = tid >> 5;
    // Each lane publishes its 6 registers, in three 64-bit exchanges.
    static unsigned regs[32][32][6];
    for (int i = 0; i < 4; ++i) {
        regs[warp][lane][i] = a[i];
    }
    regs[warp][lane][4] = b[0];
    regs[warp][lane][5] = b[1];
    emu::wait(emu::State::WarpBarrier);
    float A[16][16], B[16][8];
    auto half = [](unsigned r, int hi) {
        return __uint_as_float(((hi ? r >> 16 : r) & 0xffffu) << 16);
    };
    for (unsigned l = 0; l < 32; ++l) {
        const unsigned g = l / 4, q = l % 4;
        const unsigned* r = regs[warp][l];
        for (int e = 0; e < 2; ++e) {
            A[g][2 * q + e] = half(r[0], e);
            A[g + 8][2 * q + e] = half(r[1], e);
            A[g][2 * q + 8 + e] = half(r[2], e);
            A[g + 8][2 * q + 8 + e] = half(r[3], e);
            B[2 * q + e][g] = half(r[4], e);
            B[2 * q + 8 + e][g] = half(r[5], e);
        }
    }
    emu::wait(emu::State::WarpBarrier);
    const unsigned g = lane / 4, q = lane % 4;
    for (int i = 0; i < 4; ++i) {
        const unsigned row = g + (i >= 2 ? 8 : 0), col = 2 * q + (i & 1);
        float s = 0.0f;
        for (int k = 0; k < 16; ++k) {
            s += A[row][k] * B[k][col];
        }
        d[i] += s;
    }
}

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16 for the warp: lanes 8i..8i+7 give the
// addresses of matrix i's 8 rows (8 bf16 each, 16-byte aligned); lane t gets r[i] = matrix
// i's (row t / 4, columns 2(t % 4)..+1), or with `trans` (rows 2(t % 4)..+1, column t / 4),
// the lower-indexed element in the low 16 bits.
inline void ldmatrix_rows(unsigned* r, const unsigned short* row, bool trans) {
    const unsigned tid = emu::linear_tid();
    const unsigned lane = tid & 31, warp = tid >> 5;
    if ((uintptr_t)row % 16 != 0) {
        emu::fail("ldmatrix row address not 16-byte aligned");
    }
    emu::g_block->xchg[warp][lane] = (unsigned long long)(uintptr_t)row;
    emu::wait(emu::State::WarpBarrier);
    const unsigned a = lane / 4, b = 2 * (lane % 4);
    for (unsigned i = 0; i < 4; ++i) {
        auto at = [&](unsigned rr, unsigned c) {
            return (unsigned)((const unsigned short*)(uintptr_t)emu::g_block->xchg[warp][8 * i + rr])[c];
        };
        const unsigned lo = trans ? at(b, a) : at(a, b);
        const unsigned hi = trans ? at(b + 1, a) : at(a, b + 1);
        r[i] = lo | (hi << 16);
    }
    emu::wait(emu::State::WarpBarrier);
}
inline void ldmatrix_x4(unsigned* r, const unsigned short* row) { ldmatrix_rows(r, row, false); }
inline void ldmatrix_x4_trans(unsigned* r, const unsigned short* row) {
    ldmatrix_rows(r, row, true);
}

// cp.async: a copy is queued in the thread's open group and done only when a wait covers the
// group (so a read before the wait sees the old bytes, as it may on the device).
inline void cp_async_16(unsigned short* dst, const unsigned short* src) {
    if ((uintptr_t)dst % 16 != 0 || (uintptr_t)src % 16 != 0) {
        emu::fail("cp.async of 16 bytes between addresses not 16-byte aligned");
    }
    emu::Fiber* f = emu::g_block->cur;
    f->copies.push_back({dst, src, f->committed});
}
inline void cp_async_commit() { ++emu::g_block->cur->committed; }
template <int N>
inline void cp_async_wait() {
    emu::Fiber* f = emu::g_block->cur;
    std::vector<emu::Copy> left;
    for (const emu::Copy& c : f->copies) {
        if (c.group + N < f->committed) {
            std::memcpy(c.dst, c.src, 16);
        } else {
            left.push_back(c);
        }
    }
    f->copies.swap(left);
}

inline float exp2_approx(float x) { return std::exp2(x); }

// The emulation runs one kernel at a time, in stream order: nothing to overlap.
inline void pdl_launch_dependents() {}
inline void pdl_wait() {}
inline void prefetch_l2(const void*) {}

inline uint4 load_stream(const void* p) {
    if ((uintptr_t)p % 16 != 0) {
        emu::fail("16-byte load from an address not 16-byte aligned");
    }
    return *(const uint4*)p;
}

namespace emu {

// A kernel's launcher: `args` as cuLaunchKernel takes them (one pointer per parameter), and
// the parameters' sizes (an emulated driver copies them when it records a launch).
struct Entry {
    const char* name;
    void (*thunk)(void**);
    unsigned params;
    unsigned sizes[32];
    bool pointer[32];
};

template <class... A>
constexpr Entry entry_for(const char* name, void (*thunk)(void**), void (*)(A...)) {
    static_assert(sizeof...(A) <= 32, "at most 32 kernel parameters");
    return Entry{name, thunk, sizeof...(A), {(unsigned)sizeof(A)...},
                 {std::is_pointer<A>::value...}};
}

template <class... A, size_t... I>
inline void call(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*static_cast<A*>(args[I])...);
}

template <class... A>
inline void call(void (*f)(A...), void** args) {
    call(f, args, std::index_sequence_for<A...>{});
}

// The entry of kernel `name` in `table`, or null.
inline const Entry* find(const Entry* table, size_t n, const char* name) {
    for (size_t i = 0; i < n; ++i) {
        if (std::strcmp(table[i].name, name) == 0) {
            return &table[i];
        }
    }
    return nullptr;
}

// Fibers never preempt each other, so a kernel that loops forever would hang its test (and CI)
// silently: a watchdog ends the process, naming the kernel, when one launch runs past
// LAUNCH_LIMIT_S seconds.
#ifndef EMU_LAUNCH_LIMIT_S
#define EMU_LAUNCH_LIMIT_S 300
#endif
constexpr long long LAUNCH_LIMIT_S = EMU_LAUNCH_LIMIT_S;
inline std::atomic<long long> g_launch_started{0};  // seconds since the epoch, 0: idle
inline std::atomic<const char*> g_launch_name{nullptr};

inline long long now_s() {
    return std::chrono::duration_cast<std::chrono::seconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

inline void start_watchdog() {
    static std::once_flag once;
    std::call_once(once, [] {
        std::thread([] {
            for (;;) {
                std::this_thread::sleep_for(std::chrono::seconds(1));
                const long long t = g_launch_started.load();
                if (t != 0 && now_s() - t > LAUNCH_LIMIT_S) {
                    const char* name = g_launch_name.load();
                    std::fprintf(stderr, "emulated kernel %s ran past %lld s: stopping\n",
                                 name ? name : "?", LAUNCH_LIMIT_S);
                    std::abort();
                }
            }
        }).detach();
    });
}

// Runs kernel `e` over the grid, block after block; 0, or 1 with a message.
inline int run(const Entry& e, const unsigned* grid, const unsigned* block, void** args,
               char* err, size_t errlen) {
    start_watchdog();
    g_launch_name.store(e.name);
    g_launch_started.store(now_s());
    struct Done {
        ~Done() { g_launch_started.store(0); }
    } done;
    gridDim = {grid[0], grid[1], grid[2]};
    blockDim = {block[0], block[1], block[2]};
    const std::function<void()> body = [&] { e.thunk(args); };
    // Blocks in a shuffled order: a kernel must not depend on the order blocks run in.
    const unsigned long long n = (unsigned long long)grid[0] * grid[1] * grid[2];
    std::vector<unsigned long long> order(n);
    for (unsigned long long i = 0; i < n; ++i) {
        order[i] = i;
    }
    unsigned long long rng = 0x2545F4914F6CDD1Dull ^ n;
    for (unsigned long long i = n; i > 1; --i) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        std::swap(order[i - 1], order[rng % i]);
    }
    for (unsigned long long i : order) {
        const unsigned x = (unsigned)(i % grid[0]);
        const unsigned y = (unsigned)(i / grid[0] % grid[1]);
        const unsigned z = (unsigned)(i / ((unsigned long long)grid[0] * grid[1]));
        blockIdx = {x, y, z};
        const std::string r = run_block(block[0] * block[1] * block[2], body);
        if (!r.empty()) {
            std::snprintf(err, errlen, "%s, block (%u, %u, %u): %s", e.name, x, y, z, r.c_str());
            return 1;
        }
    }
    return 0;
}

// Runs kernel `name` of `table` with `nargs` arguments of `sizes` bytes (checked against its
// parameters: a 4-byte int where the kernel takes 8 bytes is an error, not a zero-extended
// value); 0, or 1 with a message.
inline int launch(const Entry* table, size_t n, const char* name, const unsigned* grid,
                  const unsigned* block, void** args, const unsigned* sizes, unsigned nargs,
                  char* err, size_t errlen) {
    const Entry* e = find(table, n, name);
    if (e == nullptr) {
        std::snprintf(err, errlen, "no kernel named %s", name);
        return 1;
    }
    if (nargs != e->params) {
        std::snprintf(err, errlen, "%s takes %u parameters, given %u", name, e->params, nargs);
        return 1;
    }
    for (unsigned i = 0; i < nargs; ++i) {
        if (sizes[i] != e->sizes[i]) {
            std::snprintf(err, errlen, "%s parameter %u is %u bytes, given %u", name, i,
                          e->sizes[i], sizes[i]);
            return 1;
        }
    }
    return run(*e, grid, block, args, err, errlen);
}

}  // namespace emu

#define EMU_KERNEL(f) emu::entry_for(#f, [](void** a) { emu::call(f, a); }, f)
