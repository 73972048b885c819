// An emulated cuBLAS (the calls the CUDA runner makes), loaded under the name libcublas.so by
// tests/cuda_emulated.rs. A GEMM is queued on its stream through the emulated driver
// (fake_cuda_submit), so it runs in order with the kernels and is recorded into a graph while
// the stream is captured. Column-major, op(A) m x k, op(B) k x n, C m x n, as cuBLAS; bf16 or
// f32 operands; f32 accumulation.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>

extern "C" int fake_cuda_submit(void* stream, void (*fn)(const void*), const void* data,
                                size_t size);
extern "C" int fake_cuda_inside(unsigned long long p, size_t n);

namespace {

constexpr int SUCCESS = 0;
constexpr int INVALID_VALUE = 7;
constexpr int NOT_SUPPORTED = 15;
constexpr int R_32F = 0;
constexpr int R_16BF = 14;
constexpr int COMPUTE_32F = 68;

struct Handle {
    void* stream = nullptr;
};

struct Gemm {
    int transa, transb, m, n, k;
    float alpha, beta;
    const void* a;
    int atype, lda;
    const void* b;
    int btype, ldb;
    void* c;
    int ctype, ldc;
};

float load(const void* p, int type, long long i) {
    if (type == R_32F) {
        return static_cast<const float*>(p)[i];
    }
    const uint32_t bits = (uint32_t) static_cast<const uint16_t*>(p)[i] << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

void store(void* p, int type, long long i, float v) {
    if (type == R_32F) {
        static_cast<float*>(p)[i] = v;
        return;
    }
    uint32_t u;
    std::memcpy(&u, &v, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        static_cast<uint16_t*>(p)[i] = (uint16_t)((u >> 16) | 0x40u);
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    static_cast<uint16_t*>(p)[i] = (uint16_t)(u >> 16);
}

void run_gemm(const void* data) {
    Gemm g;
    std::memcpy(&g, data, sizeof g);
    for (int j = 0; j < g.n; ++j) {
        for (int i = 0; i < g.m; ++i) {
            float s = 0.0f;
            for (int p = 0; p < g.k; ++p) {
                const long long ai = g.transa ? (long long)p + (long long)i * g.lda
                                              : (long long)i + (long long)p * g.lda;
                const long long bi = g.transb ? (long long)j + (long long)p * g.ldb
                                              : (long long)p + (long long)j * g.ldb;
                s += load(g.a, g.atype, ai) * load(g.b, g.btype, bi);
            }
            const long long ci = (long long)i + (long long)j * g.ldc;
            const float prev = (g.beta != 0.0f) ? load(g.c, g.ctype, ci) : 0.0f;
            store(g.c, g.ctype, ci, g.alpha * s + g.beta * prev);
        }
    }
}

}  // namespace

extern "C" {

int cublasCreate_v2(void** handle) {
    *handle = new Handle();
    return SUCCESS;
}
int cublasDestroy_v2(void* handle) {
    delete static_cast<Handle*>(handle);
    return SUCCESS;
}
int cublasSetStream_v2(void* handle, void* stream) {
    static_cast<Handle*>(handle)->stream = stream;
    return SUCCESS;
}
int cublasSetWorkspace_v2(void*, void*, size_t) { return SUCCESS; }
int cublasSetMathMode(void*, int) { return SUCCESS; }
const char* cublasGetStatusString(int) { return "emulated cuBLAS error"; }
const char* cublasGetStatusName(int) { return "CUBLAS_STATUS_EMULATED"; }

// alpha and beta: host f32 (pointer mode host, compute type 32F), read at the call as cuBLAS
// does.
int cublasGemmEx(void* handle, int transa, int transb, int m, int n, int k, const void* alpha,
                 const void* a, int atype, int lda, const void* b, int btype, int ldb,
                 const void* beta, void* c, int ctype, int ldc, int compute, int) {
    for (int t : {atype, btype, ctype}) {
        if (t != R_32F && t != R_16BF) {
            return NOT_SUPPORTED;
        }
    }
    if (atype != btype || compute != COMPUTE_32F) {
        return NOT_SUPPORTED;
    }
    const int a_rows = transa ? k : m;
    const int b_rows = transb ? n : k;
    if (m < 0 || n < 0 || k < 0 || transa > 1 || transb > 1 || lda < std::max(1, a_rows) ||
        ldb < std::max(1, b_rows) || ldc < std::max(1, m)) {
        return INVALID_VALUE;
    }
    // Each operand's last element inside device memory.
    auto fits = [](const void* p, int type, int ld, int cols) {
        const size_t elem = type == R_32F ? 4 : 2;
        return cols == 0 || fake_cuda_inside((unsigned long long)p, ((size_t)ld * cols) * elem);
    };
    if (!fits(a, atype, lda, transa ? m : k) || !fits(b, btype, ldb, transb ? k : n) ||
        !fits(c, ctype, ldc, n)) {
        return INVALID_VALUE;
    }
    Gemm g{transa, transb, m, n, k, *static_cast<const float*>(alpha),
           *static_cast<const float*>(beta), a, atype, lda, b, btype, ldb, c, ctype, ldc};
    const int rc = fake_cuda_submit(static_cast<Handle*>(handle)->stream, run_gemm, &g, sizeof g);
    return rc == 0 ? SUCCESS : INVALID_VALUE;
}

}  // extern "C"
