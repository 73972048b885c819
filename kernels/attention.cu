// Attention over the paged KV cache for any mix of prefill and decode rows in one launch (the
// new keys and values reach the cache through rope_kv in elementwise.cu).
//
// Cache layout: [slots, kv_heads, head_dim] bf16, slot = block * block_size + offset.
// Block tables: [seqs, max_blocks] int, the physical block of each logical block of a sequence.
// Queries: each row's fused projection [q: heads, k: kv_heads, v: kv_heads] x head_dim, the
// query heads read from its start (row stride (heads + 2 kv_heads) head_dim).

#define ATTN_WARPS 4
#define ATTN_GROUP 4          // query heads of one KV head per block (= ATTN_WARPS: one merges each)
#define ATTN_MAX_PER_LANE 8  // head_dim up to 256, a multiple of 32
#define SPLIT_MIN_KEYS 32    // the fewest keys a part of a split context gets
// The wide decode kernels (head sizes 64 and 128): rounds of keys whose loads are all issued
// before any is used, and whether each step asks for the next step's keys and values to be
// brought into L2 first (bytes on their way that hold no registers). The runner's choice
// (CudaRunner::set_attention_shape, for the device bench's comparison), these by default.
#ifndef ATTN_ROUNDS
#define ATTN_ROUNDS 2
#endif
#ifndef ATTN_PREFETCH
#define ATTN_PREFETCH 0
#endif

// Online-softmax states (max m, sum l, weighted values acc of head_dim = 32 * PL floats; a
// state that saw no key has m = -inf) merged into (m_all, l_all, o) for one head by one warp,
// lane holding o[e] = column lane + 32 e. States come through the accessors m_of(st), l_of(st)
// and acc_of(st, column).
template <int PL, class M, class L, class A>
__device__ __forceinline__ void merge_states(int states, M m_of, L l_of, A acc_of, float& m_all,
                                             float& l_all, float* o) {
    const int lane = threadIdx.x & 31;
    m_all = -SLUICE_INF;
    for (int st = 0; st < states; ++st) {
        m_all = fmaxf(m_all, m_of(st));
    }
    l_all = 0.0f;
#pragma unroll
    for (int e = 0; e < PL; ++e) {
        o[e] = 0.0f;
    }
    for (int st = 0; st < states; ++st) {
        // A state that saw no key contributes nothing.
        const float ms = m_of(st);
        const float c = (ms == -SLUICE_INF) ? 0.0f : __expf(ms - m_all);
        l_all += l_of(st) * c;
#pragma unroll
        for (int e = 0; e < PL; ++e) {
            o[e] += acc_of(st, lane + 32 * e) * c;
        }
    }
}

// o / l as bf16 into one head's output row (lane's columns lane + 32 e).
template <int PL>
__device__ __forceinline__ void write_head(float l, const float* o, bf16_t* __restrict__ orow) {
    const int lane = threadIdx.x & 31;
    const float inv = (l > 0.0f) ? 1.0f / l : 0.0f;
#pragma unroll
    for (int e = 0; e < PL; ++e) {
        orow[lane + 32 * e] = f32_to_bf16(o[e] * inv);
    }
}

// Where a block of paged_attention stands: its listed row r and context n, and its part z of
// the `used` parts the context is split into (split-K for few rows and long contexts: the
// parts' blocks run side by side, and the last to finish merges them).
struct AttnPart {
    int r;
    int n;
    int z;
    int used;
    int splits;
    float* part;   // [listed rows][heads][splits] states of head_dim + 2 floats (m, l, acc)
    int* counter;  // parts of this block's row and head group done (0 between launches)
};

// The end of a block of paged_attention, by every thread: `states` partial states per head of
// its group (ATTN_GROUP heads, h0.. h0 + nh - 1) in shared memory, warp g merges head g. When
// the row's context is one part, that is the output; else each block stores its heads' states
// in `part`, and the block that finishes its row's group last merges every part's states
// into the output and resets the counter.
template <int PL>
__device__ __forceinline__ void finish_heads(int states, int nh, int h0, int heads,
                                             const AttnPart& a, const float* warp_m,
                                             const float* warp_l, const float* warp_acc,
                                             bf16_t* __restrict__ out) {
    constexpr int HD = PL * 32;
    __shared__ int last;
    const int g = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    float m = -SLUICE_INF, l = 0.0f, o[PL];
    if (g < nh) {
        merge_states<PL>(
            states, [&](int st) { return warp_m[st * ATTN_GROUP + g]; },
            [&](int st) { return warp_l[st * ATTN_GROUP + g]; },
            [&](int st, int c) { return warp_acc[(st * ATTN_GROUP + g) * HD + c]; }, m, l, o);
    }
    bf16_t* orow = out + ((long long)a.r * heads + h0 + g) * HD;
    if (a.used == 1) {  // the same in every thread of the block
        if (g < nh) {
            write_head<PL>(l, o, orow);
        }
        return;
    }
    // This head's states, one per part: (m, l, acc[HD]).
    float* states_of = a.part + ((long long)blockIdx.x * heads + h0 + g) * a.splits * (HD + 2);
    if (g < nh) {
        float* mine = states_of + (long long)a.z * (HD + 2);
        if (lane == 0) {
            mine[0] = m;
            mine[1] = l;
        }
#pragma unroll
        for (int e = 0; e < PL; ++e) {
            mine[2 + lane + 32 * e] = o[e];
        }
    }
    __threadfence();  // the states are visible to every block before the count says so
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(a.counter, 1) == a.used - 1;
    }
    __syncthreads();
    if (!last) {
        return;
    }
    __threadfence();
    if (g < nh) {
        // Other blocks wrote these: read around this SM's L1.
        const volatile float* all = states_of;
        merge_states<PL>(
            a.used, [&](int z) { return all[(long long)z * (HD + 2)]; },
            [&](int z) { return all[(long long)z * (HD + 2) + 1]; },
            [&](int z, int c) { return all[(long long)z * (HD + 2) + 2 + c]; }, m, l, o);
        write_head<PL>(l, o, orow);
    }
    if (threadIdx.x == 0) {
        *a.counter = 0;
    }
}

// The rows of paged_attention for one KV head and up to ATTN_GROUP of its query heads, keys
// k0.. k1 - 1 of the row's context, with head_dim = 32 * PL known at compile time (everything
// stays in registers). Each warp walks its share of the keys, reads each key and value row
// once for all the heads of the group, and keeps an online softmax (running max, sum and
// weighted values) per head; the warps' states meet in shared memory (finish_heads).
template <int PL>
__device__ __forceinline__ void attend_group(const bf16_t* __restrict__ q,
                                             const bf16_t* __restrict__ k_cache,
                                             const bf16_t* __restrict__ v_cache,
                                             const int* __restrict__ table, const AttnPart& a,
                                             int k0, int k1, int kvh, int h0, int nh,
                                             bf16_t* __restrict__ out, int heads, int kv_heads,
                                             int block_size, float scale, float* warp_m,
                                             float* warp_l, float* warp_acc) {
    constexpr int HD = PL * 32;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const long long kv_dim = (long long)kv_heads * HD;
    float qv[ATTN_GROUP][PL];
    float acc[ATTN_GROUP][PL];
    float m[ATTN_GROUP];
    float l[ATTN_GROUP];
#pragma unroll
    for (int g = 0; g < ATTN_GROUP; ++g) {
        const bf16_t* qrow =
            q + (long long)a.r * (heads + 2 * kv_heads) * HD + (h0 + (g < nh ? g : 0)) * HD;
#pragma unroll
        for (int e = 0; e < PL; ++e) {
            qv[g][e] = (g < nh) ? bf16_to_f32(qrow[lane + 32 * e]) * scale : 0.0f;
            acc[g][e] = 0.0f;
        }
        m[g] = -SLUICE_INF;
        l[g] = 0.0f;
    }
    for (int j = k0 + warp; j < k1; j += ATTN_WARPS) {
        const long long slot = (long long)table[j / block_size] * block_size + (j % block_size);
        const long long off = slot * kv_dim + (long long)kvh * HD;
        float kf[PL];
        float vf[PL];
#pragma unroll
        for (int e = 0; e < PL; ++e) {
            kf[e] = bf16_to_f32(k_cache[off + lane + 32 * e]);
            vf[e] = bf16_to_f32(v_cache[off + lane + 32 * e]);
        }
#pragma unroll
        for (int g = 0; g < ATTN_GROUP; ++g) {
            if (g < nh) {  // the same in every lane
                float s = 0.0f;
#pragma unroll
                for (int e = 0; e < PL; ++e) {
                    s += qv[g][e] * kf[e];
                }
                s = warp_sum(s);
                const float m_new = fmaxf(m[g], s);
                const float corr = __expf(m[g] - m_new);
                const float p = __expf(s - m_new);
                l[g] = l[g] * corr + p;
#pragma unroll
                for (int e = 0; e < PL; ++e) {
                    acc[g][e] = acc[g][e] * corr + p * vf[e];
                }
                m[g] = m_new;
            }
        }
    }
#pragma unroll
    for (int g = 0; g < ATTN_GROUP; ++g) {
        if (lane == 0) {
            warp_m[warp * ATTN_GROUP + g] = m[g];
            warp_l[warp * ATTN_GROUP + g] = l[g];
        }
#pragma unroll
        for (int e = 0; e < PL; ++e) {
            warp_acc[(warp * ATTN_GROUP + g) * HD + lane + 32 * e] = acc[g][e];
        }
    }
    __syncthreads();
    finish_heads<PL>(ATTN_WARPS, nh, h0, heads, a, warp_m, warp_l, warp_acc, out);
}

// attend_group for head_dim HD = 64 or 128 with 16-byte loads: a key's row is HD / 8 lanes
// wide (8 bf16 each), so a warp reads 32 / (HD / 8) keys at once, every lane a 16-byte piece
// of one. Each lane group keeps its own online softmax per head; the groups' states meet in
// shared memory (ATTN_WARPS * keys-per-warp of them).
template <int HD>
__device__ __forceinline__ void attend_group_wide(const bf16_t* __restrict__ q,
                                                  const bf16_t* __restrict__ k_cache,
                                                  const bf16_t* __restrict__ v_cache,
                                                  const int* __restrict__ table, const AttnPart& a,
                                                  int k0, int k1, int kvh, int h0, int nh,
                                                  bf16_t* __restrict__ out, int heads,
                                                  int kv_heads, int block_size, float scale,
                                                  float* warp_m, float* warp_l, float* warp_acc) {
    constexpr int LPK = HD / 8;      // lanes per key
    constexpr int KPW = 32 / LPK;    // keys per warp and step
    constexpr int STATES = ATTN_WARPS * KPW;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int sub = lane / LPK;
    const int part = lane % LPK;
    const int state = warp * KPW + sub;
    const long long kv_dim = (long long)kv_heads * HD;
    float qv[ATTN_GROUP][8];
    float acc[ATTN_GROUP][8];
    float m[ATTN_GROUP];
    float l[ATTN_GROUP];
#pragma unroll
    for (int g = 0; g < ATTN_GROUP; ++g) {
        const bf16_t* qrow = q + (long long)a.r * (heads + 2 * kv_heads) * HD +
                             (h0 + (g < nh ? g : 0)) * HD + part * 8;
        unpack8(*(const uint4*)qrow, qv[g]);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            qv[g][e] = (g < nh) ? qv[g][e] * scale : 0.0f;
            acc[g][e] = 0.0f;
        }
        m[g] = -SLUICE_INF;
        l[g] = 0.0f;
    }
    // Every lane runs every step (the shuffles need the whole warp); a lane past the range
    // reads nothing and changes nothing. A step takes ROUNDS rounds of keys, their loads all
    // issued before any is used (more bytes in flight per warp: decode attention waits on
    // memory, not arithmetic), then used in key order. With ATTN_PREFETCH, a step first asks
    // for the next step's rows to be brought into L2 (one lane of each 128-byte line).
    constexpr int ROUNDS = ATTN_ROUNDS;
    constexpr int ROUND = ATTN_WARPS * KPW;  // keys per round, the block's warps together
    // Where this lane's 16 bytes of key j's row (and of its value row) start in the cache.
    const auto piece = [&](int j) {
        const long long slot = (long long)table[j / block_size] * block_size + (j % block_size);
        return slot * kv_dim + (long long)kvh * HD + part * 8;
    };
    for (int base = k0 + warp * KPW; base < k1; base += ROUND * ROUNDS) {
        if (ATTN_PREFETCH && (part & 7) == 0) {
#pragma unroll
            for (int u = 0; u < ROUNDS; ++u) {
                const int j = base + (ROUNDS + u) * ROUND + sub;
                if (j < k1) {
                    const long long off = piece(j);
                    prefetch_l2(k_cache + off);
                    prefetch_l2(v_cache + off);
                }
            }
        }
        uint4 kw[ROUNDS];
        uint4 vw[ROUNDS];
#pragma unroll
        for (int u = 0; u < ROUNDS; ++u) {
            const int j = base + u * ROUND + sub;
            kw[u] = vw[u] = make_uint4(0u, 0u, 0u, 0u);
            if (j < k1) {
                const long long off = piece(j);
                kw[u] = *(const uint4*)(k_cache + off);
                vw[u] = *(const uint4*)(v_cache + off);
            }
        }
#pragma unroll
        for (int u = 0; u < ROUNDS; ++u) {
            const bool live = base + u * ROUND + sub < k1;
            float kf[8];
            float vf[8];
            unpack8(kw[u], kf);
            unpack8(vw[u], vf);
#pragma unroll
            for (int g = 0; g < ATTN_GROUP; ++g) {
                if (g < nh) {  // the same in every lane
                    float s = 0.0f;
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        s += qv[g][e] * kf[e];
                    }
                    // The key's dot product over its LPK lanes (offsets below LPK stay in the
                    // group).
#pragma unroll
                    for (int o = LPK / 2; o > 0; o >>= 1) {
                        s += __shfl_xor_sync(0xffffffffu, s, o);
                    }
                    if (live) {
                        const float m_new = fmaxf(m[g], s);
                        const float corr = __expf(m[g] - m_new);
                        const float p = __expf(s - m_new);
                        l[g] = l[g] * corr + p;
#pragma unroll
                        for (int e = 0; e < 8; ++e) {
                            acc[g][e] = acc[g][e] * corr + p * vf[e];
                        }
                        m[g] = m_new;
                    }
                }
            }
        }
    }
#pragma unroll
    for (int g = 0; g < ATTN_GROUP; ++g) {
        if (part == 0) {
            warp_m[state * ATTN_GROUP + g] = m[g];
            warp_l[state * ATTN_GROUP + g] = l[g];
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            warp_acc[(state * ATTN_GROUP + g) * HD + part * 8 + e] = acc[g][e];
        }
    }
    __syncthreads();
    finish_heads<HD / 32>(STATES, nh, h0, heads, a, warp_m, warp_l, warp_acc, out);
}

// The setup of paged_attention for the block's row, KV head (or ATTN_GROUP of its query
// heads) and part of the context; PL = head_dim / 32 when the kernel is built for one head
// size, 0 to choose at run time (registers then sized for the largest).
template <int PL>
__device__ __forceinline__ void paged_attention_block(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache,
    const bf16_t* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ q_seq, const int* __restrict__ ctx_len,
    const int* __restrict__ row_ids, bf16_t* __restrict__ out, int heads, int kv_heads,
    int head_dim, int block_size, int max_blocks, float scale, int splits,
    float* __restrict__ part, int* __restrict__ counters) {
    // Partial states per head: ATTN_WARPS (attend_group) or ATTN_WARPS * keys per warp
    // (attend_group_wide), head_dim floats each.
    constexpr int STATES = (PL == 2) ? ATTN_WARPS * 4 : (PL == 4) ? ATTN_WARPS * 2 : ATTN_WARPS;
    __shared__ float warp_m[STATES * ATTN_GROUP];
    __shared__ float warp_l[STATES * ATTN_GROUP];
    __shared__ float warp_acc[STATES * ATTN_GROUP * 32 * (PL > 0 ? PL : ATTN_MAX_PER_LANE)];
    // The output projection after this kernel may start its blocks (and its weight loads)
    // once every block here has (programmatic dependent launch; it waits for the results).
    pdl_launch_dependents();
    AttnPart a;
    a.r = row_ids[blockIdx.x];
    a.n = ctx_len[a.r];
    a.z = blockIdx.z;
    a.splits = splits;
    // Parts of at least SPLIT_MIN_KEYS keys, at most `splits`; blocks past them have nothing.
    a.used = max(1, min(splits, (a.n + SPLIT_MIN_KEYS - 1) / SPLIT_MIN_KEYS));
    if (a.z >= a.used) {
        return;
    }
    a.part = part;
    a.counter = counters + (long long)blockIdx.x * gridDim.y + blockIdx.y;
    const int per = (a.n + a.used - 1) / a.used;
    const int k0 = min(a.n, a.z * per);
    const int k1 = min(a.n, k0 + per);
    const int group = heads / kv_heads;
    const int chunks = (group + ATTN_GROUP - 1) / ATTN_GROUP;
    const int kvh = blockIdx.y / chunks;
    const int first = (blockIdx.y % chunks) * ATTN_GROUP;
    const int h0 = kvh * group + first;
    const int nh = min(ATTN_GROUP, group - first);
    const int* table = block_tables + (long long)q_seq[a.r] * max_blocks;
#define ATTEND(P)                                                                               \
    attend_group<P>(q, k_cache, v_cache, table, a, k0, k1, kvh, h0, nh, out, heads, kv_heads,   \
                    block_size, scale, warp_m, warp_l, warp_acc)
    if constexpr (PL == 2 || PL == 4) {
        attend_group_wide<PL * 32>(q, k_cache, v_cache, table, a, k0, k1, kvh, h0, nh, out, heads,
                                   kv_heads, block_size, scale, warp_m, warp_l, warp_acc);
    } else if constexpr (PL > 0) {
        ATTEND(PL);
    } else {
        switch (head_dim / 32) {
            case 1: ATTEND(1); break;
            case 2: ATTEND(2); break;
            case 3: ATTEND(3); break;
            case 4: ATTEND(4); break;
            case 5: ATTEND(5); break;
            case 6: ATTEND(6); break;
            case 7: ATTEND(7); break;
            default: ATTEND(8); break;
        }
    }
#undef ATTEND
}

// out[r, h] = softmax(q[r, h] . K^T * scale) V over the first ctx_len[r] keys of sequence
// q_seq[r], with query head h reading KV head h / (heads / kv_heads) (grouped-query attention).
// A prefill row at position p sees ctx_len = p + 1 (causal, its cached prefix included); a
// decode row sees the whole context. Scores are never materialized. Runs the rows listed in
// row_ids (decode rows; prefill rows go through prefill_attention where the head size has
// one). head_dim: a multiple of 32 up to 256 (paged_attention_64/128: that size only, fewer
// registers).
// Split-K: a row's context is cut into min(splits, ceil(ctx / SPLIT_MIN_KEYS)) parts, one
// block each (blockIdx.z); with more than one, `part` holds [listed rows][heads][splits]
// states of head_dim + 2 floats and `counters` one int per (listed row, blockIdx.y), zero
// before the launch and after it. splits = 1 reads neither.
// Grid: (listed rows, kv_heads * ceil((heads / kv_heads) / ATTN_GROUP), splits); block:
// 32 * ATTN_WARPS threads.
extern "C" __global__ void paged_attention(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache,
    const bf16_t* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ q_seq, const int* __restrict__ ctx_len,
    const int* __restrict__ row_ids, bf16_t* __restrict__ out, int heads, int kv_heads,
    int head_dim, int block_size, int max_blocks, float scale, int splits,
    float* __restrict__ part, int* __restrict__ counters) {
    paged_attention_block<0>(q, k_cache, v_cache, block_tables, q_seq, ctx_len, row_ids, out,
                             heads, kv_heads, head_dim, block_size, max_blocks, scale, splits,
                             part, counters);
}

extern "C" __global__ void paged_attention_64(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache,
    const bf16_t* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ q_seq, const int* __restrict__ ctx_len,
    const int* __restrict__ row_ids, bf16_t* __restrict__ out, int heads, int kv_heads,
    int head_dim, int block_size, int max_blocks, float scale, int splits,
    float* __restrict__ part, int* __restrict__ counters) {
    paged_attention_block<2>(q, k_cache, v_cache, block_tables, q_seq, ctx_len, row_ids, out,
                             heads, kv_heads, head_dim, block_size, max_blocks, scale, splits,
                             part, counters);
}

extern "C" __global__ void paged_attention_128(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache,
    const bf16_t* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ q_seq, const int* __restrict__ ctx_len,
    const int* __restrict__ row_ids, bf16_t* __restrict__ out, int heads, int kv_heads,
    int head_dim, int block_size, int max_blocks, float scale, int splits,
    float* __restrict__ part, int* __restrict__ counters) {
    paged_attention_block<4>(q, k_cache, v_cache, block_tables, q_seq, ctx_len, row_ids, out,
                             heads, kv_heads, head_dim, block_size, max_blocks, scale, splits,
                             part, counters);
}

#define FA_WARPS 4
#define FA_ROWS (16 * FA_WARPS)
#define FA_KEYS 32

// Causal attention of the prefill rows of a batch over the paged cache (a chunk after a cached
// prefix included), FlashAttention-2 style on the tensor cores: a block takes up to FA_ROWS
// consecutive rows of one sequence (a tile) and one query head; each warp keeps 16 rows' Q in
// registers and walks the keys FA_KEYS at a time. K and V of the tile's KV head come from the
// cache once per tile (not once per row) into shared memory by asynchronous copies, two steps
// of keys in flight: the next step's copies are queued before this step's products. S = Q K^T
// and O += P V use mma.m16n8k16 (bf16 in, f32 out), their K and V operands loaded with
// ldmatrix (V transposed); keys at or past each row's ctx_len are masked (causal) in the steps
// that reach them; an online softmax per row in base 2 (the score scale and log2(e) in one
// multiply); P is rounded to bf16 for P V. The score matrix never leaves registers.
// tiles[2t] = first row of tile t, tiles[2t + 1] = its row count (1..FA_ROWS); a tile's rows
// are one sequence's, at consecutive positions, so its last row sees the most keys.
// Grid: (tiles, heads); block: 32 * FA_WARPS threads. HD = head_dim.
template <int HD>
__device__ __forceinline__ void prefill_attention_tile(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache,
    const bf16_t* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ q_seq, const int* __restrict__ ctx_len, const int* __restrict__ tiles,
    bf16_t* __restrict__ out, int heads, int kv_heads, int block_size, int max_blocks,
    float scale) {
    // Shared rows padded by 8 bf16: 16-byte aligned, and the 8 rows an ldmatrix reads at once
    // fall in different banks.
    constexpr int STRIDE = HD + 8;
    constexpr int CHUNKS = HD / 8;  // 16-byte pieces of a key row
    constexpr int STAGE = FA_KEYS * STRIDE;
    __shared__ __align__(16) bf16_t ks[2 * STAGE];
    __shared__ __align__(16) bf16_t vs[2 * STAGE];
    const int h = blockIdx.y;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int qd = lane & 3;
    const int first = tiles[2 * blockIdx.x];
    const int count = tiles[2 * blockIdx.x + 1];
    const int kvh = h / (heads / kv_heads);
    const long long kv_dim = (long long)kv_heads * HD;
    const int* table = block_tables + (long long)q_seq[first] * max_blocks;
    const int n_keys = ctx_len[first + count - 1];
    // This lane's rows: g and g + 8 of the warp's 16 (none past the tile).
    const int r0 = warp * 16 + g;
    const int r1 = r0 + 8;
    const bool has0 = r0 < count;
    const bool has1 = r1 < count;
    const int ctx0 = has0 ? ctx_len[first + r0] : 0;
    const int ctx1 = has1 ? ctx_len[first + r1] : 0;
    // The most and the fewest keys a row of this warp sees (the same in every lane; a row
    // past the tile sees none).
    const int warp_last = min(count, warp * 16 + 16) - 1;
    const int warp_ctx = (warp * 16 < count) ? ctx_len[first + warp_last] : 0;
    const int warp_min_ctx = (warp * 16 + 16 <= count) ? ctx_len[first + warp * 16] : 0;
    // Scores in base 2: exp(x * scale) = 2^(x * scale * log2(e)).
    const float scale2 = scale * 1.4426950408889634f;

    unsigned qa[HD / 16][4];
    {
        const long long q_stride = (long long)(heads + 2 * kv_heads) * HD;
        const bf16_t* q0 = q + (first + (has0 ? r0 : 0)) * q_stride + h * HD;
        const bf16_t* q1 = q + (first + (has1 ? r1 : 0)) * q_stride + h * HD;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            const int c = kk * 16 + 2 * qd;
            qa[kk][0] = has0 ? *(const unsigned*)(q0 + c) : 0u;
            qa[kk][1] = has1 ? *(const unsigned*)(q1 + c) : 0u;
            qa[kk][2] = has0 ? *(const unsigned*)(q0 + c + 8) : 0u;
            qa[kk][3] = has1 ? *(const unsigned*)(q1 + c + 8) : 0u;
        }
    }
    float o[HD / 8][4];
#pragma unroll
    for (int d = 0; d < HD / 8; ++d) {
        o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
    }
    float m0 = -SLUICE_INF, m1 = -SLUICE_INF, l0 = 0.0f, l1 = 0.0f;

    // Queues the copies of keys base.. base + FA_KEYS - 1 into stage `st` as one group; keys
    // past the context are zeros (never the cache's stale bits: 0 * NaN is NaN), stored
    // directly.
    auto load = [&](int base, int st) {
        for (int c = threadIdx.x; c < FA_KEYS * CHUNKS; c += blockDim.x) {
            const int jj = c / CHUNKS;
            const int part = c % CHUNKS;
            const int j = base + jj;
            bf16_t* kd = ks + st * STAGE + jj * STRIDE + part * 8;
            bf16_t* vd = vs + st * STAGE + jj * STRIDE + part * 8;
            if (j < n_keys) {
                const long long slot =
                    (long long)table[j / block_size] * block_size + (j % block_size);
                const long long off = slot * kv_dim + (long long)kvh * HD + part * 8;
                cp_async_16(kd, k_cache + off);
                cp_async_16(vd, v_cache + off);
            } else {
                *(uint4*)kd = make_uint4(0u, 0u, 0u, 0u);
                *(uint4*)vd = make_uint4(0u, 0u, 0u, 0u);
            }
        }
        cp_async_commit();
    };

    const int steps = (n_keys + FA_KEYS - 1) / FA_KEYS;
    load(0, 0);
    for (int step = 0; step < steps; ++step) {
        const int base = step * FA_KEYS;
        const int st = step & 1;
        // The next step's keys go into the other stage (free: every warp passed the barrier
        // at the end of the step that used it) while this step's arrive.
        if (step + 1 < steps) {
            load(base + FA_KEYS, st ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // this step's keys, copied by every thread, are in place
        if (base < warp_ctx) {  // else every key of this step is masked for all of its rows
            const bf16_t* kst = ks + st * STAGE;
            const bf16_t* vst = vs + st * STAGE;
            // S = Q K^T for 16 rows x FA_KEYS keys: FA_KEYS / 8 tiles of 16x8. One ldmatrix
            // gives the B fragments of 8 keys for 32 dimensions (two mma steps): lane l
            // addresses key l % 8, dimensions 8 (l / 8).. of them.
            float s[FA_KEYS / 8][4];
#pragma unroll
            for (int nt = 0; nt < FA_KEYS / 8; ++nt) {
                s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
            }
#pragma unroll
            for (int k2 = 0; k2 < HD / 32; ++k2) {
#pragma unroll
                for (int nt = 0; nt < FA_KEYS / 8; ++nt) {
                    unsigned b[4];
                    ldmatrix_x4(b, kst + (nt * 8 + (lane & 7)) * STRIDE + k2 * 32 + (lane >> 3) * 8);
                    mma_bf16_16816(s[nt], qa[2 * k2], b);
                    mma_bf16_16816(s[nt], qa[2 * k2 + 1], b + 2);
                }
            }
            // Mask (only in the steps that reach some row's context end); the row maxima over
            // the quad of lanes holding a row.
            if (base + FA_KEYS > warp_min_ctx) {
#pragma unroll
                for (int nt = 0; nt < FA_KEYS / 8; ++nt) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int j = base + nt * 8 + 2 * qd + e;
                        s[nt][e] = (j < ctx0) ? s[nt][e] : -SLUICE_INF;
                        s[nt][2 + e] = (j < ctx1) ? s[nt][2 + e] : -SLUICE_INF;
                    }
                }
            }
            float mx0 = -SLUICE_INF, mx1 = -SLUICE_INF;
#pragma unroll
            for (int nt = 0; nt < FA_KEYS / 8; ++nt) {
                mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
                mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            const float n0 = fmaxf(m0, mx0);
            const float n1 = fmaxf(m1, mx1);
            // A row that has seen no key keeps m = -inf: its offset is 0, every weight 2^-inf
            // = 0, and its output stays 0.
            const float b0 = (n0 == -SLUICE_INF) ? 0.0f : n0 * scale2;
            const float b1 = (n1 == -SLUICE_INF) ? 0.0f : n1 * scale2;
            const float c0 = exp2_approx(m0 * scale2 - b0);
            const float c1 = exp2_approx(m1 * scale2 - b1);
            m0 = n0;
            m1 = n1;
            l0 *= c0;
            l1 *= c1;
            // P as the A operand of P V: the accumulator layout of S is the A layout of P.
            unsigned pa[FA_KEYS / 16][4];
#pragma unroll
            for (int nt = 0; nt < FA_KEYS / 8; ++nt) {
                const float p0 = exp2_approx(s[nt][0] * scale2 - b0);
                const float p1 = exp2_approx(s[nt][1] * scale2 - b0);
                const float p2 = exp2_approx(s[nt][2] * scale2 - b1);
                const float p3 = exp2_approx(s[nt][3] * scale2 - b1);
                l0 += p0 + p1;
                l1 += p2 + p3;
                pa[nt >> 1][2 * (nt & 1)] = pack_bf16(f32_to_bf16(p0), f32_to_bf16(p1));
                pa[nt >> 1][2 * (nt & 1) + 1] = pack_bf16(f32_to_bf16(p2), f32_to_bf16(p3));
            }
#pragma unroll
            for (int d = 0; d < HD / 8; ++d) {
                o[d][0] *= c0;
                o[d][1] *= c0;
                o[d][2] *= c1;
                o[d][3] *= c1;
            }
            // O += P V: one transposed ldmatrix gives the B fragments of 16 keys for two
            // 8-wide column blocks of V: lane l addresses key 8 ((l / 8) % 2) + l % 8 of the 16,
            // columns 8 (l / 16).. of the pair.
#pragma unroll
            for (int kk = 0; kk < FA_KEYS / 16; ++kk) {
                const bf16_t* v0 =
                    vst + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * STRIDE + (lane >> 4) * 8;
#pragma unroll
                for (int dp = 0; dp < HD / 16; ++dp) {
                    unsigned b[4];
                    ldmatrix_x4_trans(b, v0 + dp * 16);
                    mma_bf16_16816(o[2 * dp], pa[kk], b);
                    mma_bf16_16816(o[2 * dp + 1], pa[kk], b + 2);
                }
            }
        }
        __syncthreads();  // every warp is done with this stage before it is refilled
    }
    // Each lane summed its own columns: the row's sum is over the quad.
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = (l0 > 0.0f) ? 1.0f / l0 : 0.0f;
    const float inv1 = (l1 > 0.0f) ? 1.0f / l1 : 0.0f;
    // Each lane's two adjacent columns in one 32-bit store.
    if (has0) {
        bf16_t* orow = out + ((long long)(first + r0) * heads + h) * HD + 2 * qd;
#pragma unroll
        for (int d = 0; d < HD / 8; ++d) {
            *(unsigned*)(orow + d * 8) =
                pack_bf16(f32_to_bf16(o[d][0] * inv0), f32_to_bf16(o[d][1] * inv0));
        }
    }
    if (has1) {
        bf16_t* orow = out + ((long long)(first + r1) * heads + h) * HD + 2 * qd;
#pragma unroll
        for (int d = 0; d < HD / 8; ++d) {
            *(unsigned*)(orow + d * 8) =
                pack_bf16(f32_to_bf16(o[d][2] * inv1), f32_to_bf16(o[d][3] * inv1));
        }
    }
}

// The head sizes with a tensor-core prefill (SmolLM2: 64; Llama 3 8B: 128); others run every
// row through paged_attention.
extern "C" __global__ void prefill_attention_64(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache,
    const bf16_t* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ q_seq, const int* __restrict__ ctx_len, const int* __restrict__ tiles,
    bf16_t* __restrict__ out, int heads, int kv_heads, int block_size, int max_blocks,
    float scale) {
    prefill_attention_tile<64>(q, k_cache, v_cache, block_tables, q_seq, ctx_len, tiles, out,
                               heads, kv_heads, block_size, max_blocks, scale);
}

extern "C" __global__ void prefill_attention_128(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_cache,
    const bf16_t* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ q_seq, const int* __restrict__ ctx_len, const int* __restrict__ tiles,
    bf16_t* __restrict__ out, int heads, int kv_heads, int block_size, int max_blocks,
    float scale) {
    prefill_attention_tile<128>(q, k_cache, v_cache, block_tables, q_seq, ctx_len, tiles, out,
                                heads, kv_heads, block_size, max_blocks, scale);
}
