// GGML block formats to bf16, at load time. One thread per 32-value block.
// q4_0: {f16 d; u8 qs[16]}            x = (q - 8) * d
// q4_1: {f16 d; f16 m; u8 qs[16]}     x = q * d + m
// q8_0: {f16 d; i8 qs[32]}            x = q * d
// Low nibbles are values 0..15 of the block, high nibbles 16..31.

__device__ __forceinline__ f16_t load_f16(const unsigned char* p) {
    return (f16_t)((unsigned int)p[0] | ((unsigned int)p[1] << 8));
}

extern "C" __global__ void dequant_q4_0(const unsigned char* __restrict__ src,
                                        bf16_t* __restrict__ out, long long blocks) {
    for (long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x; b < blocks;
         b += (long long)gridDim.x * blockDim.x) {
        const unsigned char* blk = src + b * 18;
        const float d = f16_to_f32(load_f16(blk));
        bf16_t* o = out + b * 32;
        for (int j = 0; j < 16; ++j) {
            const unsigned int q = blk[2 + j];
            o[j] = f32_to_bf16(((float)(q & 0xfu) - 8.0f) * d);
            o[j + 16] = f32_to_bf16(((float)(q >> 4) - 8.0f) * d);
        }
    }
}

extern "C" __global__ void dequant_q4_1(const unsigned char* __restrict__ src,
                                        bf16_t* __restrict__ out, long long blocks) {
    for (long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x; b < blocks;
         b += (long long)gridDim.x * blockDim.x) {
        const unsigned char* blk = src + b * 20;
        const float d = f16_to_f32(load_f16(blk));
        const float m = f16_to_f32(load_f16(blk + 2));
        bf16_t* o = out + b * 32;
        for (int j = 0; j < 16; ++j) {
            const unsigned int q = blk[4 + j];
            o[j] = f32_to_bf16((float)(q & 0xfu) * d + m);
            o[j + 16] = f32_to_bf16((float)(q >> 4) * d + m);
        }
    }
}

extern "C" __global__ void dequant_q8_0(const unsigned char* __restrict__ src,
                                        bf16_t* __restrict__ out, long long blocks) {
    for (long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x; b < blocks;
         b += (long long)gridDim.x * blockDim.x) {
        const unsigned char* blk = src + b * 34;
        const float d = f16_to_f32(load_f16(blk));
        bf16_t* o = out + b * 32;
        for (int j = 0; j < 32; ++j) {
            o[j] = f32_to_bf16((float)(signed char)blk[2 + j] * d);
        }
    }
}
