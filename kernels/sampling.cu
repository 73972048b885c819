// Token choice on the device.

// out[r] = the index of the largest logit of row r (the lowest index among equals, as on the
// CPU). Grid: one block per row; blockDim.x a multiple of 32, at most 1024.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int* __restrict__ out,
                                       int vocab) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    const float* row = logits + (long long)blockIdx.x * vocab;
    float v = -SLUICE_INF;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float x = row[i];
        if (x > v || (x == v && i < idx)) {
            v = x;
            idx = i;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > v || (ov == v && oi < idx)) {
            v = ov;
            idx = oi;
        }
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) {
        best_v[warp] = v;
        best_i[warp] = idx;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const int warps = (blockDim.x + 31) >> 5;
        for (int w = 1; w < warps; ++w) {
            if (best_v[w] > v || (best_v[w] == v && best_i[w] < idx)) {
                v = best_v[w];
                idx = best_i[w];
            }
        }
        out[blockIdx.x] = (idx == 0x7fffffff) ? 0 : idx;
    }
}

// Tokens kept by top-k and top-p, as a threshold on the logit: every token with
// logit >= threshold. The threshold comes from bisection over the logits' range (40 steps),
// counting (top-k) or summing exp((l - max) / T) (top-p) in each step: exact up to ties at the
// threshold, which are all kept.
//
// out[r] = a token drawn from softmax(logits[r] / temperature[r]) restricted to the top_k[r]
// largest logits (0 = all) and then to the smallest set of the largest whose probability,
// renormalized over the top-k set, reaches top_p[r] (1 = all), using uniform[r] in [0, 1) so a
// seeded host generator fixes the choice. Temperature 0 is argmax. Tokens are walked in index
// order for the draw. Grid: one block per row; blockDim.x a multiple of 32, at most 1024.
extern "C" __global__ void sample_rows(const float* __restrict__ logits,
                                       const float* __restrict__ temperature,
                                       const int* __restrict__ top_k,
                                       const float* __restrict__ top_p,
                                       const float* __restrict__ uniform, int* __restrict__ out,
                                       int vocab) {
    __shared__ float chunk_sums[1024];
    __shared__ int chosen;
    const float* row = logits + (long long)blockIdx.x * vocab;
    const float t = temperature[blockIdx.x];
    const int k = top_k[blockIdx.x];
    const float p = top_p[blockIdx.x];
    float hi = -SLUICE_INF;
    float lo = SLUICE_INF;
    int best = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float x = row[i];
        if (x > hi || (x == hi && i < best)) {
            hi = x;
            best = i;
        }
        lo = fminf(lo, x);
    }
    const float m = block_max(hi);
    lo = -block_max(-lo);
    if (!(t > 0.0f)) {
        // Greedy: the lowest index holding the maximum.
        if (threadIdx.x == 0) {
            chosen = 0x7fffffff;
        }
        __syncthreads();
        if (hi == m) {
            atomicMin(&chosen, best);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            out[blockIdx.x] = chosen;
        }
        return;
    }
    const float inv_t = 1.0f / t;
    // Top-k: the largest threshold keeping at least k tokens.
    float threshold = lo;
    if (k > 0 && k < vocab) {
        float a = lo;
        float b = m;
        for (int step = 0; step < 40; ++step) {
            const float mid = 0.5f * (a + b);
            float n = 0.0f;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                n += (row[i] >= mid) ? 1.0f : 0.0f;
            }
            n = block_sum(n);
            if (n >= (float)k) {
                a = mid;
            } else {
                b = mid;
            }
        }
        threshold = a;
    }
    // Top-p over what top-k kept: the largest threshold keeping mass >= p of it.
    if (p < 1.0f) {
        float kept = 0.0f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float x = row[i];
            kept += (x >= threshold) ? __expf((x - m) * inv_t) : 0.0f;
        }
        kept = block_sum(kept);
        float a = threshold;
        float b = m;
        for (int step = 0; step < 40; ++step) {
            const float mid = 0.5f * (a + b);
            float mass = 0.0f;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                const float x = row[i];
                mass += (x >= mid) ? __expf((x - m) * inv_t) : 0.0f;
            }
            mass = block_sum(mass);
            if (mass >= p * kept) {
                a = mid;
            } else {
                b = mid;
            }
        }
        threshold = a;
    }
    // The draw: each thread owns a contiguous chunk of the vocabulary, in index order.
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    const int begin = threadIdx.x * chunk;
    const int end = min(vocab, begin + chunk);
    float mine = 0.0f;
    for (int i = begin; i < end; ++i) {
        const float x = row[i];
        mine += (x >= threshold) ? __expf((x - m) * inv_t) : 0.0f;
    }
    chunk_sums[threadIdx.x] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
        // Exclusive prefix sums of the chunks, in place; the total is broadcast in `chosen`.
        float total = 0.0f;
        for (int j = 0; j < (int)blockDim.x; ++j) {
            const float s = chunk_sums[j];
            chunk_sums[j] = total;
            total += s;
        }
        out[blockIdx.x] = -1;
        chosen = __float_as_int(total);
    }
    __syncthreads();
    const float total = __int_as_float(chosen);
    const float target = uniform[blockIdx.x] * total;
    const float before = chunk_sums[threadIdx.x];
    __syncthreads();
    if (target >= before && target < before + mine) {
        float acc = before;
        int pick = -1;
        for (int i = begin; i < end; ++i) {
            const float x = row[i];
            if (x >= threshold) {
                pick = i;
                acc += __expf((x - m) * inv_t);
                if (target < acc) {
                    break;
                }
            }
        }
        out[blockIdx.x] = pick;
    }
    __syncthreads();
    // Rounding can leave the target past the last kept token: take the last one.
    if (threadIdx.x == 0 && out[blockIdx.x] < 0) {
        int pick = best;
        for (int i = vocab - 1; i >= 0; --i) {
            if (row[i] >= threshold) {
                pick = i;
                break;
            }
        }
        out[blockIdx.x] = pick;
    }
}
