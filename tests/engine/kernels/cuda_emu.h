// Just enough of CUDA to run a kernel's source on the CPU, for tests on machines without a GPU
// (`cuda_emu.py` builds and launches it). A CUDA thread is a fiber (ucontext) of the launching
// thread, switched at the barriers, a thread block's fibers taking turns in a shuffled order
// (another each turn); built with a sanitizer (`CUDA_EMU_SANITIZE`), a CUDA thread is a std::thread
// instead, so that ThreadSanitizer sees the threads' races. Semantics kept:
// __syncthreads and __syncwarp are barriers of the thread block and of the warp (a barrier some
// threads never reach is reported, where a GPU hangs), shuffles
// exchange through the warp, WMMA fragments are whole 16×16 matrices every lane holds (the
// collective's result; lane 0 stores; TF32 operands cut to 19 bits), bfloat16 rounds to nearest
// even. CUDA's alignment rules are checked where a GPU would fault or misread: a 16-byte vector
// type is 16-byte aligned (UBSan's alignment check, `CUDA_EMU_SANITIZE=undefined`, sees its
// loads), a WMMA load or store takes a 32-byte aligned pointer and a stride of a multiple of 16
// bytes, and dynamic shared memory is aligned as the kernel declares it, no more; a broken rule is
// reported (`emu::fail`) and the launch raises; thread blocks run in a scrambled order. Not kept:
// timing, memory ordering beyond the barriers, anything the kernels here do not use.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define EMU_OS_THREADS 1
#include <barrier>
#include <mutex>
#include <thread>
#else
#include <sys/mman.h>
#include <ucontext.h>
#endif

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

struct __nv_bfloat16 {
    uint16_t bits = 0;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) {
        uint32_t u;
        std::memcpy(&u, &f, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            bits = 0x7fc0;  // NaN
        } else {
            bits = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
    }
    operator float() const {
        uint32_t u = static_cast<uint32_t>(bits) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
};

namespace emu {

// The first broken rule of a launch, for `cuda_emu.py` to raise (empty: none).
inline std::string failed;
inline void fail(const std::string& what) {
#if EMU_OS_THREADS
    static std::mutex lock;
    std::lock_guard<std::mutex> hold(lock);
#endif
    if (failed.empty()) {
        failed = what;
    }
}

#if EMU_OS_THREADS
using Gate = std::barrier<>;
inline void pass(Gate& gate) { gate.arrive_and_wait(); }
#else
// A barrier of fibers: the last to arrive opens it (a new phase); the others wait for that.
struct Gate {
    explicit Gate(int size) : size(size) {}
    int size, arrived = 0;
    unsigned phase = 0;
};
// A CUDA thread: its context, and the gate and phase it waits at (none: it can run).
struct Fiber {
    ucontext_t context;
    const Gate* gate = nullptr;
    unsigned phase = 0;
    bool done = false;
};
inline thread_local ucontext_t scheduler;
inline thread_local Fiber* running = nullptr;
inline void pass(Gate& gate) {
    if (++gate.arrived == gate.size) {
        gate.arrived = 0;
        ++gate.phase;
        return;
    }
    running->gate = &gate;
    running->phase = gate.phase;
    swapcontext(&running->context, &scheduler);
}
#endif

struct Block {
    std::unique_ptr<Gate> all;
    std::vector<std::unique_ptr<Gate>> warps;
    std::vector<float> exchange;  // a float a thread, for shuffles
    unsigned char* shared = nullptr;  // `shared_bytes` aligned to the kernel's __align__
};

inline thread_local dim3 thread_idx, block_idx, block_dim;
inline thread_local Block* block = nullptr;

inline int lane() { return thread_idx.x % 32; }
inline int warp() { return thread_idx.x / 32; }

}  // namespace emu

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define __global__
#define __device__
#define __align__(n)

inline void __syncthreads() { emu::pass(*emu::block->all); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::pass(*emu::block->warps[emu::warp()]); }
// a lane's value from lane `from(me)` of its warp (every lane of the warp calls it)
template <class V, class F>
V shuffle(V v, F from) {
    static_assert(sizeof(V) == 4);
    auto& x = emu::block->exchange;
    const int me = threadIdx.x;
    std::memcpy(&x[me], &v, 4);
    __syncwarp();
    V got;
    std::memcpy(&got, &x[(me & ~31) | from(me & 31)], 4);
    __syncwarp();
    return got;
}
template <class V>
V __shfl_xor_sync(unsigned, V v, int mask) {
    return shuffle(v, [mask](int lane) { return lane ^ mask; });
}
template <class V>
V __shfl_up_sync(unsigned, V v, int delta) {
    return shuffle(v, [delta](int lane) { return lane >= delta ? lane - delta : lane; });
}
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __int_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
using std::exp2f;
inline float expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using std::log2f;
using std::fmaxf;
using std::max;
using std::min;

namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
namespace precision {
struct tf32 {};
}
enum layout_t { mem_row_major, mem_col_major };

// TF32 as the tensor cores read it: a float's top 19 bits; __float_to_tf32 rounds to them
// (nearest, ties away from zero), a float not rounded is cut
inline float __float_to_tf32(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) {
        u = (u + 0x1000u) & 0xffffe000u;
    }
    std::memcpy(&f, &u, 4);
    return f;
}
inline float tf32_cut(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u &= 0xffffe000u;
    std::memcpy(&f, &u, 4);
    return f;
}

// a fragment: the whole matrix, x[row * 16 + col]; matrix_a is M × K, matrix_b K × N, the
// accumulator M × N (every lane holds all of it: `num_elements` covers it)
template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
    static constexpr int rows = std::is_same_v<Use, matrix_b> ? K : M;
    static constexpr int cols = std::is_same_v<Use, matrix_a> ? K : N;
    static constexpr int num_elements = 256;
    float x[256];
};

// WMMA's rules for its memory: a 256-bit aligned pointer, a stride of a multiple of 16 bytes
template <class P>
void check_matrix(const P* p, unsigned ldm, const char* op) {
    if (reinterpret_cast<std::uintptr_t>(p) % 32 != 0) {
        emu::fail(std::string(op) + ": pointer not 32-byte aligned");
    }
    if (ldm * sizeof(P) % 16 != 0) {
        emu::fail(std::string(op) + ": ldm of " + std::to_string(ldm) + " elements of " +
                  std::to_string(sizeof(P)) + " bytes, not a multiple of 16 bytes");
    }
}

template <class Use, int M, int N, int K, class T, class Layout, class P>
void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const P* p, unsigned ldm) {
    check_matrix(p, ldm, "load_matrix_sync");
    constexpr bool rows = std::is_same_v<Layout, row_major>;
    for (int i = 0; i < f.rows; ++i) {
        for (int j = 0; j < f.cols; ++j) {
            f.x[i * 16 + j] = static_cast<float>(rows ? p[i * ldm + j] : p[j * ldm + i]);
        }
    }
}

template <int M, int N, int K, class T>
void load_matrix_sync(
    fragment<accumulator, M, N, K, T>& f, const float* p, unsigned ldm, layout_t layout) {
    check_matrix(p, ldm, "load_matrix_sync");
    for (int i = 0; i < 16; ++i) {
        for (int j = 0; j < 16; ++j) {
            f.x[i * 16 + j] = layout == mem_row_major ? p[i * ldm + j] : p[j * ldm + i];
        }
    }
}

template <int M, int N, int K, class T>
void store_matrix_sync(
    float* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm, layout_t layout) {
    check_matrix(p, ldm, "store_matrix_sync");
    __syncwarp();  // every lane has computed f
    if (emu::lane() == 0) {
        for (int i = 0; i < 16; ++i) {
            for (int j = 0; j < 16; ++j) {
                (layout == mem_row_major ? p[i * ldm + j] : p[j * ldm + i]) = f.x[i * 16 + j];
            }
        }
    }
    __syncwarp();  // and the stores are done before any lane goes on, as a collective's are
}

template <class Use, int M, int N, int K, class T, class Layout>
void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, float v) {
    std::fill(std::begin(f.x), std::end(f.x), v);
}

template <int M, int N, int K, class TA, class LA, class TB, class LB, class TC>
void mma_sync(
    fragment<accumulator, M, N, K, TC>& d,
    const fragment<matrix_a, M, N, K, TA, LA>& a,
    const fragment<matrix_b, M, N, K, TB, LB>& b,
    const fragment<accumulator, M, N, K, TC>& c) {
    constexpr bool tf32 = std::is_same_v<TA, precision::tf32>;
    float out[256];
    for (int i = 0; i < 16; ++i) {
        for (int j = 0; j < 16; ++j) {
            float s = c.x[i * 16 + j];
            for (int k = 0; k < K; ++k) {
                const float x = a.x[i * 16 + k], y = b.x[k * 16 + j];
                s += tf32 ? tf32_cut(x) * tf32_cut(y) : x * y;
            }
            out[i * 16 + j] = s;
        }
    }
    std::memcpy(d.x, out, sizeof(out));
}

}  // namespace nvcuda::wmma

namespace emu {

// Bytes out of bounds for AddressSanitizer (`on`), or back in bounds; nothing without it.
inline void poison(unsigned char* p, long n, int on) {
#if defined(__SANITIZE_ADDRESS__)
    if (on) {
        ASAN_POISON_MEMORY_REGION(p, n);
    } else {
        ASAN_UNPOISON_MEMORY_REGION(p, n);
    }
#else
    (void)p, (void)n, (void)on;
#endif
}

#if EMU_OS_THREADS
// A thread block's threads, one std::thread each.
template <class F>
void run_block(Block& b, int threads, F& kernel) {
    const dim3 where = block_idx;
    std::vector<std::thread> pool;
    for (int tx = 0; tx < threads; ++tx) {
        pool.emplace_back([&, tx] {
            thread_idx = {static_cast<unsigned>(tx), 0, 0};
            block_idx = where;
            block_dim = {static_cast<unsigned>(threads), 1, 1};
            block = &b;
            kernel();
        });
    }
    for (auto& t : pool) {
        t.join();
    }
}
#else
constexpr std::size_t STACK = 256 * 1024;  // a fiber's, above a guard page
constexpr std::size_t PAGE = 4096;

// A thread block's threads as fibers on `stacks` (threads × (PAGE + STACK), each above a page
// that faults), run in turns until each has returned; false when some wait at a barrier the
// others have passed by returning (a deadlock on a GPU).
template <class F>
bool run_block(Block& b, int threads, F& kernel, unsigned char* stacks) {
    static thread_local F* body;
    body = &kernel;
    std::vector<Fiber> fibers(threads);
    for (int tx = 0; tx < threads; ++tx) {
        Fiber& f = fibers[tx];
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = stacks + tx * (PAGE + STACK) + PAGE;
        f.context.uc_stack.ss_size = STACK;
        f.context.uc_link = &scheduler;
        makecontext(&f.context, +[] { (*body)(); running->done = true; }, 0);
    }
    block_dim = {static_cast<unsigned>(threads), 1, 1};
    block = &b;
    int left = threads;
    std::vector<int> order(threads);
    for (int i = 0; i < threads; ++i) {
        order[i] = i;
    }
    // each turn in another order, the same every run (xorshift32 from the block's index): a
    // thread that reads what another writes without a barrier between reads it unwritten in
    // about half of the turns, whichever of the two has the lower index
    uint32_t seed = 2654435761u * (block_idx.x + 1);
    for (; left;) {
        for (int i = threads - 1; i > 0; --i) {
            seed ^= seed << 13, seed ^= seed >> 17, seed ^= seed << 5;
            std::swap(order[i], order[seed % (i + 1)]);
        }
        bool moved = false;
        for (const int tx : order) {
            Fiber& f = fibers[tx];
            if (f.done || (f.gate && f.gate->phase == f.phase)) {
                continue;
            }
            f.gate = nullptr;
            thread_idx = {static_cast<unsigned>(tx), 0, 0};
            running = &f;
            moved = true;
            swapcontext(&scheduler, &f.context);
            left -= f.done;
        }
        if (!moved) {
            return false;
        }
    }
    return true;
}
#endif

// Runs `kernel` over a grid of `blocks` thread blocks of `threads` threads (x only), each block
// with `shared_bytes` of dynamic shared memory aligned to `align` bytes, the kernel's __align__
// (exactly: an address of `align` but not of twice it, so a kernel counting on more fails the
// checks above), one block at a time, in no order a kernel could count on.
template <class F>
void launch(int blocks, int threads, int shared_bytes, int align, F kernel) {
    std::vector<unsigned char> memory(shared_bytes + 3 * align);  // the base within 3·align
    const auto start = reinterpret_cast<std::uintptr_t>(memory.data());
    const std::uintptr_t twice = 2 * align;
    const std::uintptr_t base = (start + twice - 1) / twice * twice + align;
    unsigned char* shared = memory.data() + (base - start);
    // the bytes around it poisoned, so that AddressSanitizer reports a read out of its bounds
    poison(memory.data(), base - start, 1);
    poison(shared + shared_bytes, memory.size() - (base - start) - shared_bytes, 1);
#if !EMU_OS_THREADS
    const std::size_t span = threads * (PAGE + STACK);
    auto* stacks = static_cast<unsigned char*>(
        mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    for (int tx = 0; tx < threads; ++tx) {  // a fiber overflowing its stack faults
        mprotect(stacks + tx * (PAGE + STACK), PAGE, PROT_NONE);
    }
#endif
    // the thread blocks in a scrambled order (a GPU promises none): a block that reads what
    // another of the same launch writes gets it wrong here as there
    std::vector<int> order(blocks);
    for (int i = 0; i < blocks; ++i) {
        order[i] = i;
    }
    std::reverse(order.begin(), order.end());
    for (int i = 1; i < blocks; i += 2) {
        std::swap(order[i - 1], order[i]);
    }
    for (const int bx : order) {
        Block b;
        b.all = std::make_unique<Gate>(threads);
        for (int w = 0; w < (threads + 31) / 32; ++w) {
            b.warps.push_back(std::make_unique<Gate>(std::min(32, threads - 32 * w)));
        }
        b.exchange.assign(threads, 0.0f);
        // garbage, as a GPU's is: NaN as a float or a bfloat16, so that a value read before
        // it is written shows in the output, even times zero
        std::fill(shared, shared + shared_bytes, 0xFF);
        b.shared = shared;
        block_idx = {static_cast<unsigned>(bx), 0, 0};
#if EMU_OS_THREADS
        run_block(b, threads, kernel);
#else
        if (!run_block(b, threads, kernel, stacks)) {
            fail("block " + std::to_string(bx) + ": a barrier some of its threads never reach");
            break;
        }
#endif
    }
#if !EMU_OS_THREADS
    munmap(stacks, span);
#endif
    poison(memory.data(), memory.size(), 0);
}

inline unsigned char* shared() { return block->shared; }

}  // namespace emu
