// Tenant LoRA updates of a batch's rows, as S-LoRA and Punica split them: the base GEMM runs
// once for every row of the batch, then each row takes its own adapter's low-rank update in
// two launches over the whole batch, whatever mix of adapters (and bare-base rows) it holds:
//   lora_shrink   u[r][k] = scale * sum_i A[k][i] x[r][i]          (k < the adapter's rank)
//   lora_expand   y[r][o] = bf16(y[r][o] + sum_k B[o][k] u[r][k])  (o < out_dim)
// The resident adapters' weights live in one bf16 arena, each update's A as [rank][in_dim]
// and B as [out_dim][rank] (Hugging Face's orientation). Row r runs under adapter slot
// slot[r] (-1: the bare base; the row is left alone); a slot's update of projection `pair`
// (layer * 7 + projection) starts at a_off / b_off[slot * pairs + pair] (-1: the adapter does
// not update it), with scale[slot * pairs + pair] and the slot's rank. u is f32
// [rows][max_rank]; y is a slice of a wider buffer: row r's outputs start at
// r * y_stride + y_col (one projection of the stacked Q/K/V or gate/up outputs).
//
// lora_shrink: one warp per (row, rank), its lanes striding over the input (x's row stays in
// L1 for every rank of the row), summed across the warp. Grid (rows, ceil(max_rank / warps)).
// lora_expand: one thread per (row, output), summing over the rank in order. Grid
// (ceil(out_dim / blockDim.x), rows).

extern "C" __global__ void lora_shrink(const bf16_t* __restrict__ x, int in_dim,
                                       const bf16_t* __restrict__ arena,
                                       const int* __restrict__ slot,
                                       const long long* __restrict__ a_off,
                                       const int* __restrict__ rank,
                                       const float* __restrict__ scale, int pairs, int pair,
                                       float* __restrict__ u, int max_rank) {
    const int r = blockIdx.x;
    const int lane = threadIdx.x & 31;
    const int k = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int s = slot[r];
    if (s < 0) {
        return;
    }
    const long long at = (long long)s * pairs + pair;
    const long long off = a_off[at];
    if (off < 0 || k >= rank[s]) {
        return;
    }
    const bf16_t* a = arena + off + (long long)k * in_dim;
    const bf16_t* xr = x + (long long)r * in_dim;
    float acc = 0.0f;
    for (int i = lane; i < in_dim; i += 32) {
        acc = fmaf(bf16_to_f32(a[i]), bf16_to_f32(xr[i]), acc);
    }
    acc = warp_sum(acc);
    if (lane == 0) {
        u[(long long)r * max_rank + k] = acc * scale[at];
    }
}

extern "C" __global__ void lora_expand(const float* __restrict__ u, int max_rank,
                                       const bf16_t* __restrict__ arena,
                                       const int* __restrict__ slot,
                                       const long long* __restrict__ b_off,
                                       const int* __restrict__ rank, int pairs, int pair,
                                       bf16_t* __restrict__ y, int out_dim, int y_stride,
                                       int y_col) {
    const int r = blockIdx.y;
    const int o = blockIdx.x * blockDim.x + threadIdx.x;
    const int s = slot[r];
    if (s < 0 || o >= out_dim) {
        return;
    }
    const long long off = b_off[(long long)s * pairs + pair];
    if (off < 0) {
        return;
    }
    const int n = rank[s];
    const bf16_t* b = arena + off + (long long)o * n;
    const float* ur = u + (long long)r * max_rank;
    float acc = 0.0f;
    for (int k = 0; k < n; ++k) {
        acc = fmaf(bf16_to_f32(b[k]), ur[k], acc);
    }
    bf16_t* yp = y + (long long)r * y_stride + y_col + o;
    *yp = f32_to_bf16(bf16_to_f32(*yp) + acc);
}
