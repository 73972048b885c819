// Paged KV cache: writing new keys and values into their slots, and attention over the cache
// for any mix of prefill and decode rows in one launch.
//
// Cache layout: [slots, kv_heads, head_dim] bf16, slot = block * block_size + offset.
// Block tables: [seqs, max_blocks] int, the physical block of each logical block of a sequence.

// k_cache[slots[t]] = k[t], v_cache[slots[t]] = v[t]; slot < 0 skips the row (padding).
// Grid: one block per token.
extern "C" __global__ void kv_write(const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
                                    bf16_t* __restrict__ k_cache, bf16_t* __restrict__ v_cache,
                                    const int* __restrict__ slots, int kv_dim) {
    const long long t = blockIdx.x;
    const int slot = slots[t];
    if (slot < 0) {
        return;
    }
    const long long dst = (long long)slot * kv_dim;
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        k_cache[dst + i] = k[t * kv_dim + i];
        v_cache[dst + i] = v[t * kv_dim + i];
    }
}

#define ATTN_WARPS 4
#define ATTN_MAX_PER_LANE 8  // head_dim up to 256, a multiple of 32

// out[r, h] = softmax(q[r, h] . K^T * scale) V over the first ctx_len[r] keys of sequence
// q_seq[r], with query head h reading KV head h / (heads / kv_heads) (grouped-query attention).
// A prefill row at position p sees ctx_len = p + 1 (causal, its cached prefix included); a
// decode row sees the whole context. Scores are never materialized: each warp keeps an online
// softmax (running max, sum and weighted values) over its share of the keys, and the warps'
// states are merged at the end. Grid: (rows, heads); block: 32 * ATTN_WARPS threads.
extern "C" __global__ void paged_attention(const bf16_t* __restrict__ q,
                                           const bf16_t* __restrict__ k_cache,
                                           const bf16_t* __restrict__ v_cache,
                                           const int* __restrict__ block_tables,
                                           const int* __restrict__ q_seq,
                                           const int* __restrict__ ctx_len,
                                           bf16_t* __restrict__ out, int heads, int kv_heads,
                                           int head_dim, int block_size, int max_blocks,
                                           float scale) {
    __shared__ float warp_m[ATTN_WARPS];
    __shared__ float warp_l[ATTN_WARPS];
    __shared__ float warp_acc[ATTN_WARPS][32 * ATTN_MAX_PER_LANE];
    const int r = blockIdx.x;
    const int h = blockIdx.y;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int per_lane = head_dim / 32;
    const int kvh = h / (heads / kv_heads);
    const int kv_dim = kv_heads * head_dim;
    const int n = ctx_len[r];
    const int* table = block_tables + (long long)q_seq[r] * max_blocks;

    float qv[ATTN_MAX_PER_LANE];
    float acc[ATTN_MAX_PER_LANE];
    const bf16_t* qrow = q + ((long long)r * heads + h) * head_dim;
    for (int e = 0; e < ATTN_MAX_PER_LANE; ++e) {
        qv[e] = (e < per_lane) ? bf16_to_f32(qrow[lane + 32 * e]) * scale : 0.0f;
        acc[e] = 0.0f;
    }
    float m = -SLUICE_INF;
    float l = 0.0f;
    for (int j = warp; j < n; j += ATTN_WARPS) {
        const long long slot = (long long)table[j / block_size] * block_size + (j % block_size);
        const long long off = slot * kv_dim + (long long)kvh * head_dim;
        float s = 0.0f;
        for (int e = 0; e < per_lane; ++e) {
            s += qv[e] * bf16_to_f32(k_cache[off + lane + 32 * e]);
        }
        s = warp_sum(s);
        const float m_new = fmaxf(m, s);
        const float corr = __expf(m - m_new);
        const float p = __expf(s - m_new);
        l = l * corr + p;
        for (int e = 0; e < per_lane; ++e) {
            acc[e] = acc[e] * corr + p * bf16_to_f32(v_cache[off + lane + 32 * e]);
        }
        m = m_new;
    }
    if (lane == 0) {
        warp_m[warp] = m;
        warp_l[warp] = l;
    }
    for (int e = 0; e < per_lane; ++e) {
        warp_acc[warp][lane + 32 * e] = acc[e];
    }
    __syncthreads();
    if (warp == 0) {
        float m_all = -SLUICE_INF;
        for (int w = 0; w < ATTN_WARPS; ++w) {
            m_all = fmaxf(m_all, warp_m[w]);
        }
        float l_all = 0.0f;
        float o[ATTN_MAX_PER_LANE];
        for (int e = 0; e < ATTN_MAX_PER_LANE; ++e) {
            o[e] = 0.0f;
        }
        for (int w = 0; w < ATTN_WARPS; ++w) {
            // A warp that saw no key has m = -inf and contributes nothing.
            const float c = (warp_m[w] == -SLUICE_INF) ? 0.0f : __expf(warp_m[w] - m_all);
            l_all += warp_l[w] * c;
            for (int e = 0; e < per_lane; ++e) {
                o[e] += warp_acc[w][lane + 32 * e] * c;
            }
        }
        const float inv = (l_all > 0.0f) ? 1.0f / l_all : 0.0f;
        bf16_t* orow = out + ((long long)r * heads + h) * head_dim;
        for (int e = 0; e < per_lane; ++e) {
            orow[lane + 32 * e] = f32_to_bf16(o[e] * inv);
        }
    }
}
