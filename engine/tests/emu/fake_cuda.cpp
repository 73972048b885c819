// An emulated CUDA driver (the part of libcuda's API cudarc calls for the CUDA runner), built
// into one shared library with the emulated kernels (tests/emu/mod.rs appends this file to
// them, after `kEntries`). Device memory is host memory; every stream runs its work at once,
// in order (so every copy and launch is synchronous); a stream being captured records its
// launches (parameter values copied, as the driver does) and a graph replays them. Loaded
// under the name libcuda.so before cudarc looks for it (tests/cuda_emulated.rs).
//
// It is a test harness for our runner's use of the driver, not a model of a GPU: timing,
// concurrency between streams and the hardware's numerics are out of scope.

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>

namespace fake {

constexpr int OK = 0;
constexpr int INVALID_VALUE = 1;
constexpr int NOT_FOUND = 500;
constexpr int ILLEGAL_ADDRESS = 700;
constexpr int LAUNCH_FAILED = 719;
constexpr int CAPTURE_UNSUPPORTED = 900;
constexpr int CAPTURE_INVALIDATED = 901;

// Bytes after each allocation, filled with CANARY and checked after every piece of work.
constexpr size_t PAD = 256;
constexpr unsigned char CANARY = 0xA7;

struct Op {
    // A kernel launch (entry != null) or host work (fn != null).
    const emu::Entry* entry = nullptr;
    unsigned grid[3] = {1, 1, 1};
    unsigned block[3] = {1, 1, 1};
    std::vector<std::vector<unsigned char>> params;
    void (*fn)(const void*) = nullptr;
    std::vector<unsigned char> data;
};

struct Stream {
    bool capturing = false;
    bool invalidated = false;  // something the capture cannot hold happened during it
    std::vector<Op> captured;
};

struct Graph {
    std::vector<Op> ops;
};

struct Module {
    std::vector<const emu::Entry*> kernels;
};

std::mutex g_lock;
std::map<unsigned long long, size_t> g_allocs;  // device pointer -> bytes
Stream g_default_stream;
thread_local std::string g_last_error;
// Streams this thread is capturing (the runner captures in thread-local mode): while any is,
// calls that would synchronize or allocate fail and spoil the capture, as on the device.
thread_local std::vector<Stream*> g_capturing;

bool refuse_during_capture() {
    if (g_capturing.empty()) {
        return false;
    }
    for (Stream* st : g_capturing) {
        st->invalidated = true;
    }
    return true;
}

std::mutex g_run;  // the kernel emulation is one set of globals: one launch at a time

bool inside(unsigned long long p, size_t n);

// The allocation whose padding changed, or 0.
unsigned long long overrun() {
    std::lock_guard<std::mutex> g(g_lock);
    for (const auto& [p, bytes] : g_allocs) {
        const auto* pad = (const unsigned char*)p + bytes;
        for (size_t i = 0; i < PAD; ++i) {
            if (pad[i] != CANARY) {
                return p;
            }
        }
    }
    return 0;
}

int fail(int rc, const std::string& why) {
    g_last_error = why;
    std::fprintf(stderr, "emulated CUDA: %s\n", why.c_str());
    return rc;
}

int run_op(const Op& op) {
    std::lock_guard<std::mutex> g(g_run);
    if (op.fn != nullptr) {
        op.fn(op.data.data());
    } else {
        std::vector<void*> args;
        for (unsigned i = 0; i < op.params.size(); ++i) {
            args.push_back(const_cast<unsigned char*>(op.params[i].data()));
            // Every pointer argument points into a live allocation (or is null): a freed
            // buffer replayed by a graph, or a host pointer, is an illegal address.
            if (op.entry->pointer[i]) {
                unsigned long long p;
                std::memcpy(&p, op.params[i].data(), sizeof p);
                if (p != 0 && !inside(p, 1)) {
                    return fail(ILLEGAL_ADDRESS, std::string(op.entry->name) + " parameter " +
                                                     std::to_string(i) +
                                                     " is not device memory");
                }
            }
        }
        char err[512] = {0};
        if (emu::run(*op.entry, op.grid, op.block, args.data(), err, sizeof err) != 0) {
            return fail(LAUNCH_FAILED, err);
        }
    }
    if (unsigned long long p = overrun()) {
        return fail(ILLEGAL_ADDRESS,
                    std::string(op.entry ? op.entry->name : "host work") +
                        " wrote past the end of the allocation at " + std::to_string(p));
    }
    return OK;
}

Stream* stream_of(void* s) { return s == nullptr ? &g_default_stream : static_cast<Stream*>(s); }

// Runs `op` now, or records it when the stream is capturing.
int submit(void* stream, Op op) {
    Stream* st = stream_of(stream);
    if (op.entry != nullptr) {
        const unsigned threads = op.block[0] * op.block[1] * op.block[2];
        if (threads == 0 || threads > 1024 || op.block[2] > 64 || op.grid[1] > 65535 ||
            op.grid[2] > 65535 || op.grid[0] == 0 || op.grid[1] == 0 || op.grid[2] == 0) {
            return fail(INVALID_VALUE, std::string(op.entry->name) + ": launch shape out of range");
        }
    }
    if (st->capturing) {
        st->captured.push_back(std::move(op));
        return OK;
    }
    return run_op(op);
}

// Whether [p, p + n) lies inside one allocation.
bool inside(unsigned long long p, size_t n) {
    std::lock_guard<std::mutex> g(g_lock);
    auto it = g_allocs.upper_bound(p);
    if (it == g_allocs.begin()) {
        return false;
    }
    --it;
    return p >= it->first && p + n <= it->first + it->second;
}

}  // namespace fake

extern "C" {

// Whether [p, p + n) is device memory (the emulated cuBLAS checks its operands).
int fake_cuda_inside(unsigned long long p, size_t n) { return fake::inside(p, n) ? 1 : 0; }

// Host work queued on a stream in order with its kernels (the emulated cuBLAS uses it).
int fake_cuda_submit(void* stream, void (*fn)(const void*), const void* data, size_t size) {
    fake::Op op;
    op.fn = fn;
    op.data.assign(static_cast<const unsigned char*>(data),
                   static_cast<const unsigned char*>(data) + size);
    return fake::submit(stream, std::move(op));
}

int cuInit(unsigned) { return fake::OK; }
int cuDriverGetVersion(int* v) {
    *v = 13000;
    return fake::OK;
}
int cuDeviceGetCount(int* n) {
    *n = 1;
    return fake::OK;
}
int cuDeviceGet(int* dev, int ordinal) {
    if (ordinal != 0) {
        return fake::INVALID_VALUE;
    }
    *dev = 0;
    return fake::OK;
}
int cuDeviceGetAttribute(int* v, int attr, int) {
    switch (attr) {
        // 4 multiprocessors: few, so decode attention splits contexts at test sizes.
        case 16: *v = 4; break;
        case 75: *v = 9; break;   // compute capability 9.0
        case 76: *v = 0; break;
        case 115: *v = 1; break;  // memory pools: cudarc allocates stream-ordered
        default: *v = 0; break;
    }
    return fake::OK;
}
int cuDeviceGetName(char* name, int len, int) {
    std::snprintf(name, (size_t)len, "emulated CUDA device");
    return fake::OK;
}
int cuDeviceTotalMem_v2(size_t* bytes, int) {
    *bytes = (size_t)16 << 30;
    return fake::OK;
}
static int g_ctx_tag;
int cuDevicePrimaryCtxRetain(void** ctx, int) {
    *ctx = &g_ctx_tag;
    return fake::OK;
}
int cuDevicePrimaryCtxRelease_v2(int) { return fake::OK; }
int cuCtxSetCurrent(void*) { return fake::OK; }
int cuCtxGetCurrent(void** ctx) {
    *ctx = &g_ctx_tag;
    return fake::OK;
}
int cuCtxGetDevice(int* dev) {
    *dev = 0;
    return fake::OK;
}
int cuCtxSynchronize() {
    return fake::refuse_during_capture() ? fake::CAPTURE_UNSUPPORTED : fake::OK;
}

int cuStreamCreate(void** s, unsigned) {
    *s = new fake::Stream();
    return fake::OK;
}
int cuStreamCreateWithPriority(void** s, unsigned, int) { return cuStreamCreate(s, 0); }
int cuStreamDestroy_v2(void* s) {
    delete static_cast<fake::Stream*>(s);
    return fake::OK;
}
int cuStreamSynchronize(void*) {
    return fake::refuse_during_capture() ? fake::CAPTURE_UNSUPPORTED : fake::OK;
}
int cuStreamBeginCapture_v2(void* s, int) {
    if (s == nullptr) {
        return fake::CAPTURE_UNSUPPORTED;  // the legacy default stream cannot be captured
    }
    fake::Stream* st = fake::stream_of(s);
    if (st->capturing) {
        return fake::INVALID_VALUE;
    }
    st->capturing = true;
    st->invalidated = false;
    st->captured.clear();
    fake::g_capturing.push_back(st);
    return fake::OK;
}
int cuStreamEndCapture(void* s, void** graph) {
    fake::Stream* st = fake::stream_of(s);
    if (!st->capturing) {
        return fake::INVALID_VALUE;
    }
    st->capturing = false;
    auto& cap = fake::g_capturing;
    cap.erase(std::remove(cap.begin(), cap.end(), st), cap.end());
    if (st->invalidated) {
        st->captured.clear();
        *graph = nullptr;
        return fake::CAPTURE_INVALIDATED;
    }
    *graph = new fake::Graph{std::move(st->captured)};
    st->captured.clear();
    return fake::OK;
}
int cuStreamIsCapturing(void* s, int* status) {
    *status = fake::stream_of(s)->capturing ? 1 : 0;
    return fake::OK;
}
int cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long) {
    *exec = new fake::Graph(*static_cast<fake::Graph*>(graph));
    return fake::OK;
}
int cuGraphUpload(void*, void*) { return fake::OK; }
int cuGraphLaunch(void* exec, void* stream) {
    if (fake::stream_of(stream)->capturing) {
        return fake::INVALID_VALUE;
    }
    for (const fake::Op& op : static_cast<fake::Graph*>(exec)->ops) {
        if (int rc = fake::run_op(op); rc != fake::OK) {
            return rc;
        }
    }
    return fake::OK;
}
int cuGraphExecDestroy(void* exec) {
    delete static_cast<fake::Graph*>(exec);
    return fake::OK;
}
int cuGraphDestroy(void* graph) {
    delete static_cast<fake::Graph*>(graph);
    return fake::OK;
}

// An event holds the host time it was recorded at: streams run their work at once, so the
// time between two records is the emulated work between them.
struct FakeEvent {
    double ms;
};
int cuEventCreate(void** e, unsigned) {
    *e = new FakeEvent{0.0};
    return fake::OK;
}
int cuEventRecord(void* e, void*) {
    static_cast<FakeEvent*>(e)->ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch())
            .count();
    return fake::OK;
}
int cuEventElapsedTime_v2(float* ms, void* start, void* end) {
    *ms = (float)(static_cast<FakeEvent*>(end)->ms - static_cast<FakeEvent*>(start)->ms);
    return fake::OK;
}
int cuEventElapsedTime(float* ms, void* start, void* end) {
    return cuEventElapsedTime_v2(ms, start, end);
}
int cuEventSynchronize(void*) {
    return fake::refuse_during_capture() ? fake::CAPTURE_UNSUPPORTED : fake::OK;
}
int cuEventQuery(void*) { return fake::OK; }
int cuEventDestroy_v2(void* e) {
    delete static_cast<FakeEvent*>(e);
    return fake::OK;
}
int cuStreamWaitEvent(void*, void*, unsigned) { return fake::OK; }

// New memory holds 0xFF bytes (NaN as bf16 and f32, -1 as int) until written, so a read of
// memory nothing wrote shows; PAD canary bytes follow each allocation.
int cuMemAlloc_v2(unsigned long long* p, size_t bytes) {
    if (bytes == 0) {
        return fake::INVALID_VALUE;
    }
    if (fake::refuse_during_capture()) {
        return fake::CAPTURE_UNSUPPORTED;
    }
    void* m = std::aligned_alloc(256, ((bytes + fake::PAD + 255) / 256) * 256);
    if (m == nullptr) {
        return 2;  // out of memory
    }
    std::memset(m, 0xFF, bytes);
    std::memset((unsigned char*)m + bytes, fake::CANARY, fake::PAD);
    std::lock_guard<std::mutex> g(fake::g_lock);
    *p = (unsigned long long)m;
    fake::g_allocs[*p] = bytes;
    return fake::OK;
}
int cuMemAllocAsync(unsigned long long* p, size_t bytes, void*) { return cuMemAlloc_v2(p, bytes); }
int cuMemFree_v2(unsigned long long p) {
    if (fake::refuse_during_capture()) {
        return fake::CAPTURE_UNSUPPORTED;
    }
    if (fake::overrun() == p && p != 0) {
        return fake::fail(fake::ILLEGAL_ADDRESS, "a buffer freed after a write past its end");
    }
    std::lock_guard<std::mutex> g(fake::g_lock);
    if (fake::g_allocs.erase(p) == 0) {
        return fake::INVALID_VALUE;
    }
    std::free((void*)p);
    return fake::OK;
}
int cuMemFreeAsync(unsigned long long p, void*) { return cuMemFree_v2(p); }
// Page-locked host memory is ordinary host memory here (poisoned like device memory, so a
// read of what no copy wrote shows).
int cuMemHostAlloc(void** p, size_t bytes, unsigned) {
    if (bytes == 0) {
        return fake::INVALID_VALUE;
    }
    if (fake::refuse_during_capture()) {
        return fake::CAPTURE_UNSUPPORTED;
    }
    *p = std::malloc(bytes);
    if (*p == nullptr) {
        return 2;  // out of memory
    }
    std::memset(*p, 0xFF, bytes);
    return fake::OK;
}
int cuMemFreeHost(void* p) {
    if (fake::refuse_during_capture()) {
        return fake::CAPTURE_UNSUPPORTED;
    }
    std::free(p);
    return fake::OK;
}
// 1 GiB (a device small enough that a test may fill a share of it), less what is allocated.
int cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    std::lock_guard<std::mutex> g(fake::g_lock);
    size_t used = 0;
    for (const auto& a : fake::g_allocs) {
        used += a.second;
    }
    *total = (size_t)1 << 30;
    *free_bytes = *total - used;
    return fake::OK;
}

// Copies and sets are checked against the allocations (a copy past a buffer's end fails as
// it would on the device) and are refused while the stream is capturing (the runner copies
// its inputs before a captured pass, never inside one).
int cuMemsetD8Async(unsigned long long p, unsigned char v, size_t n, void* s) {
    if (!fake::inside(p, n) || fake::stream_of(s)->capturing) {
        return fake::INVALID_VALUE;
    }
    std::memset((void*)p, v, n);
    return fake::OK;
}
int cuMemsetD8_v2(unsigned long long p, unsigned char v, size_t n) {
    return cuMemsetD8Async(p, v, n, nullptr);
}
int cuMemcpyHtoDAsync_v2(unsigned long long dst, const void* src, size_t n, void* s) {
    if (!fake::inside(dst, n) || fake::stream_of(s)->capturing) {
        return fake::INVALID_VALUE;
    }
    std::memcpy((void*)dst, src, n);
    return fake::OK;
}
int cuMemcpyHtoD_v2(unsigned long long dst, const void* src, size_t n) {
    return cuMemcpyHtoDAsync_v2(dst, src, n, nullptr);
}
int cuMemcpyDtoHAsync_v2(void* dst, unsigned long long src, size_t n, void* s) {
    if (!fake::inside(src, n) || fake::stream_of(s)->capturing) {
        return fake::INVALID_VALUE;
    }
    std::memcpy(dst, (const void*)src, n);
    return fake::OK;
}
int cuMemcpyDtoH_v2(void* dst, unsigned long long src, size_t n) {
    return cuMemcpyDtoHAsync_v2(dst, src, n, nullptr);
}
int cuMemcpyDtoDAsync_v2(unsigned long long dst, unsigned long long src, size_t n, void* s) {
    if (!fake::inside(dst, n) || !fake::inside(src, n) || fake::stream_of(s)->capturing) {
        return fake::INVALID_VALUE;
    }
    std::memmove((void*)dst, (const void*)src, n);
    return fake::OK;
}

// A module is the PTX NVRTC made; its kernels are found by the `.entry` names it declares.
int cuModuleLoadData(void** module, const void* image) {
    const std::string ptx(static_cast<const char*>(image));
    auto* m = new fake::Module();
    const std::string tag = ".entry ";
    for (size_t at = ptx.find(tag); at != std::string::npos; at = ptx.find(tag, at + 1)) {
        const size_t start = at + tag.size();
        const size_t end = ptx.find('(', start);
        const std::string name = ptx.substr(start, end - start);
        const emu::Entry* e = emu::find(kEntries, sizeof kEntries / sizeof *kEntries, name.c_str());
        if (e == nullptr) {
            delete m;
            return fake::NOT_FOUND;
        }
        m->kernels.push_back(e);
    }
    *module = m;
    return fake::OK;
}
int cuModuleUnload(void* module) {
    delete static_cast<fake::Module*>(module);
    return fake::OK;
}
int cuModuleGetFunction(void** f, void* module, const char* name) {
    for (const emu::Entry* e : static_cast<fake::Module*>(module)->kernels) {
        if (std::strcmp(e->name, name) == 0) {
            *f = const_cast<emu::Entry*>(e);
            return fake::OK;
        }
    }
    return fake::NOT_FOUND;
}
int cuFuncGetAttribute(int* v, int, void*) {
    *v = 0;
    return fake::OK;
}
int cuFuncSetAttribute(void*, int, int) { return fake::OK; }

int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shared, void* stream, void** params, void** extra) {
    const auto* e = static_cast<const emu::Entry*>(f);
    if (extra != nullptr || shared != 0 || gx == 0 || gy == 0 || gz == 0) {
        return fake::INVALID_VALUE;
    }
    fake::Op op;
    op.entry = e;
    op.grid[0] = gx;
    op.grid[1] = gy;
    op.grid[2] = gz;
    op.block[0] = bx;
    op.block[1] = by;
    op.block[2] = bz;
    for (unsigned i = 0; i < e->params; ++i) {
        const auto* p = static_cast<const unsigned char*>(params[i]);
        op.params.emplace_back(p, p + e->sizes[i]);
    }
    return fake::submit(stream, std::move(op));
}

// cuLaunchKernelEx's configuration (CUlaunchConfig) and one attribute (CUlaunchAttribute:
// an id, then a 64-byte value at offset 8).
struct LaunchAttribute {
    int id;
    char pad[4];
    unsigned char value[64];
};
struct LaunchConfig {
    unsigned grid[3];
    unsigned block[3];
    unsigned shared;
    void* stream;
    LaunchAttribute* attrs;
    unsigned count;
};

// Kernels run one at a time in stream order here, so programmatic stream serialization (id 6,
// the only attribute taken) changes nothing; any other attribute is refused.
int cuLaunchKernelEx(const LaunchConfig* c, void* f, void** params, void** extra) {
    for (unsigned i = 0; i < c->count; ++i) {
        if (c->attrs[i].id != 6) {
            return fake::INVALID_VALUE;
        }
    }
    return cuLaunchKernel(f, c->grid[0], c->grid[1], c->grid[2], c->block[0], c->block[1],
                          c->block[2], c->shared, c->stream, params, extra);
}

int cuGetErrorString(int rc, const char** s) {
    static thread_local std::string msg;
    msg = "emulated CUDA error " + std::to_string(rc) +
          (fake::g_last_error.empty() ? "" : ": " + fake::g_last_error);
    *s = msg.c_str();
    return fake::OK;
}
int cuGetErrorName(int rc, const char** s) { return cuGetErrorString(rc, s); }

}  // extern "C"
