// Shared by every kernel source (prepended by the loader; NVRTC needs no CUDA headers).
// bf16 values travel as their 16-bit patterns: conversions below round to nearest even and keep
// NaN a NaN. Accumulation is always f32.
typedef unsigned short bf16_t;
typedef unsigned short f16_t;

// +infinity without math.h.
#define SLUICE_INF __int_as_float(0x7f800000)

__device__ __forceinline__ float bf16_to_f32(bf16_t x) {
    return __uint_as_float(((unsigned int)x) << 16);
}

__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16_t)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// IEEE half (GGML block scales) to f32, subnormals included.
__device__ __forceinline__ float f16_to_f32(f16_t h) {
    unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    unsigned int exp = ((unsigned int)h >> 10) & 0x1fu;
    unsigned int mant = (unsigned int)h & 0x3ffu;
    if (exp == 0u) {
        float v = (float)mant * 5.9604644775390625e-8f;  // mant * 2^-24
        return sign ? -v : v;
    }
    if (exp == 31u) {
        return __uint_as_float(sign | 0x7f800000u | (mant << 13));
    }
    return __uint_as_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    return v;
}

// Sum (MAX = false) or maximum (MAX = true) over the block (blockDim.x a multiple of 32, at
// most 1024); every thread gets it.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    v = MAX ? warp_max(v) : warp_sum(v);
    __syncthreads();
    if (lane == 0) {
        partial[warp] = v;
    }
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = ((int)threadIdx.x < warps) ? partial[threadIdx.x] : (MAX ? -SLUICE_INF : 0.0f);
    if (warp == 0) {
        v = MAX ? warp_max(v) : warp_sum(v);
        if (lane == 0) {
            partial[0] = v;
        }
    }
    __syncthreads();
    return partial[0];
}

__device__ __forceinline__ float block_sum(float v) { return block_reduce<false>(v); }

__device__ __forceinline__ float block_max(float v) { return block_reduce<true>(v); }

// d += A B on the tensor cores for one warp: A 16x16 bf16 (row-major), B 16x8 bf16, d 16x8 f32,
// in the PTX fragment layouts of mma.m16n8k16 (group = lane / 4, quad = lane % 4; a pair's
// lower-indexed element in the low 16 bits): a[0] = A(group, 2quad..+1), a[1] = A(group + 8,
// 2quad..+1), a[2] = A(group, 2quad + 8..+9), a[3] = A(group + 8, 2quad + 8..+9);
// b[0] = B(2quad..+1, group), b[1] = B(2quad + 8..+9, group); d[0..1] = D(group, 2quad..+1),
// d[2..3] = D(group + 8, 2quad..+1). sm_80 and newer. (The CPU emulation of the tests defines
// its own of this and of the helpers after it.)
#ifndef SLUICE_EMU
__device__ __forceinline__ void mma_bf16_16816(float* d, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ unsigned shared_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// Four 8x8 bf16 matrices from shared memory into the mma fragment layout, for the warp: lanes
// 8i..8i+7 give the addresses of matrix i's rows (16 bytes each, 16-byte aligned), and lane t
// gets r[i] = matrix i's (row t / 4, columns 2(t % 4)..+1). With `_trans`, the transposed
// matrix: r[i] = (rows 2(t % 4)..+1, column t / 4).
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, const bf16_t* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row))
                 : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const bf16_t* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row))
                 : "memory");
}

// Asynchronous 16-byte copy from global to shared memory (both 16-byte aligned), bypassing
// L1. The copies a thread queued since its last commit form a group; `cp_async_wait<N>` waits
// until at most N of the thread's committed groups are still in flight. Other threads see the
// data after that wait and a barrier.
__device__ __forceinline__ void cp_async_16(bf16_t* dst, const bf16_t* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(dst)),
                 "l"(src)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Programmatic dependent launch (sm_90 and newer; no-ops before): `pdl_launch_dependents`
// lets the next kernel of the stream, when launched so, start its blocks now; `pdl_wait`
// waits until the kernel before this one (when this one was launched so) has finished and its
// writes are visible. A kernel launched so writes nothing and reads nothing another kernel
// wrote before its `pdl_wait`.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Starts bringing the line of `p` into L2 (no register waits on it).
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// A 16-byte load of data read once (a matrix-vector product's weights): the read-only path,
// not kept in L1, where the vector stays. `p` is 16-byte aligned.
__device__ __forceinline__ uint4 load_stream(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// 2^x, the hardware approximation (2 ulp; 0 for -inf, subnormal results flushed to 0).
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#endif

// Two bf16 bit patterns in one register, `lo` in the low half.
__device__ __forceinline__ unsigned pack_bf16(bf16_t lo, bf16_t hi) {
    return (unsigned)lo | ((unsigned)hi << 16);
}

// The two bf16 of a packed pair as f32: the lower-indexed (low half), the other (high half).
__device__ __forceinline__ float lo_f32(unsigned p) { return __uint_as_float(p << 16); }
__device__ __forceinline__ float hi_f32(unsigned p) { return __uint_as_float(p & 0xffff0000u); }

// 16 bytes of bf16 as 8 f32.
__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    f[0] = lo_f32(v.x);
    f[1] = hi_f32(v.x);
    f[2] = lo_f32(v.y);
    f[3] = hi_f32(v.y);
    f[4] = lo_f32(v.z);
    f[5] = hi_f32(v.z);
    f[6] = lo_f32(v.w);
    f[7] = hi_f32(v.w);
}

// f(lo, hi) -> packed bf16 pair, over the four pairs of 16 bytes of bf16 (a, b: the operands'
// 16 bytes).
template <typename F>
__device__ __forceinline__ uint4 map_pairs(uint4 a, uint4 b, F f) {
    return make_uint4(f(a.x, b.x), f(a.y, b.y), f(a.z, b.z), f(a.w, b.w));
}

// ss + the squares of 16 bytes of bf16.
__device__ __forceinline__ float sum_squares8(uint4 v, float ss) {
    const unsigned p[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        ss = fmaf(lo_f32(p[j]), lo_f32(p[j]), ss);
        ss = fmaf(hi_f32(p[j]), hi_f32(p[j]), ss);
    }
    return ss;
}
