// Row and element kernels of the forward pass: embedding gather, RMSNorm, RoPE, SiLU-and-multiply,
// residual add, Q/K/V bias and random fill.

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

// out = x / sqrt(mean(x^2) + eps) * w, per row. Grid: one block per row.
extern "C" __global__ void rmsnorm(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                   bf16_t* __restrict__ out, int dim, float eps) {
    const long long base = (long long)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = bf16_to_f32(x[base + i]);
        ss += v * v;
    }
    ss = block_sum(ss);
    const float scale = rsqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        out[base + i] = f32_to_bf16(bf16_to_f32(x[base + i]) * scale * bf16_to_f32(w[i]));
    }
}

// Rotary embedding in place on q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim]:
// the first rope_dims of each head rotate by pos[t] * inv_freq[i], in adjacent pairs
// (interleaved = 1, GGUF llama) or halves (interleaved = 0, NeoX style). Grid: one block per
// token; threads over (head, pair).
extern "C" __global__ void rope(bf16_t* __restrict__ q, bf16_t* __restrict__ k,
                                const int* __restrict__ pos, const float* __restrict__ inv_freq,
                                int heads, int kv_heads, int head_dim, int rope_dims,
                                int interleaved) {
    const long long t = blockIdx.x;
    const int half = rope_dims / 2;
    const float p = (float)pos[t];
    const int work = (heads + kv_heads) * half;
    for (int w = threadIdx.x; w < work; w += blockDim.x) {
        const int h = w / half;
        const int i = w % half;
        bf16_t* x = (h < heads) ? q + (t * heads + h) * head_dim
                                : k + (t * kv_heads + (h - heads)) * head_dim;
        const int a = interleaved ? 2 * i : i;
        const int b = interleaved ? 2 * i + 1 : i + half;
        float s, c;
        sincosf(p * inv_freq[i], &s, &c);
        const float x0 = bf16_to_f32(x[a]);
        const float x1 = bf16_to_f32(x[b]);
        x[a] = f32_to_bf16(x0 * c - x1 * s);
        x[b] = f32_to_bf16(x0 * s + x1 * c);
    }
}

// out = silu(gate) * up, elementwise over n.
extern "C" __global__ void silu_mul(const bf16_t* __restrict__ gate, const bf16_t* __restrict__ up,
                                    bf16_t* __restrict__ out, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float g = bf16_to_f32(gate[i]);
        out[i] = f32_to_bf16(g / (1.0f + __expf(-g)) * bf16_to_f32(up[i]));
    }
}

// x += y, elementwise over n (the residual stream).
extern "C" __global__ void add_inplace(bf16_t* __restrict__ x, const bf16_t* __restrict__ y,
                                       long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
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
