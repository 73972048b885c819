// Row and element kernels of the forward pass: embedding gather, RMSNorm (alone, and after the
// residual add), RoPE with the K/V cache write, SiLU-and-multiply, Q/K/V bias and random fill.

// out[t, :] = table[ids[t], :]. Grid: one block per token.
extern "C" __global__ void embedding_gather(const bf16_t* __restrict__ table,
                                            const int* __restrict__ ids,
                                            bf16_t* __restrict__ out, int hidden) {
    const long long t = blockIdx.x;
    const long long row = (long long)ids[t] * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        out[t * hidden + i] = table[row + i];
    }
}

// The row kernels below take 16 bytes a load when a row is whole 16-byte chunks (dim a
// multiple of 8; rows then start 16-byte aligned), 2 bytes otherwise: at small batches a row
// kernel is a chain of loads, and a thread's loads are then few.

// out = x / sqrt(mean(x^2) + eps) * w for the block's row of `dim`, given ss = sum(x^2) of the
// thread's own columns (chunks of 8 from threadIdx.x, + blockDim.x, ... when dim % 8 == 0,
// else single columns). `x` is not __restrict__: add_rmsnorm wrote it in the same kernel (no
// read-only cache path for it; each thread reads back only what it wrote).
__device__ __forceinline__ void norm_row(const bf16_t* x,
                                         const bf16_t* __restrict__ w, bf16_t* __restrict__ out,
                                         int dim, float eps, float ss) {
    ss = block_sum(ss);
    const float scale = rsqrtf(ss / (float)dim + eps);
    if ((dim & 7) == 0) {
        const auto norm = [scale](unsigned v, unsigned g) {
            return pack_bf16(f32_to_bf16(lo_f32(v) * scale * lo_f32(g)),
                             f32_to_bf16(hi_f32(v) * scale * hi_f32(g)));
        };
        for (int c = threadIdx.x; c < dim / 8; c += blockDim.x) {
            ((uint4*)out)[c] = map_pairs(((const uint4*)x)[c], ((const uint4*)w)[c], norm);
        }
        return;
    }
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        out[i] = f32_to_bf16(bf16_to_f32(x[i]) * scale * bf16_to_f32(w[i]));
    }
}

// out = x / sqrt(mean(x^2) + eps) * w, per row. Grid: one block per row.
extern "C" __global__ void rmsnorm(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                   bf16_t* __restrict__ out, int dim, float eps) {
    const long long base = (long long)blockIdx.x * dim;
    float ss = 0.0f;
    if ((dim & 7) == 0) {
        for (int c = threadIdx.x; c < dim / 8; c += blockDim.x) {
            ss = sum_squares8(((const uint4*)(x + base))[c], ss);
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            float v = bf16_to_f32(x[base + i]);
            ss += v * v;
        }
    }
    norm_row(x + base, w, out + base, dim, eps, ss);
}

// The residual add, then RMSNorm of the sum: x += y (the residual stream, rounded to bf16 in
// place), out = x / sqrt(mean(x^2) + eps) * w, per row. Grid: one block per row.
extern "C" __global__ void add_rmsnorm(bf16_t* __restrict__ x, const bf16_t* __restrict__ y,
                                       const bf16_t* __restrict__ w, bf16_t* __restrict__ out,
                                       int dim, float eps) {
    const long long base = (long long)blockIdx.x * dim;
    float ss = 0.0f;
    if ((dim & 7) == 0) {
        const auto add = [](unsigned a, unsigned b) {
            return pack_bf16(f32_to_bf16(lo_f32(a) + lo_f32(b)),
                             f32_to_bf16(hi_f32(a) + hi_f32(b)));
        };
        uint4* xv = (uint4*)(x + base);
        for (int c = threadIdx.x; c < dim / 8; c += blockDim.x) {
            const uint4 sum = map_pairs(xv[c], ((const uint4*)(y + base))[c], add);
            xv[c] = sum;
            ss = sum_squares8(sum, ss);
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            const bf16_t sum = f32_to_bf16(bf16_to_f32(x[base + i]) + bf16_to_f32(y[base + i]));
            x[base + i] = sum;
            const float v = bf16_to_f32(sum);
            ss += v * v;
        }
    }
    norm_row(x + base, w, out + base, dim, eps, ss);
}

// Rotary embedding on each token's row of the fused projection, qkv[t] = [q: heads, k:
// kv_heads, v: kv_heads] x head_dim: the first rope_dims of each query and key head rotate by
// pos[t] * inv_freq[i], in adjacent pairs (interleaved = 1, GGUF llama) or halves
// (interleaved = 0, NeoX style). The query heads rotate in place (attention reads them
// there); the rotated key heads and the value heads go into the cache at slots[t] (nothing
// when slot < 0: padding). Grid: one block per token; threads over (head, pair), then over
// the K/V row.
extern "C" __global__ void rope_kv(bf16_t* __restrict__ qkv, bf16_t* __restrict__ k_cache,
                                   bf16_t* __restrict__ v_cache, const int* __restrict__ pos,
                                   const int* __restrict__ slots,
                                   const float* __restrict__ inv_freq, int heads, int kv_heads,
                                   int head_dim, int rope_dims, int interleaved) {
    const long long t = blockIdx.x;
    const long long kv_dim = (long long)kv_heads * head_dim;
    bf16_t* row = qkv + t * ((long long)heads * head_dim + 2 * kv_dim);
    const bf16_t* k = row + (long long)heads * head_dim;
    const int slot = slots[t];
    bf16_t* k_dst = k_cache + (long long)max(slot, 0) * kv_dim;
    const int half = rope_dims / 2;
    // Each pair's angle is the same in every head: its cosine and sine once per token (half
    // <= 128: head_dim is at most 256).
    __shared__ float cos_sin[2 * 128];
    const float p = (float)pos[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        sincosf(p * inv_freq[i], &cos_sin[2 * i + 1], &cos_sin[2 * i]);
    }
    __syncthreads();
    const int work = (heads + kv_heads) * half;
    for (int w = threadIdx.x; w < work; w += blockDim.x) {
        const int h = w / half;
        const int i = w % half;
        bf16_t* x = row + (long long)h * head_dim;  // key heads follow the query heads
        const int a = interleaved ? 2 * i : i;
        const int b = interleaved ? 2 * i + 1 : i + half;
        const float c = cos_sin[2 * i];
        const float s = cos_sin[2 * i + 1];
        const float x0 = bf16_to_f32(x[a]);
        const float x1 = bf16_to_f32(x[b]);
        const bf16_t y0 = f32_to_bf16(x0 * c - x1 * s);
        const bf16_t y1 = f32_to_bf16(x0 * s + x1 * c);
        if (h < heads) {
            x[a] = y0;
            x[b] = y1;
        } else if (slot >= 0) {
            bf16_t* kh = k_dst + (long long)(h - heads) * head_dim;
            kh[a] = y0;
            kh[b] = y1;
        }
    }
    if (slot < 0) {
        return;
    }
    // The key dimensions past rope_dims as they are, and the values.
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        if (i % head_dim >= rope_dims) {
            k_dst[i] = k[i];
        }
        v_cache[(long long)slot * kv_dim + i] = k[kv_dim + i];
    }
}

// silu(g) * u, rounded to bf16.
__device__ __forceinline__ bf16_t silu_times(float g, float u) {
    return f32_to_bf16(g / (1.0f + __expf(-g)) * u);
}

// out[r, i] = silu(gate) * up for each row r of the fused gate/up projection, gate_up[r] =
// [gate: inter, up: inter]; n = rows * inter. Any grid (a grid-stride loop over chunks of 8
// outputs when inter % 8 == 0, else over outputs).
extern "C" __global__ void silu_mul(const bf16_t* __restrict__ gate_up, bf16_t* __restrict__ out,
                                    long long n, int inter) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if ((inter & 7) == 0) {
        const auto silu = [](unsigned g, unsigned u) {
            return pack_bf16(silu_times(lo_f32(g), lo_f32(u)), silu_times(hi_f32(g), hi_f32(u)));
        };
        const long long per_row = inter / 8;
        for (long long c = first; c < n / 8; c += stride) {
            const uint4* row = (const uint4*)(gate_up + (c / per_row) * 2 * inter) + c % per_row;
            ((uint4*)out)[c] = map_pairs(row[0], row[per_row], silu);
        }
        return;
    }
    for (long long i = first; i < n; i += stride) {
        const bf16_t* row = gate_up + (i / inter) * 2 * inter + (i % inter);
        out[i] = silu_times(bf16_to_f32(row[0]), bf16_to_f32(row[inter]));
    }
}

// x[t, :] += bias, for every row t (Q/K/V biases). Grid: one block per row.
extern "C" __global__ void add_bias(bf16_t* __restrict__ x, const bf16_t* __restrict__ bias,
                                    int dim) {
    const long long base = (long long)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        x[base + i] = f32_to_bf16(bf16_to_f32(x[base + i]) + bf16_to_f32(bias[i]));
    }
}

// out[i] = offset + scale * u(i), u uniform in [-1, 1) from a hash of (seed, i): random weights
// made on the device (benchmarks of model shapes too large to build on the host).
extern "C" __global__ void fill_random(bf16_t* __restrict__ out, long long n,
                                       unsigned long long seed, float scale, float offset) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        unsigned long long z = seed + (unsigned long long)i * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        const float u = (float)(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
        out[i] = f32_to_bf16(offset + scale * u);
    }
}
