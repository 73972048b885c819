// Matrix-vector products for batches of 1..GEMV_MAX_ROWS rows (decode steps): y[r, o] =
// sum_k x[r, k] W[o, k], W bf16 [out_dim][in_dim] row-major as the GEMMs take it. At these
// batch sizes a product is one stream over the weights, and a decode step is bound by HBM.
// A block of GEMV_WARPS warps takes GEMV_WARPS / splits outputs; each output's row (two rows
// in GEMV_SILU) is split into `splits` parts (1, 2 or 4: more blocks, so the last wave of a
// small matrix leaves less of the device idle), one warp a part, whose lanes read 16 bytes at a
// time with GEMV_UNROLL loads in flight (half that for 3 or 4 rows; not kept in L1, where the
// rows of x stay: every warp reads them). Few registers a thread, so many warps fit: with
// small matrices the loads in flight come from the warps, not from deep pipelines (measured
// on the H200: a software-pipelined loop at half the warps was slower). in_dim is a multiple of 8 and every buffer 16-byte aligned. Grid:
// ceil(out_dim * splits / GEMV_WARPS).
//
// The epilogue (`mode`) fuses what follows the product in the forward pass:
//   GEMV_BF16  out bf16 [rows][out_dim] = y
//   GEMV_F32   out f32 [rows][out_dim] = y (the logits)
//   GEMV_ADD   out bf16 [rows][out_dim] += bf16(y) (the residual stream: the output
//              projections' result added as add_rmsnorm adds it)
//   GEMV_SILU  W holds 2 out_dim rows, [gate; up] (the stacked gate/up projection): out bf16
//              [rows][out_dim] = silu(bf16(gate)) * bf16(up), as silu_mul computes it
// gemv_norm multiplies x by RMSNorm's weight norm_w as it reads it and sums x^2 alongside
// (every warp reads the whole of its part of x anyway), then scales the product by
// 1 / sqrt(mean(x^2) + eps): RMSNorm fused in with no pass of its own (the normalized x is not
// rounded to bf16 first, as the rmsnorm kernel's output is: within bf16's rounding of it).

// Warps a block and loads in flight a lane: the runner's choice (CudaRunner::set_gemv_shape,
// for the device bench's comparison), these by default.
#ifndef GEMV_WARPS
#define GEMV_WARPS 4
#endif
#ifndef GEMV_UNROLL
#define GEMV_UNROLL 2
#endif
#define GEMV_MAX_ROWS 4

#define GEMV_BF16 0
#define GEMV_F32 1
#define GEMV_ADD 2
#define GEMV_SILU 3

// acc + the dot product of 8 bf16 weights (16 bytes) with 8 f32 values.
__device__ __forceinline__ float dot8(uint4 w, const float* x, float acc) {
    acc = fmaf(lo_f32(w.x), x[0], acc);
    acc = fmaf(hi_f32(w.x), x[1], acc);
    acc = fmaf(lo_f32(w.y), x[2], acc);
    acc = fmaf(hi_f32(w.y), x[3], acc);
    acc = fmaf(lo_f32(w.z), x[4], acc);
    acc = fmaf(hi_f32(w.z), x[5], acc);
    acc = fmaf(lo_f32(w.w), x[6], acc);
    return fmaf(hi_f32(w.w), x[7], acc);
}

// Weight chunks c0, c0 + 32, ... (U of them, below `end`) of one or two rows into registers
// (zeros past the end).
template <int U, bool PAIR>
__device__ __forceinline__ void gemv_load(uint4* a, uint4* b, const uint4* w0, const uint4* w1,
                                          int c0, int end) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int c = c0 + 32 * u;
        a[u] = b[u] = make_uint4(0u, 0u, 0u, 0u);
        if (c < end) {
            a[u] = load_stream(w0 + c);
            if (PAIR) {
                b[u] = load_stream(w1 + c);
            }
        }
    }
}

// One warp's sums over chunks first, first + 32, ... (below `end`) of weight row w0 (and w1
// when PAIR) against R rows of x (times norm_w when NORM, their squares summed in ss), reduced
// over the warp: every lane gets each row's acc0, acc1 and ss.
template <int R, bool PAIR, bool NORM>
__device__ __forceinline__ void gemv_dots(const bf16_t* __restrict__ x,
                                          const bf16_t* __restrict__ norm_w, const uint4* w0,
                                          const uint4* w1, int in_dim, int first, int end,
                                          float* acc0, float* acc1, float* ss) {
    const uint4* g = (const uint4*)norm_w;
    // Loads in flight a step (fewer with more rows: their sums take the registers).
    constexpr int U = (R <= 2 || GEMV_UNROLL < 2) ? GEMV_UNROLL : GEMV_UNROLL / 2;
    // Launched after another kernel with programmatic dependent launch: the next product may
    // start now, and this one's first weights are on their way to L2 while the kernel before
    // finishes (weights are nobody's output); x is read only after that kernel is done.
    pdl_launch_dependents();
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int c = first + 32 * u;
        if (c < end) {
            prefetch_l2(w0 + c);
            if (PAIR) {
                prefetch_l2(w1 + c);
            }
        }
    }
    pdl_wait();
#pragma unroll
    for (int r = 0; r < R; ++r) {
        acc0[r] = acc1[r] = ss[r] = 0.0f;
    }
    for (int c0 = first; c0 < end; c0 += 32 * U) {
        uint4 a[U];
        uint4 b[U];
        gemv_load<U, PAIR>(a, b, w0, w1, c0, end);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + 32 * u;
            if (c < end) {
                float gf[8];
                if (NORM) {
                    unpack8(g[c], gf);
                }
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    float xf[8];
                    unpack8(*(const uint4*)(x + (long long)r * in_dim + 8 * c), xf);
                    if (NORM) {
#pragma unroll
                        for (int j = 0; j < 8; ++j) {
                            ss[r] = fmaf(xf[j], xf[j], ss[r]);
                            xf[j] *= gf[j];
                        }
                    }
                    acc0[r] = dot8(a[u], xf, acc0[r]);
                    if (PAIR) {
                        acc1[r] = dot8(b[u], xf, acc1[r]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        acc0[r] = warp_sum(acc0[r]);
        acc1[r] = PAIR ? warp_sum(acc1[r]) : 0.0f;
        ss[r] = NORM ? warp_sum(ss[r]) : 0.0f;
    }
}

// The block's outputs for R rows of x; NORM: gemv_norm; PAIR: GEMV_SILU.
template <int R, bool PAIR, bool NORM>
__device__ __forceinline__ void gemv_rows(const bf16_t* __restrict__ x,
                                          const bf16_t* __restrict__ norm_w, float eps,
                                          const bf16_t* __restrict__ w, void* out, int out_dim,
                                          int in_dim, int mode, int splits) {
    // Each warp's sums for each row (dot, the up row's dot, sum of x^2), for the part's
    // combination.
    __shared__ float partial[GEMV_WARPS][3][GEMV_MAX_ROWS];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int o = blockIdx.x * (GEMV_WARPS / splits) + warp / splits;
    const int part = warp % splits;
    const int chunks = in_dim >> 3;
    const int per_part = (chunks + splits - 1) / splits;
    const int begin = part * per_part;
    // A warp past the last output reads nothing (it still meets the barrier).
    const int end = o < out_dim ? min(chunks, begin + per_part) : begin;
    const int row0 = min(o, out_dim - 1);
    const uint4* w0 = (const uint4*)(w + (long long)row0 * in_dim);
    const uint4* w1 = (const uint4*)(w + (long long)(row0 + (PAIR ? out_dim : 0)) * in_dim);
    float acc0[R];
    float acc1[R];
    float ss[R];
    gemv_dots<R, PAIR, NORM>(x, norm_w, w0, w1, in_dim, begin + lane, end, acc0, acc1, ss);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (lane == 0) {
            partial[warp][0][r] = acc0[r];
            partial[warp][1][r] = acc1[r];
            partial[warp][2][r] = ss[r];
        }
    }
    __syncthreads();
    // The first warp of each output: lane r finishes row r.
    if (part != 0 || o >= out_dim || lane >= R) {
        return;
    }
    float y = 0.0f;
    float up = 0.0f;
    float sq = 0.0f;
    for (int p = 0; p < splits; ++p) {
        y += partial[warp + p][0][lane];
        up += partial[warp + p][1][lane];
        sq += partial[warp + p][2][lane];
    }
    if (NORM) {
        const float scale = rsqrtf(sq / (float)in_dim + eps);
        y *= scale;
        up *= scale;
    }
    const long long i = (long long)lane * out_dim + o;
    bf16_t* ob = (bf16_t*)out;
    if (PAIR) {
        const float gate = bf16_to_f32(f32_to_bf16(y));
        ob[i] = f32_to_bf16(gate / (1.0f + __expf(-gate)) * bf16_to_f32(f32_to_bf16(up)));
    } else if (mode == GEMV_F32) {
        ((float*)out)[i] = y;
    } else if (mode == GEMV_ADD) {
        ob[i] = f32_to_bf16(bf16_to_f32(ob[i]) + bf16_to_f32(f32_to_bf16(y)));
    } else {
        ob[i] = f32_to_bf16(y);
    }
}

template <int R, bool NORM>
__device__ __forceinline__ void gemv_mode(const bf16_t* __restrict__ x,
                                          const bf16_t* __restrict__ norm_w, float eps,
                                          const bf16_t* __restrict__ w, void* out, int out_dim,
                                          int in_dim, int mode, int splits) {
    if (splits != 1 && splits != 2 && splits != 4) {
        return;
    }
    if (mode == GEMV_SILU) {
        gemv_rows<R, true, NORM>(x, norm_w, eps, w, out, out_dim, in_dim, mode, splits);
    } else {
        gemv_rows<R, false, NORM>(x, norm_w, eps, w, out, out_dim, in_dim, mode, splits);
    }
}

// The stacked Q/K/V projection of R rows with RMSNorm before it (as gemv_norm) and RoPE and
// the K/V cache write after it (as rope_kv), in one pass: the query heads rotated into `qkv`
// (rows of (heads + 2 kv_heads) head_dim; its key and value parts are not written), the keys
// rotated and the values into their cache slots (none for a slot < 0). A warp per work item:
// a rotated pair of a query or key head (two weight rows), then those heads' dimensions past
// rope_dims, then the value dimensions. Rounded as the two kernels round: the product to bf16,
// then the rotation. No barriers: a warp past the last item returns.
template <int R>
__device__ __forceinline__ void gemv_rope_rows(
    const bf16_t* __restrict__ x, const bf16_t* __restrict__ norm_w, float eps,
    const bf16_t* __restrict__ w, bf16_t* __restrict__ qkv, bf16_t* __restrict__ k_cache,
    bf16_t* __restrict__ v_cache, const int* __restrict__ pos, const int* __restrict__ slots,
    const float* __restrict__ inv_freq, int heads, int kv_heads, int head_dim, int rope_dims,
    int interleaved, int in_dim) {
    const int lane = threadIdx.x & 31;
    const int item = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    const int rotated = heads + kv_heads;
    const int half = rope_dims / 2;
    const int pairs = rotated * half;
    const int unrotated = rotated * (head_dim - rope_dims);
    int h;
    int da;
    int db = -1;
    int i = 0;
    if (item < pairs) {
        h = item / half;
        i = item % half;
        da = interleaved ? 2 * i : i;
        db = interleaved ? 2 * i + 1 : i + half;
    } else if (item < pairs + unrotated) {
        h = (item - pairs) / (head_dim - rope_dims);
        da = rope_dims + (item - pairs) % (head_dim - rope_dims);
    } else if (item < pairs + unrotated + kv_heads * head_dim) {
        h = rotated + (item - pairs - unrotated) / head_dim;
        da = (item - pairs - unrotated) % head_dim;
    } else {
        pdl_launch_dependents();
        return;
    }
    const uint4* w0 = (const uint4*)(w + (long long)(h * head_dim + da) * in_dim);
    const uint4* w1 = (const uint4*)(w + (long long)(h * head_dim + max(db, da)) * in_dim);
    float acc0[R];
    float acc1[R];
    float ss[R];
    if (db >= 0) {
        gemv_dots<R, true, true>(x, norm_w, w0, w1, in_dim, lane, in_dim >> 3, acc0, acc1, ss);
    } else {
        gemv_dots<R, false, true>(x, norm_w, w0, w1, in_dim, lane, in_dim >> 3, acc0, acc1, ss);
    }
    // Lane r finishes row r.
    float ya = 0.0f;
    float yb = 0.0f;
    float sq = 0.0f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (r == lane) {
            ya = acc0[r];
            yb = acc1[r];
            sq = ss[r];
        }
    }
    if (lane >= R) {
        return;
    }
    const float scale = rsqrtf(sq / (float)in_dim + eps);
    ya = bf16_to_f32(f32_to_bf16(ya * scale));
    yb = bf16_to_f32(f32_to_bf16(yb * scale));
    const long long kv_dim = (long long)kv_heads * head_dim;
    const int slot = slots[lane];
    bf16_t* dst;
    if (h < heads) {
        dst = qkv + (long long)lane * (rotated + kv_heads) * head_dim + h * head_dim;
    } else if (slot < 0) {
        return;
    } else if (h < rotated) {
        dst = k_cache + slot * kv_dim + (long long)(h - heads) * head_dim;
    } else {
        dst = v_cache + slot * kv_dim + (long long)(h - rotated) * head_dim;
    }
    if (db < 0) {
        dst[da] = f32_to_bf16(ya);
        return;
    }
    float sn;
    float cs;
    sincosf((float)pos[lane] * inv_freq[i], &sn, &cs);
    dst[da] = f32_to_bf16(ya * cs - yb * sn);
    dst[db] = f32_to_bf16(ya * sn + yb * cs);
}

// One kernel per row count (each its own registers: one row needs fewer than four, and more
// warps in flight keep more loads in flight). gemvR: y = x W^T with the epilogue `mode` for R
// rows of x; gemv_normR: y = rmsnorm(x) * norm_w, then W^T. Blocks a multiprocessor holds at
// least, for one row and for more: 32 and 24 warps at 4 loads a lane or fewer, fewer warps
// with more loads (each then needs the registers for them).
#define GEMV_BLOCKS_1 (GEMV_UNROLL >= 4 ? 128 / GEMV_UNROLL / GEMV_WARPS : 32 / GEMV_WARPS)
#define GEMV_BLOCKS_N (GEMV_UNROLL >= 4 ? 96 / GEMV_UNROLL / GEMV_WARPS : 24 / GEMV_WARPS)
#define GEMV_PARAMS                                                                             \
    const bf16_t *__restrict__ x, const bf16_t *__restrict__ w, void *out, int out_dim,         \
        int in_dim, int mode, int splits
#define GEMV_NORM_PARAMS                                                                        \
    const bf16_t *__restrict__ x, const bf16_t *__restrict__ norm_w, float eps,                 \
        const bf16_t *__restrict__ w, void *out, int out_dim, int in_dim, int mode, int splits
#define GEMV_ARGS w, out, out_dim, in_dim, mode, splits
extern "C" __global__ __launch_bounds__(GEMV_WARPS * 32, GEMV_BLOCKS_1) void gemv1(GEMV_PARAMS) {
    gemv_mode<1, false>(x, x, 0.0f, GEMV_ARGS);
}
extern "C" __global__ __launch_bounds__(GEMV_WARPS * 32, GEMV_BLOCKS_N) void gemv2(GEMV_PARAMS) {
    gemv_mode<2, false>(x, x, 0.0f, GEMV_ARGS);
}
extern "C" __global__ __launch_bounds__(GEMV_WARPS * 32, GEMV_BLOCKS_N) void gemv3(GEMV_PARAMS) {
    gemv_mode<3, false>(x, x, 0.0f, GEMV_ARGS);
}
extern "C" __global__ __launch_bounds__(GEMV_WARPS * 32, GEMV_BLOCKS_N) void gemv4(GEMV_PARAMS) {
    gemv_mode<4, false>(x, x, 0.0f, GEMV_ARGS);
}
extern "C" __global__ __launch_bounds__(GEMV_WARPS * 32, GEMV_BLOCKS_1) void gemv_norm1(GEMV_NORM_PARAMS) {
    gemv_mode<1, true>(x, norm_w, eps, GEMV_ARGS);
}
extern "C" __global__ __launch_bounds__(GEMV_WARPS * 32, GEMV_BLOCKS_N) void gemv_norm2(GEMV_NORM_PARAMS) {
    gemv_mode<2, true>(x, norm_w, eps, GEMV_ARGS);
}
extern "C" __global__ __launch_bounds__(GEMV_WARPS * 32, GEMV_BLOCKS_N) void gemv_norm3(GEMV_NORM_PARAMS) {
    gemv_mode<3, true>(x, norm_w, eps, GEMV_ARGS);
}
extern "C" __global__ __launch_bounds__(GEMV_WARPS * 32, GEMV_BLOCKS_N) void gemv_norm4(GEMV_NORM_PARAMS) {
    gemv_mode<4, true>(x, norm_w, eps, GEMV_ARGS);
}
#define GEMV_ROPE_PARAMS                                                                        \
    const bf16_t *__restrict__ x, const bf16_t *__restrict__ norm_w, float eps,                 \
        const bf16_t *__restrict__ w, bf16_t *__restrict__ qkv, bf16_t *__restrict__ k_cache,   \
        bf16_t *__restrict__ v_cache, const int *__restrict__ pos,                              \
        const int *__restrict__ slots, const float *__restrict__ inv_freq, int heads,           \
        int kv_heads, int head_dim, int rope_dims, int interleaved, int in_dim
#define GEMV_ROPE_ARGS                                                                          \
    x, norm_w, eps, w, qkv, k_cache, v_cache, pos, slots, inv_freq, heads, kv_heads, head_dim,  \
        rope_dims, interleaved, in_dim
extern "C" __global__ __launch_bounds__(GEMV_WARPS * 32, GEMV_BLOCKS_1) void gemv_rope1(
    GEMV_ROPE_PARAMS) {
    gemv_rope_rows<1>(GEMV_ROPE_ARGS);
}
extern "C" __global__ __launch_bounds__(GEMV_WARPS * 32, GEMV_BLOCKS_N) void gemv_rope2(
    GEMV_ROPE_PARAMS) {
    gemv_rope_rows<2>(GEMV_ROPE_ARGS);
}
extern "C" __global__ __launch_bounds__(GEMV_WARPS * 32, GEMV_BLOCKS_N) void gemv_rope3(
    GEMV_ROPE_PARAMS) {
    gemv_rope_rows<3>(GEMV_ROPE_ARGS);
}
extern "C" __global__ __launch_bounds__(GEMV_WARPS * 32, GEMV_BLOCKS_N) void gemv_rope4(
    GEMV_ROPE_PARAMS) {
    gemv_rope_rows<4>(GEMV_ROPE_ARGS);
}
