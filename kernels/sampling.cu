// Token choice on the device.

// out[r] = the index of the largest logit of row r (the lowest index among equals, as on the
// CPU). Grid: one block per row; blockDim.x a multiple of 32, at most 1024.
extern "C" __global__ __launch_bounds__(1024) void argmax_rows(const float* __restrict__ logits, int* __restrict__ out,
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

#define SEARCH_PIVOTS 16  // thresholds tried per pass over a row
#define SEARCH_ROUNDS 10  // passes: the range narrows to 1 / 17^10 (< 2^-40) of itself

// The largest threshold a in [lo, hi] (to (hi - lo) / 17^SEARCH_ROUNDS) whose weight,
// weight(a) = the count (MASS = false) or the sum of exp((x - m) * inv_t) (MASS = true) of the
// row's values x >= a among those >= floor, reaches `need`; lo when none above it does. A
// search in SEARCH_PIVOTS + 1 parts per pass (a pass reads the row once for all its
// thresholds, where bisection reads it once per halving); sums in a fixed order, so the
// result is the same on every run. Every thread of the block calls it; `partial` holds
// 32 * SEARCH_PIVOTS floats of shared memory, `totals` SEARCH_PIVOTS.
template <bool MASS>
__device__ __forceinline__ float search_threshold(const float* __restrict__ row, int vocab,
                                                  float lo, float hi, float floor, float need,
                                                  float m, float inv_t, float* partial,
                                                  float* totals) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    float a = lo;
    float b = hi;
    for (int round = 0; round < SEARCH_ROUNDS; ++round) {
        // Thresholds a + step (j + 1), one explicit fma each (never contracted differently
        // here and where the result is chosen below).
        const float step = (b - a) / (float)(SEARCH_PIVOTS + 1);
        float w[SEARCH_PIVOTS];
#pragma unroll
        for (int j = 0; j < SEARCH_PIVOTS; ++j) {
            w[j] = 0.0f;
        }
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float x = row[i];
            if (x >= floor) {
                const float v = MASS ? __expf((x - m) * inv_t) : 1.0f;
#pragma unroll
                for (int j = 0; j < SEARCH_PIVOTS; ++j) {
                    w[j] += (x >= __fmaf_rn(step, (float)(j + 1), a)) ? v : 0.0f;
                }
            }
        }
        // The warp's sums of the 16 weights in 16 shuffles (a reduce-scatter: at each step a
        // lane keeps half of its values, adds its partner's copy of that half, and sends the
        // other half), ending with pivot lane / 2 in lanes lane and lane ^ 1.
        static_assert(SEARCH_PIVOTS == 16, "the reduce-scatter below halves 16 values to 1");
#pragma unroll
        for (int o = 16; o >= 2; o >>= 1) {
            const bool upper = (lane & o) != 0;
#pragma unroll
            for (int j = 0; j < o / 2; ++j) {
                const float send = upper ? w[j] : w[j + o / 2];
                const float keep = upper ? w[j + o / 2] : w[j];
                w[j] = keep + __shfl_xor_sync(0xffffffffu, send, o);
            }
        }
        w[0] += __shfl_xor_sync(0xffffffffu, w[0], 1);
        if ((lane & 1) == 0) {
            partial[warp * SEARCH_PIVOTS + (lane >> 1)] = w[0];
        }
        __syncthreads();
        if (threadIdx.x < SEARCH_PIVOTS) {
            float t = 0.0f;
            for (int v = 0; v < warps; ++v) {
                t += partial[v * SEARCH_PIVOTS + threadIdx.x];
            }
            totals[threadIdx.x] = t;
        }
        __syncthreads();
        // Weights fall as the thresholds rise: the last one still reaching the need.
        int last = -1;
        for (int j = 0; j < SEARCH_PIVOTS; ++j) {
            if (totals[j] >= need) {
                last = j;
            }
        }
        const float na = (last >= 0) ? __fmaf_rn(step, (float)(last + 1), a) : a;
        const float nb = (last + 1 < SEARCH_PIVOTS) ? __fmaf_rn(step, (float)(last + 2), a) : b;
        a = na;
        b = nb;
        __syncthreads();  // every thread has read `totals` before the next pass writes it
    }
    return a;
}

// Tokens kept by top-k and top-p, as a threshold on the logit: every token with
// logit >= threshold. The threshold comes from a search over the logits' range
// (search_threshold), counting (top-k) or summing exp((l - max) / T) (top-p): exact up to ties
// at the threshold, which are all kept.
//
// out[r] = a token drawn from softmax(logits[r] / temperature[r]) restricted to the top_k[r]
// largest logits (0 = all) and then to the smallest set of the largest whose probability,
// renormalized over the top-k set, reaches top_p[r] (1 = all), using uniform[r] in [0, 1) so a
// seeded host generator fixes the choice. Temperature 0 is argmax. Tokens are walked in index
// order for the draw. Grid: one block per row; blockDim.x a multiple of 32, at most 1024.
extern "C" __global__ __launch_bounds__(1024) void sample_rows(const float* __restrict__ logits,
                                       const float* __restrict__ temperature,
                                       const int* __restrict__ top_k,
                                       const float* __restrict__ top_p,
                                       const float* __restrict__ uniform, int* __restrict__ out,
                                       int vocab) {
    __shared__ float chunk_sums[1024];
    __shared__ float partial[32 * SEARCH_PIVOTS];
    __shared__ float totals[SEARCH_PIVOTS];
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
        threshold = search_threshold<false>(row, vocab, lo, m, lo, (float)k, m, inv_t, partial,
                                            totals);
    }
    // Top-p over what top-k kept: the largest threshold keeping mass >= p of it.
    if (p < 1.0f) {
        float kept = 0.0f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float x = row[i];
            kept += (x >= threshold) ? __expf((x - m) * inv_t) : 0.0f;
        }
        kept = block_sum(kept);
        threshold = search_threshold<true>(row, vocab, threshold, m, threshold, p * kept, m,
                                           inv_t, partial, totals);
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
