// Matrix-vector products for a few rows, and a whole decode forward of a Llama-family model on CPUs, in one call.
// Built and loaded with cpu_attention.cpp (native.py); bound by cpu_decoder.py.
//
// At a few rows a linear layer mostly streams its weight from memory. Two layouts are read, each once for all the
// input rows, the output rows split between the threads in contiguous runs: the decoder's own copies of its
// weights, packed in panels (kPanel), and, for hf_paged_linear, a weight's plain [out, in] rows (dot products). Either
// way a row's result never depends on how many rows are computed with it or on which thread computes it (same
// summation order), so outputs do not depend on the batch.
//
// The decoder runs what Transformers' Llama, Mistral and Qwen2/3 layers compute, rounding where they round (every
// elementwise step of a bf16 model is rounded to bf16, as torch does), and stores and attends through
// hf_paged_attention. This file is built without -ffast-math and without FMA contraction, so that elementwise steps
// round like torch's; the dot products use explicit FMAs.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "cpu_kernels.h"

namespace {

using namespace hf_paged;

constexpr int kMaxRows = 8;  // rows of one matrix-vector kernel call (hf_paged_linear)
constexpr int kMaxTokens = 512;  // tokens of one decoder step: the panel products take them kMaxRows at a time

inline vec16 fma16(vec16 a, vec16 b, vec16 c) {
#if defined(__AVX512F__)
    return (vec16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    __m256 x[2], y[2], z[2];
    std::memcpy(x, &a, sizeof x);
    std::memcpy(y, &b, sizeof y);
    std::memcpy(z, &c, sizeof z);
    z[0] = _mm256_fmadd_ps(x[0], y[0], z[0]);
    z[1] = _mm256_fmadd_ps(x[1], y[1], z[1]);
    std::memcpy(&c, z, sizeof c);
    return c;
#else
    return a * b + c;
#endif
}

// Weight rows read together, by input rows and dtype (SmolLM2's decode steps on a 2-core AVX-512 machine, from when
// the decoder read plain rows, the variants taking turns step by step: benchmarks/native_ab.py). bf16 reads one row at
// a time up to 6 rows: its weight stream then runs strictly in order, and its steps at 2, 3 and 5 rows were
// 1.13-1.26x faster than with the 2-8 rows that fp32 still reads together, at 4 rows 1.07-1.21x faster than 4 rows at
// once (6 rows: 0.98-1.09x; 8 rows: 0.86x; in fp32, one row at a time was 0.66-1.1x).
template <typename T>
constexpr int rows_at_once(int M) {
    if constexpr (sizeof(T) == 2) return M <= 6 ? 1 : 2;
    return M <= 2 ? 8 : (M <= 4 ? 4 : 2);
}

// Keeps a loaded vector in its register. From three input rows on, GCC otherwise folds the weight loads into the
// FMAs (or dot products), loading each weight vector once per input row, and spills: 2x slower products at 4 and 8
// rows (fp32 and bf16).
// (The panel products below pin theirs from two rows on.)
template <int M, int From = 3, typename V>
__attribute__((always_inline)) inline void pin(V& v) {
#if defined(__AVX512F__)  // a register holds the whole vector only here
    if constexpr (M >= From) asm("" : "+v"(v));
#endif
}

template <int M, int N, typename V>
__attribute__((always_inline)) inline void zero(V (&acc)[M][N]) {
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
        for (int n = 0; n < N; ++n) acc[m][n] = V{};
}

// From two input rows on, the products take long enough per weight line that the hardware prefetcher falls behind:
// while R weight rows are multiplied, the R rows of the first block that starts at least kPrefetchBytes ahead are
// asked for (1.2x at 4 rows, 1.5x at 8, against none). Nearer than that was slower: bf16 steps at 7 and 8 rows, whose
// blocks of 2 rows span 2.3 KiB, ran 1.09-1.18x faster three blocks ahead than one; fp32 blocks already span 4.6 KiB
// or more, and going further ahead there was 0.93-0.99x (benchmarks/native_ab.py).
constexpr int64_t kPrefetchBytes = 8192;

// How many weight rows ahead of a block of R rows of K elements the prefetches go (once per product, not per block).
template <typename T>
inline int64_t rows_ahead(int R, int64_t K) {
    return R * std::max<int64_t>(1, kPrefetchBytes / (R * K * static_cast<int64_t>(sizeof(T))));
}

template <int M, int R, typename T>
__attribute__((always_inline)) inline void prefetch_next(const T* w, int64_t K, int64_t k, int64_t ahead) {
    if constexpr (M >= 2) {
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) __builtin_prefetch(w + (ahead + r) * K + k, 0, 3);
    }
}

// out[r] = the lane sum of acc[r] for R = 1, 2, 4 or 8 accumulators, always by sum4's tree (missing ones are zeros).
template <int R>
__attribute__((always_inline)) inline void reduce(const vec16 (&acc)[R], float* out) {
    if constexpr (R >= 4) {
#pragma GCC unroll 2
        for (int r = 0; r < R; r += 4) sum4(acc[r], acc[r + 1], acc[r + 2], acc[r + 3], out + r);
    } else {
        const vec16 zero = {};
        float sums[4];
        sum4(acc[0], R > 1 ? acc[R - 1] : zero, zero, zero, sums);
        out[0] = sums[0];
        if constexpr (R > 1) out[1] = sums[1];
    }
}

// out[m * R + r] = x[m] . w[r] for M input rows (stride xs) and R weight rows (stride K), each element widened to fp32
// (fp32 rows, and bf16 rows on CPUs without AVX512-BF16).
template <int M, int R, typename T>
__attribute__((always_inline)) inline void dot_widened(const T* x, int64_t xs, const T* w, int64_t K, int64_t ahead,
                                                       float* out) {
    vec16 acc[M][R];
    zero(acc);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        vec16 wv[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) pin<M>(wv[r] = load16(w + r * K + k));
        prefetch_next<M, R>(w, K, k, ahead);
        vec16 xv[M];
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) pin<M>(xv[m] = load16(x + m * xs + k));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
            for (int m = 0; m < M; ++m) acc[m][r] = fma16(xv[m], wv[r], acc[m][r]);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) reduce<R>(acc[m], out + m * R);
    for (; k < K; ++k)
        for (int m = 0; m < M; ++m)
            for (int r = 0; r < R; ++r) out[m * R + r] += to_float(x[m * xs + k]) * to_float(w[r * K + k]);
}

template <int M, int R>
__attribute__((always_inline)) inline void dot(const float* x, int64_t xs, const float* w, int64_t K, int64_t ahead,
                                               float* out) {
    dot_widened<M, R>(x, xs, w, K, ahead, out);
}

// bf16: pairs of products summed straight from the bf16 rows (vdpbf16ps; the products are exact in fp32).
template <int M, int R>
__attribute__((always_inline)) inline void dot(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t K,
                                               int64_t ahead, float* out) {
#if defined(__AVX512BF16__)
    __m512 acc[M][R];
    zero(acc);
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) pin<M>(wv[r] = (__m512bh)_mm512_loadu_si512(w + r * K + k));
        prefetch_next<M, R>(w, K, k, ahead);
        __m512bh xv[M];
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) pin<M>(xv[m] = (__m512bh)_mm512_loadu_si512(x + m * xs + k));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
            for (int m = 0; m < M; ++m) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv[m], wv[r]);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
        vec16 lanes[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) lanes[r] = (vec16)acc[m][r];
        reduce<R>(lanes, out + m * R);
    }
    for (; k < K; ++k)
        for (int m = 0; m < M; ++m)
            for (int r = 0; r < R; ++r) out[m * R + r] += to_float(x[m * xs + k]) * to_float(w[r * K + k]);
#else
    dot_widened<M, R>(x, xs, w, K, ahead, out);
#endif
}

// f(std::integral_constant<int, M>) for M in 1..kMaxRows: the kernels' row counts are compile-time constants.
template <typename F>
inline void with_rows(int M, F&& f) {
    switch (M) {
        case 1: f(std::integral_constant<int, 1>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        case 4: f(std::integral_constant<int, 4>{}); break;
        case 5: f(std::integral_constant<int, 5>{}); break;
        case 6: f(std::integral_constant<int, 6>{}); break;
        case 7: f(std::integral_constant<int, 7>{}); break;
        default: f(std::integral_constant<int, 8>{}); break;
    }
}

// f(m, n, x[m] . w[n]) for the output rows [n0, n1) of w ([N, K] row-major) and M input rows.
template <int M, typename T, typename F>
inline void product_rows(const T* x, int64_t xs, const T* w, int64_t K, int64_t n0, int64_t n1, F&& f) {
    constexpr int R = rows_at_once<T>(M);
    float out[M * R];
    int64_t n = n0;
    const int64_t ahead = rows_ahead<T>(R, K);
    for (; n + R <= n1; n += R) {
        dot<M, R>(x, xs, w + n * K, K, ahead, out);
        for (int m = 0; m < M; ++m)
            for (int r = 0; r < R; ++r) f(m, n + r, out[m * R + r]);
    }
    for (; n < n1; ++n) {
        dot<M, 1>(x, xs, w + n * K, K, rows_ahead<T>(1, K), out);
        for (int m = 0; m < M; ++m) f(m, n, out[m]);
    }
}

// The same for any M in 1..kMaxRows.
template <typename T, typename F>
inline void products(int M, const T* x, int64_t xs, const T* w, int64_t K, int64_t n0, int64_t n1, F&& f) {
    with_rows(M, [&](auto rows) { product_rows<decltype(rows)::value>(x, xs, w, K, n0, n1, f); });
}

// The decoder's own products read its weights packed in panels of kPanel output rows (`cpu_decoder.pack`): an fp32
// panel holds element (r, k) at k * kPanel + r, a bf16 panel at (k / 2) * 2 * kPanel + 2 * r + k % 2 (pairs of k, as
// vdpbf16ps takes them). For each k the panel gives a contiguous line of kPanel weights, multiplied by each input
// row's x[k] broadcast: no horizontal sums, one sequential weight stream, and the input rows read one scalar at a
// time, so that up to 8 rows cost about what one does. Each output is one fp32 lane summed over k in order (bf16: by
// pairs), whatever the number of rows: results do not depend on the batch. Against the dot products over plain rows
// above, SmolLM2-shaped fp32 products streamed from memory (2 threads) 1.1-1.3x faster at one row and 1.6-2.4x at
// eight, and whole decode steps at 8 sequences ran about 1.4x faster in both dtypes (benchmarks/decode.py).
constexpr int kPanel = 48;
constexpr int kPanelVectors = kPanel / 16;
constexpr int64_t kPanelAheadBytes = 8192;  // prefetch distance in the weight stream

// The three lines kPanelAheadBytes past this k's (fp32) or this pair of k's (bf16) 192 bytes.
__attribute__((always_inline)) inline void prefetch_panel(const void* w) {
    const char* line = static_cast<const char*>(w) + kPanelAheadBytes;
#pragma GCC unroll 4
    for (int j = 0; j < kPanelVectors; ++j) __builtin_prefetch(line + 64 * j, 0, 3);
}

// Whether the panel products prefetch their weight stream. On AMD's Zen 4 the hardware prefetcher keeps up by itself,
// and the prefetches made decode steps of 1-8 sequences 2-10% slower in both dtypes (native_ab.py, 24 of 24 cells).
inline bool prefetches_panels() {
    static const bool on = [] {
        __builtin_cpu_init();
        return !__builtin_cpu_is("amd");
    }();
    return on;
}

// out[m * kPanel + r] = x[m] . (row r of the fp32 panel p), for M input rows of K elements (stride xs); Ahead:
// prefetch the panel.
template <int M, bool Ahead>
__attribute__((always_inline)) inline void panel_rows(const float* x, int64_t xs, const float* p, int64_t K,
                                                      float* out) {
    vec16 acc[M][kPanelVectors];
    zero(acc);
    for (int64_t k = 0; k < K; ++k) {
        const float* w = p + k * kPanel;
        vec16 wv[kPanelVectors];
#pragma GCC unroll 4
        for (int j = 0; j < kPanelVectors; ++j) pin<M, 2>(wv[j] = load16(w + 16 * j));
        if constexpr (Ahead) prefetch_panel(w);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
            const vec16 xb = vec16{} + x[m * xs + k];
#pragma GCC unroll 4
            for (int j = 0; j < kPanelVectors; ++j) acc[m][j] = fma16(xb, wv[j], acc[m][j]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
        for (int j = 0; j < kPanelVectors; ++j) std::memcpy(out + m * kPanel + 16 * j, &acc[m][j], sizeof(vec16));
}

// The same for a bf16 panel (K even): vdpbf16ps on pairs of k where the CPU has it, else both products in fp32.
template <int M, bool Ahead>
__attribute__((always_inline)) inline void panel_rows(const uint16_t* x, int64_t xs, const uint16_t* p, int64_t K,
                                                      float* out) {
#if defined(__AVX512BF16__)
    __m512 acc[M][kPanelVectors];
    zero(acc);
    for (int64_t k = 0; k < K; k += 2) {
        const uint16_t* w = p + k * kPanel;
        __m512bh wv[kPanelVectors];
#pragma GCC unroll 4
        for (int j = 0; j < kPanelVectors; ++j) pin<M, 2>(wv[j] = (__m512bh)_mm512_loadu_si512(w + 32 * j));
        if constexpr (Ahead) prefetch_panel(w);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
            int32_t pair;
            std::memcpy(&pair, x + m * xs + k, sizeof pair);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
            for (int j = 0; j < kPanelVectors; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, wv[j]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
        for (int j = 0; j < kPanelVectors; ++j) _mm512_storeu_ps(out + m * kPanel + 16 * j, acc[m][j]);
#else
    vec16 acc[M][kPanelVectors];
    zero(acc);
    for (int64_t k = 0; k < K; k += 2) {
        const uint16_t* w = p + k * kPanel;
        for (int j = 0; j < kPanelVectors; ++j) {
            word16 pairs;
            std::memcpy(&pairs, w + 32 * j, sizeof pairs);
            const word16 even_bits = pairs << 16, odd_bits = pairs & 0xffff0000u;
            vec16 even, odd;
            std::memcpy(&even, &even_bits, sizeof even);
            std::memcpy(&odd, &odd_bits, sizeof odd);
            for (int m = 0; m < M; ++m) {
                acc[m][j] = fma16(vec16{} + to_float(x[m * xs + k]), even, acc[m][j]);
                acc[m][j] = fma16(vec16{} + to_float(x[m * xs + k + 1]), odd, acc[m][j]);
            }
        }
    }
    for (int m = 0; m < M; ++m)
        for (int j = 0; j < kPanelVectors; ++j) std::memcpy(out + m * kPanel + 16 * j, &acc[m][j], sizeof(vec16));
#endif
}

#if HF_PAGED_AVX2
// With AVX2's 16 registers of 8 floats a panel line takes 6 registers, and a row's sums 6 more: the kernels above
// (written for AVX-512's 32 registers of 16) spill from one row on. Here a panel is multiplied in blocks of
// kBlockK k's, small enough to stay in L1, two input rows at a time: the block is read from memory once and from L1
// for the further rows, and each row's sums go to `out` between blocks. Every sum still runs over k in order with
// one FMA per k (bf16: its pairs' weights widened to fp32 first), as in the kernels above.
constexpr int kBlockK = 64;
// Input rows per pass over a panel: a bf16 block is widened once for them all (with the block, their sums and their
// block of x, 19 KiB of L1).
constexpr int kChunkRows = 16;

// out[m * kPanel + r] (+)= x[m] . (row r of an fp32 panel block w of n k's) for M = 1 or 2 rows of x (stride xs);
// with `ahead`, the weight stream's next block (ahead_step bytes per k) is asked for meanwhile.
template <int M>
__attribute__((always_inline)) inline void panel_block(const float* x, int64_t xs, const float* w, int64_t n,
                                                       bool first, const char* ahead, int64_t ahead_step, float* out) {
    constexpr int V = kPanel / 8;
    __m256 acc[M][V];
#pragma GCC unroll 2
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 6
        for (int j = 0; j < V; ++j)
            acc[m][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + m * kPanel + 8 * j);
    for (int64_t k = 0; k < n; ++k) {
        __m256 xb[M];
#pragma GCC unroll 2
        for (int m = 0; m < M; ++m) xb[m] = _mm256_broadcast_ss(x + m * xs + k);
        if (ahead) {
#pragma GCC unroll 3
            for (int j = 0; j < 3; ++j) __builtin_prefetch(ahead + k * ahead_step + 64 * j, 0, 3);
        }
#pragma GCC unroll 6
        for (int j = 0; j < V; ++j) {
            __m256 wv = _mm256_loadu_ps(w + k * kPanel + 8 * j);
            asm("" : "+x"(wv));  // in a register for all M rows: GCC otherwise reloads it for each
#pragma GCC unroll 2
            for (int m = 0; m < M; ++m) acc[m][j] = _mm256_fmadd_ps(xb[m], wv, acc[m][j]);
        }
    }
#pragma GCC unroll 2
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 6
        for (int j = 0; j < V; ++j) _mm256_storeu_ps(out + m * kPanel + 8 * j, acc[m][j]);
}

// The fp32 weights of block [k0, k0 + n) of a panel: the panel itself (fp32), or widened into buf (bf16, whose
// panel keeps pairs of k's interleaved).
inline const float* block_weights(const float* panel, int64_t k0, int64_t, float*) { return panel + k0 * kPanel; }
inline const float* block_weights(const uint16_t* panel, int64_t k0, int64_t n, float* buf) {
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    for (int64_t k = 0; k < n; k += 2) {
        const uint16_t* pair = panel + (k0 + k) * kPanel;
#pragma GCC unroll 6
        for (int j = 0; j < kPanel / 8; ++j) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + 16 * j));
            _mm256_storeu_ps(buf + k * kPanel + 8 * j, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
            _mm256_storeu_ps(buf + (k + 1) * kPanel + 8 * j, _mm256_castsi256_ps(_mm256_and_si256(v, high)));
        }
    }
    return buf;
}

// Rows [0, rows) of x at columns [k0, k0 + n) as fp32: x itself (fp32, stride xs) or widened into buf (stride kBlockK).
inline const float* block_rows(const float* x, int64_t xs, int, int64_t k0, int64_t, float*, int64_t& stride) {
    stride = xs;
    return x + k0;
}
inline const float* block_rows(const uint16_t* x, int64_t xs, int rows, int64_t k0, int64_t n, float* buf,
                               int64_t& stride) {
    stride = kBlockK;
    for (int m = 0; m < rows; ++m) {
        const uint16_t* row = x + m * xs + k0;
        int64_t k = 0;
        for (; k + 8 <= n; k += 8) {
            const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
            _mm256_storeu_ps(buf + m * kBlockK + k, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
        }
        for (; k < n; ++k) buf[m * kBlockK + k] = to_float(row[k]);
    }
    return buf;
}

// out[m * kPanel + r] = x[m] . (row r of panel) for rows <= kChunkRows rows of x (stride xs), K elements each.
template <typename T>
inline void panel_rows_blocked(int rows, const T* x, int64_t xs, const T* panel, int64_t K, float* out) {
    alignas(64) float wbuf[kBlockK * kPanel], xbuf[kChunkRows * kBlockK];
    for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
        const int64_t n = std::min<int64_t>(kBlockK, K - k0);
        int64_t stride;
        const float* wb = block_weights(panel, k0, n, wbuf);
        const float* xb = block_rows(x, xs, rows, k0, n, xbuf, stride);
        // bf16 asks for the next block while it multiplies this one (its widening slows the stream down: steps of
        // 1-8 rows 1.1-1.3x faster); fp32 was as fast or faster without (benchmarks/native_ab.py)
        const char* ahead = sizeof(T) == 2 ? reinterpret_cast<const char*>(panel + (k0 + kBlockK) * kPanel) : nullptr;
        const int64_t step = kPanel * sizeof(T);
        const bool first = k0 == 0;
        int m = 0;
        for (; m + 2 <= rows; m += 2)
            panel_block<2>(xb + m * stride, stride, wb, n, first, m == 0 ? ahead : nullptr, step, out + m * kPanel);
        if (m < rows)
            panel_block<1>(xb + m * stride, stride, wb, n, first, m == 0 ? ahead : nullptr, step, out + m * kPanel);
    }
}
#endif

// f(m, n, x[m] . w[n]) for the output rows [n0, n0 + count) of one panel of a packed weight and input rows [0, M):
// kMaxRows rows (AVX2: kChunkRows) at a time, so that the panel is read from memory once and from the cache for the
// further rows.
template <typename T, typename F>
inline void vector_rows(int M, const T* x, int64_t xs, const T* panel, int64_t K, int64_t n0, int64_t count, F&& f) {
#if HF_PAGED_AVX2
    constexpr int chunk = kChunkRows;
#else
    constexpr int chunk = kMaxRows;
#endif
    float out[chunk * kPanel];
    [[maybe_unused]] const bool ahead = prefetches_panels();
    for (int m0 = 0; m0 < M; m0 += chunk) {
        const int rows = std::min(chunk, M - m0);
#if HF_PAGED_AVX2
        panel_rows_blocked(rows, x + m0 * xs, xs, panel, K, out);
#else
        with_rows(rows, [&](auto R) {
            if (ahead)
                panel_rows<decltype(R)::value, true>(x + m0 * xs, xs, panel, K, out);
            else
                panel_rows<decltype(R)::value, false>(x + m0 * xs, xs, panel, K, out);
        });
#endif
        for (int m = 0; m < rows; ++m)
            for (int64_t r = 0; r < count; ++r) f(m0 + m, n0 + r, out[m * kPanel + r]);
    }
}

#if HF_PAGED_AMX
// With AMX (Sapphire Rapids on), bf16 prompt rows are multiplied by tiles of kTileRows rows: per 32 k's, one tile of
// x, three of the panel (a bf16 panel's 16 pairs of k for 16 outputs are a tile's rows, 192 bytes apart) and three
// products into the tiles of the panel's 48 sums. AMX sums in another order than vdpbf16ps, so the rows of generated
// tokens (decode steps, speculative guesses, a preempted sequence's recomputed output) stay on the vector kernels,
// which sum a row alike whatever its batch: tokens do not depend on how the decoder's steps were batched, chunked or
// speculated. Prompt rows, computed only ever by tiles, are the same in any step too. Streaming weights for a few rows, tiles were
// slower (bf16 decode steps of one sequence 0.95x); from 16 rows on they multiply several times faster.
constexpr int kTileRows = 16;
constexpr int64_t kTileK = 32;

// out[m * kPanel + r] = x[m] . (row r of the bf16 panel p) for kTileRows rows of x (stride xs), K % kTileK == 0.
// Tiles 0-2: the sums; 3: x (16 rows of 32 bf16); 4-6: the panel (16 pairs of k of 16 outputs).
inline void panel_tiles(const uint16_t* x, int64_t xs, const uint16_t* p, int64_t K, float* out) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t k = 0; k < K; k += kTileK) {
        const uint16_t* w = p + k * kPanel;
        const char* ahead = reinterpret_cast<const char*>(w) + kPanelAheadBytes;
#pragma GCC unroll 48
        for (int j = 0; j < 48; ++j) __builtin_prefetch(ahead + 64 * j, 0, 3);  // the next 32 k's: 48 lines
        _tile_loadd(3, x + k, xs * 2);
        _tile_loadd(4, w, 4 * kPanel);
        _tile_loadd(5, w + 32, 4 * kPanel);
        _tile_loadd(6, w + 64, 4 * kPanel);
        _tile_dpbf16ps(0, 3, 4);
        _tile_dpbf16ps(1, 3, 5);
        _tile_dpbf16ps(2, 3, 6);
    }
    _tile_stored(0, out, kPanel * 4);
    _tile_stored(1, out + 16, kPanel * 4);
    _tile_stored(2, out + 32, kPanel * 4);
}

// Rows [m0, m0 + rows) of x, all prompt rows (tiles) or none (vector kernels); a tile's rows are x's own, or a copy
// of the last few rows of a run followed by rows whose sums are never read.
struct RowBlock {
    int m0, rows;
    bool tiled;
    const uint16_t* x;
    int64_t xs;
};

// The blocks of M rows of x whose prompt[m] says which are prompt rows; the copies go to `padded`.
inline void row_blocks(int M, const uint16_t* x, int64_t xs, int64_t K, const uint8_t* prompt,
                       std::vector<RowBlock>& blocks, std::vector<uint16_t>& padded) {
    blocks.clear();
    int short_runs = 0;
    for (int m0 = 0, m1; m0 < M; m0 = m1) {
        for (m1 = m0 + 1; m1 < M && prompt[m1] == prompt[m0];) ++m1;
        short_runs += prompt[m0] && (m1 - m0) % kTileRows;
    }
    if (padded.size() < static_cast<size_t>(short_runs * kTileRows * K)) padded.resize(short_runs * kTileRows * K);
    uint16_t* copy = padded.data();
    for (int m0 = 0, m1; m0 < M; m0 = m1) {
        for (m1 = m0 + 1; m1 < M && prompt[m1] == prompt[m0];) ++m1;
        if (!prompt[m0]) {
            blocks.push_back({m0, m1 - m0, false, x + m0 * xs, xs});
            continue;
        }
        int m = m0;
        for (; m + kTileRows <= m1; m += kTileRows) blocks.push_back({m, kTileRows, true, x + m * xs, xs});
        if (m == m1) continue;
        for (int r = m; r < m1; ++r) std::copy(x + r * xs, x + r * xs + K, copy + (r - m) * K);
        blocks.push_back({m, m1 - m, true, copy, K});
        copy += kTileRows * K;
    }
}

// panel_products (below) for bf16 rows of which some are prompt rows.
template <typename F>
void tile_products(int M, const uint16_t* x, int64_t xs, const uint16_t* w, int64_t K, int64_t N, int64_t p0,
                   int64_t p1, const uint8_t* prompt, F&& f) {
    if (p0 >= p1) return;
    thread_local std::vector<RowBlock> blocks;
    thread_local std::vector<uint16_t> padded;
    row_blocks(M, x, xs, K, prompt, blocks, padded);
    alignas(64) float out[kTileRows * kPanel];
    configure_tiles();
    for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * kPanel, count = std::min<int64_t>(kPanel, N - n0);
        const uint16_t* panel = w + p * kPanel * K;
        for (const RowBlock& b : blocks) {
            if (!b.tiled) {
                vector_rows(b.rows, b.x, b.xs, panel, K, n0, count,
                            [&](int m, int64_t n, float v) { f(b.m0 + m, n, v); });
                continue;
            }
            panel_tiles(b.x, b.xs, panel, K, out);
            for (int m = 0; m < b.rows; ++m)
                for (int64_t r = 0; r < count; ++r) f(b.m0 + m, n0 + r, out[m * kPanel + r]);
        }
    }
    _tile_release();
}
#endif

// f(m, n, x[m] . w[n]) for the output rows of panels [p0, p1) of a packed weight of N rows and M input rows, M up to
// kMaxTokens, panel by panel (vector_rows). Decode steps of 12 to 64 sequences ran 1.10-1.88x faster this way than
// through the Transformers forward with oneDNN's packed weights (SmolLM2, fp32 and bf16, benchmarks/decode.py,
// AVX-512). ``prompt`` (or null) marks the prompt rows, which AMX multiplies where the CPU has it.
template <typename T, typename F>
inline void panel_products(int M, const T* x, int64_t xs, const T* w, int64_t K, int64_t N, int64_t p0, int64_t p1,
                           F&& f, const uint8_t* prompt = nullptr) {
#if HF_PAGED_AMX
    if constexpr (sizeof(T) == 2) {
        if (prompt && K % kTileK == 0 && amx_granted()) return tile_products(M, x, xs, w, K, N, p0, p1, prompt, f);
    }
#endif
    for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * kPanel;
        vector_rows(M, x, xs, w + p * kPanel * K, K, n0, std::min<int64_t>(kPanel, N - n0), f);
    }
}

inline int64_t panels(int64_t N) { return (N + kPanel - 1) / kPanel; }

// This thread's share of P panels: contiguous.
inline void share_panels(int64_t P, int64_t& p0, int64_t& p1) {
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    p0 = P * t / threads;
    p1 = P * (t + 1) / threads;
}

// This thread's share of N output rows: contiguous, in multiples of 8 rows.
inline void share(int64_t N, int64_t& n0, int64_t& n1) {
    const int64_t blocks = (N + 7) / 8, t = omp_get_thread_num(), threads = omp_get_num_threads();
    n0 = std::min(N, blocks * t / threads * 8);
    n1 = std::min(N, blocks * (t + 1) / threads * 8);
}

inline float bias_at(const float* b, int64_t n) { return b ? b[n] : 0.0f; }
inline float bias_at(const uint16_t* b, int64_t n) { return b ? to_float(b[n]) : 0.0f; }

// What storing a float into T keeps of it (identity for fp32, bf16 rounding for bf16).
template <typename T>
inline float rounded(float x) {
    T t;
    store(&t, x);
    return to_float(t);
}

// Transformers' RMSNorm: x * rsqrt(mean(x^2) + eps) in fp32, rounded to T, times the weight (then rounded).
template <typename T>
void rms_norm(const T* x, const T* weight, int n, float eps, T* out) {
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) {
        const float v = to_float(x[i]);
        sum += v * v;
    }
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
    for (int i = 0; i < n; ++i) store(out + i, to_float(weight[i]) * rounded<T>(to_float(x[i]) * inv));
}

// Rotary embedding of one head in place, as Transformers' apply_rotary_pos_emb: x * cos + rotate_half(x) * sin.
template <typename T>
void rotate(T* x, const T* cos, const T* sin, int D) {
    const int h = D / 2;
    float rotated[512];
    for (int i = 0; i < D; ++i) {
        const float other = i < h ? -to_float(x[i + h]) : to_float(x[i - h]);
        rotated[i] = rounded<T>(rounded<T>(to_float(x[i]) * to_float(cos[i])) + rounded<T>(other * to_float(sin[i])));
    }
    for (int i = 0; i < D; ++i) store(x + i, rotated[i]);
}

typedef int32_t int16v __attribute__((vector_size(64)));

// e^x in every lane, within about 1 ulp of the true value (Cephes' expf: x = n ln 2 + r with ln 2 split in two, a
// polynomial in r, then 2^n put into exponent bits). Lanes beyond float's range give inf (x > ln of the
// largest float) or the smallest normal float (x below ln of it). Vectorised, SiLU's exponentials cost about a tenth
// of libm's one at a time: bf16 decode steps of 8 sequences ran 1.15x faster without them at all.
inline vec16 exp16(vec16 x) {
    const vec16 top = vec16{} + 88.72283905206835f, bottom = vec16{} - 87.33654475055310898657f;
    const int16v overflow = x > top;
    x = x > top ? top : x;
    x = x < bottom ? bottom : x;
    const vec16 t = x * 1.44269504088896341f + 0.5f;
    vec16 n = __builtin_convertvector(__builtin_convertvector(t, int16v), vec16);
    n = n > t ? n - 1.0f : n;  // floor
    const vec16 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    vec16 p = vec16{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    // 2^n as two exact factors, since n reaches 128 near the top of the range
    const int16v whole = __builtin_convertvector(n, int16v), half = whole >> 1;
    const int16v bits_a = (half + 127) << 23, bits_b = (whole - half + 127) << 23;
    vec16 a, b;
    std::memcpy(&a, &bits_a, sizeof a);
    std::memcpy(&b, &bits_b, sizeof b);
    const vec16 inf = vec16{} + __builtin_inff();
    return overflow ? inf : p * a * b;
}

// Transformers' SiLU, x / (1 + e^-x), in every lane (NaN stays NaN).
inline vec16 silu16(vec16 x) {
    const vec16 y = x / (1.0f + exp16(-x));
    return x != x ? x : y;
}

inline void store16(float* dst, vec16 v) { std::memcpy(dst, &v, sizeof v); }
inline void store16(uint16_t* dst, vec16 v) {  // as `store`, lane by lane: nearest even, NaN as 0x7fc0
    word16 bits;
    std::memcpy(&bits, &v, sizeof bits);
    const word16 nan = ((bits & 0x7f800000u) == 0x7f800000u) & ((bits & 0x007fffffu) != 0u);
    const word16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const half16 out = __builtin_convertvector(nan ? word16{} + 0x7fc0u : rounded, half16);
    std::memcpy(dst, &out, sizeof out);
}

// a[t * stride + n] = silu(a[t * stride + n]) for rows [0, rows) and columns [n0, n1), 16 at a time (a last partial
// run through the same lanes, so that a value's result never depends on where it sits).
template <typename T>
void silu_rows(T* a, int rows, int64_t stride, int64_t n0, int64_t n1) {
    for (int t = 0; t < rows; ++t) {
        T* row = a + t * stride;
        int64_t n = n0;
        for (; n + 16 <= n1; n += 16) store16(row + n, silu16(load16(row + n)));
        if (n < n1) {
            T part[16] = {};
            std::copy(row + n, row + n1, part);
            store16(part, silu16(load16(part)));
            std::copy(part, part + (n1 - n), row + n);
        }
    }
}

}  // namespace

struct DecoderLayer {
    const void *input_norm, *post_norm, *q_norm, *k_norm;  // q_norm / k_norm: per-head norms (Qwen3) or null
    const void *q, *k, *v, *o, *gate, *up, *down;  // weights in panels (see kPanel)
    const void *q_bias, *k_bias, *v_bias, *o_bias, *gate_bias, *up_bias, *down_bias;  // or null
    void *k_cache, *v_cache;
    float scale;  // softmax scale
    int32_t sliding_window;  // <= 0: none
};

// One linear layer's LoRA adapters in a step, side by side (hf_paged.lora): A [rank, in] and B transposed,
// [rank, out], in the model's dtype; adapter a's rows of them start at offsets[a], ranks[a] of them (0: it leaves the
// layer alone), and scale it by scales[a].
struct LoraLinear {
    const void *a, *bt;
    const int32_t *offsets, *ranks;
    const float* scales;
    int32_t rank;  // A's rows
};

struct DecoderModel {
    const DecoderLayer* layers;
    const void *final_norm, *lm_head, *lm_head_bias;  // lm_head in panels
    int64_t c_stride_block, c_stride_row, c_stride_head;  // the layers' caches, as in Problem
    int32_t num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, vocab_size;
    int32_t block_size, num_blocks;
    float eps;  // every norm's
    int32_t dtype;  // 0: fp32, 1: bf16
};

struct DecoderStep {
    void* hidden;  // [T, hidden]: the tokens' embeddings in, the last layer's output out
    const void *cos, *sin;  // [T, head_dim]
    const int32_t* query_start_loc;  // as in Problem
    const int32_t* block_tables;
    int64_t bt_stride;
    const int32_t* seq_lens;
    const int64_t* slot_mapping;
    const int64_t* sample_rows;  // [num_samples]: the token rows whose logits are wanted
    const int32_t* prompt_lens;  // [num_seqs] or null: a sequence's positions below its prompt length are the prompt's
    void* logits;  // [num_samples, vocab]
    const LoraLinear* lora;  // [num_layers * 7] (q, k, v, o, gate, up, down), or null: no token has an adapter
    const int32_t* lora_slots;  // [num_tokens]: each token's adapter (its index in the LoraLinears), -1 for none
    int32_t num_tokens, num_seqs, bt_width, num_samples, num_threads;
};

namespace {

template <typename T>
struct Forward {
    const DecoderModel& m;
    const DecoderStep& s;
    const int L, H, I, D, Hq, Hkv, width;  // tokens, sizes; width: one token's row of q, k and v
    std::vector<T> xn, qkv, attn, act;
    // Where a token has an adapter: three linear layers' lora_A(x) and lora_B(lora_A(x)) of every token (lora_inputs,
    // lora_outputs), each layer's of lora_stride and out_stride floats.
    std::vector<float> lora_h, lora_d;
    int64_t lora_stride = 0, out_stride = 0;
    std::vector<uint8_t> prompt_rows;  // per token: whether it is a prompt token
    const uint8_t* prompt = nullptr;  // prompt_rows, where any token is one

    Forward(const DecoderModel& model, const DecoderStep& step)
        : m(model), s(step), L(step.num_tokens), H(model.hidden_size), I(model.intermediate_size),
          D(model.head_dim), Hq(model.num_heads), Hkv(model.num_kv_heads), width((Hq + 2 * Hkv) * D),
          xn(static_cast<size_t>(L) * H), qkv(static_cast<size_t>(L) * width), attn(static_cast<size_t>(L) * Hq * D),
          act(static_cast<size_t>(L) * I) {
        if (!s.lora) return;
        int rank = 0;
        for (int i = 0; i < 7 * m.num_layers; ++i) rank = std::max(rank, s.lora[i].rank);
        lora_stride = static_cast<int64_t>(L) * rank;
        out_stride = static_cast<int64_t>(L) * std::max<int64_t>({H, I, Hq * D, Hkv * D});
        lora_h.resize(3 * lora_stride);
        lora_d.resize(3 * out_stride);
    }

    T* hidden() const { return static_cast<T*>(s.hidden); }

    void norm_rows(const void* weight) {
#pragma omp for
        for (int t = 0; t < L; ++t) rms_norm(hidden() + t * H, static_cast<const T*>(weight), H, m.eps, xn.data() + t * H);
    }

    // The adapters of linear layer j (0-6: q, k, v, o, gate, up, down) of `layer` in this step, or null.
    const LoraLinear* lora_of(const DecoderLayer& layer, int j) const {
        const LoraLinear* lora = s.lora ? s.lora + (&layer - m.layers) * 7 + j : nullptr;
        return lora && lora->rank > 0 ? lora : nullptr;
    }

    float* lora_buffer(int i) { return lora_h.data() + i * lora_stride; }
    float* lora_out_buffer(int i) { return lora_d.data() + i * out_stride; }

    // h[t * rank + c] = lora_A(x[t]) in each token's adapter's columns c (rounded to T, as PEFT's), for x [L, K]: the
    // threads share the tokens' columns, 8 at a time, and go on without waiting (see lora_wait).
    void lora_inputs(const LoraLinear* lora, const T* x, int64_t K, float* h) {
        if (!lora) return;
        const T* a = static_cast<const T*>(lora->a);
        const int R = lora->rank, groups = (R + 7) / 8;
#pragma omp for schedule(static) nowait
        for (int i = 0; i < L * groups; ++i) {
            const int t = i / groups, slot = s.lora_slots[t];
            if (slot < 0) continue;
            const int c0 = lora->offsets[slot] + i % groups * 8;
            const int c1 = std::min(c0 + 8, lora->offsets[slot] + lora->ranks[slot]);
            if (c0 < c1)
                products(1, x + t * K, K, a, K, c0, c1, [&](int, int64_t c, float v) { h[t * R + c] = rounded<T>(v); });
        }
    }

    // Every thread waits for the others' lora_inputs, where any of them ran (`any`: the same in every thread).
    void lora_wait(bool any) {
        if (any) {
#pragma omp barrier
        }
    }

    // d[t * N + n] = lora_B(h[t]) * scaling for the outputs [n0, n1) of a layer of N, each rounded to T as PEFT's, for
    // each token of an adapter that changes the layer; each output summed over the adapter's rank in order, 16 outputs
    // side by side (rows of B^T).
    void lora_outputs(const LoraLinear* lora, const float* h, int64_t N, int64_t n0, int64_t n1, float* d) {
        if (!lora) return;
        const T* bt = static_cast<const T*>(lora->bt);
        for (int t = 0; t < L; ++t) {
            const int slot = s.lora_slots[t];
            if (slot < 0 || lora->ranks[slot] == 0) continue;
            const int c0 = lora->offsets[slot], c1 = c0 + lora->ranks[slot];
            const float* ht = h + t * lora->rank;
            for (int64_t n = n0; n < n1; n += 16) {
                const int64_t count = std::min<int64_t>(16, n1 - n);
                vec16 sum = {};
                for (int c = c0; c < c1; ++c) sum = sum + ht[c] * load_part(bt + c * N + n, count);
                const vec16 out = round16(round16(sum) * lora->scales[slot]);
                std::memcpy(d + t * N + n, &out, count * sizeof(float));
            }
        }
    }

    static vec16 load_part(const T* p, int64_t count) {
        if (count == 16) return load16(p);
        T part[16] = {};
        std::copy(p, p + count, part);
        return load16(part);
    }

    static vec16 round16(vec16 v) {  // each lane rounded to T, as `store` rounds
        if constexpr (sizeof(T) == sizeof(float)) {
            return v;
        } else {
            T rounded[16];
            store16(rounded, v);
            return load16(rounded);
        }
    }

    // f(t, n, y) for the outputs n of panels [p0, p1) of a linear layer (N outputs of K inputs, weight w in panels) on
    // x [L, K]: y = x[t] . w[n] + bias[n], and for a token whose adapter changes the layer (lora: its lora_A(x) in
    // lora_buffer(i)), as PEFT's LoRA layer returns it, y rounded to T + lora_B(lora_A(x)) * scaling (lora_outputs,
    // into lora_out_buffer(i)). Without adapters on the layer, the products alone.
    template <typename F>
    void linear_outputs(const T* x, int64_t K, const void* w, const void* b, int64_t N, int64_t p0, int64_t p1,
                        const LoraLinear* lora, int i, F&& f) {
        const T *weight = static_cast<const T*>(w), *bias = static_cast<const T*>(b);
        if (!lora) {
            panel_products(L, x, K, weight, K, N, p0, p1,
                           [&](int t, int64_t n, float v) { f(t, n, v + bias_at(bias, n)); }, prompt);
            return;
        }
        float* d = lora_out_buffer(i);
        lora_outputs(lora, lora_buffer(i), N, p0 * kPanel, std::min<int64_t>(N, p1 * kPanel), d);
        panel_products(L, x, K, weight, K, N, p0, p1, [&](int t, int64_t n, float v) {
            const int slot = s.lora_slots[t];
            const float y = v + bias_at(bias, n);
            f(t, n, slot < 0 || lora->ranks[slot] == 0 ? y : rounded<T>(y) + d[t * N + n]);
        }, prompt);
    }

    // q, k and v of every token into qkv, one product over their rows together; then per-head norms and rotary.
    void project_qkv(const DecoderLayer& layer) {
        norm_rows(layer.input_norm);
        const int64_t nq = Hq * D, nk = Hkv * D;
        const int64_t sizes[3] = {nq, nk, nk}, offsets[3] = {0, nq, nq + nk};
        const int64_t firsts[4] = {0, panels(nq), panels(nq) + panels(nk), panels(nq) + 2 * panels(nk)};
        int64_t p0, p1;
        share_panels(firsts[3], p0, p1);
        const void* weights[3] = {layer.q, layer.k, layer.v};
        const void* biases[3] = {layer.q_bias, layer.k_bias, layer.v_bias};
        for (int j = 0; j < 3; ++j) lora_inputs(lora_of(layer, j), xn.data(), H, lora_buffer(j));
        lora_wait(lora_of(layer, 0) || lora_of(layer, 1) || lora_of(layer, 2));
        for (int j = 0; j < 3; ++j) {
            const int64_t a = std::max(p0, firsts[j]), b = std::min(p1, firsts[j + 1]);
            if (a >= b) continue;
            T* out = qkv.data() + offsets[j];
            linear_outputs(xn.data(), H, weights[j], biases[j], sizes[j], a - firsts[j], b - firsts[j],
                           lora_of(layer, j), j, [&](int t, int64_t n, float y) { store(out + t * width + n, y); });
        }
#pragma omp barrier
#pragma omp for
        for (int i = 0; i < L * (Hq + Hkv); ++i) {
            const int t = i / (Hq + Hkv), head = i % (Hq + Hkv);
            T* x = qkv.data() + t * width + head * D;
            const void* norm = head < Hq ? layer.q_norm : layer.k_norm;
            if (norm) rms_norm(x, static_cast<const T*>(norm), D, m.eps, x);
            rotate(x, static_cast<const T*>(s.cos) + t * D, static_cast<const T*>(s.sin) + t * D, D);
        }
    }

    Problem problem(const DecoderLayer& layer) {
        Problem p{};
        p.query = qkv.data();
        p.q_stride_token = width;
        p.q_stride_head = D;
        p.query_start_loc = s.query_start_loc;
        p.k_cache = layer.k_cache;
        p.v_cache = layer.v_cache;
        p.c_stride_block = m.c_stride_block;
        p.c_stride_row = m.c_stride_row;
        p.c_stride_head = m.c_stride_head;
        p.block_tables = s.block_tables;
        p.bt_stride = s.bt_stride;
        p.seq_lens = s.seq_lens;
        p.out = attn.data();
        p.num_seqs = s.num_seqs;
        p.num_heads = Hq;
        p.num_kv_heads = Hkv;
        p.head_dim = D;
        p.block_size = m.block_size;
        p.num_tokens = L;
        p.num_blocks = m.num_blocks;
        p.bt_width = s.bt_width;
        p.scale = layer.scale;
        p.sliding_window = layer.sliding_window;
        p.num_threads = s.num_threads;
        p.key = qkv.data() + Hq * D;
        p.value = qkv.data() + (Hq + Hkv) * D;
        p.k_stride_token = p.v_stride_token = width;
        p.k_stride_head = p.v_stride_head = D;
        p.slot_mapping = s.slot_mapping;
        p.prompt_rows = prompt;
        return p;
    }

    // hidden[t, n] += (x[t] . w[n] + bias[n]), rounded as residual + module output.
    void add_product(const void* w, const void* b, const T* x, int64_t K, int64_t N, const LoraLinear* lora) {
        lora_inputs(lora, x, K, lora_buffer(0));
        lora_wait(lora);
        int64_t p0, p1;
        share_panels(panels(N), p0, p1);
        T* h = hidden();
        linear_outputs(x, K, w, b, N, p0, p1, lora, 0, [&](int t, int64_t n, float y) {
            store(h + t * N + n, to_float(h[t * N + n]) + rounded<T>(y));
        });
    }

    // After attention: the output projection into the residual stream, then the MLP.
    void finish_layer(const DecoderLayer& layer) {
        add_product(layer.o, layer.o_bias, attn.data(), Hq * D, H, lora_of(layer, 3));
#pragma omp barrier
        norm_rows(layer.post_norm);
        const LoraLinear *gate_lora = lora_of(layer, 4), *up_lora = lora_of(layer, 5);
        lora_inputs(gate_lora, xn.data(), H, lora_buffer(1));
        lora_inputs(up_lora, xn.data(), H, lora_buffer(2));
        lora_wait(gate_lora || up_lora);
        int64_t p0, p1;
        share_panels(panels(I), p0, p1);
        T* a = act.data();
        linear_outputs(xn.data(), H, layer.gate, layer.gate_bias, I, p0, p1, gate_lora, 1,
                       [&](int t, int64_t n, float y) { store(a + t * I + n, y); });  // rounded, as the gate's output
        silu_rows(a, L, I, std::min<int64_t>(I, p0 * kPanel), std::min<int64_t>(I, p1 * kPanel));
        linear_outputs(xn.data(), H, layer.up, layer.up_bias, I, p0, p1, up_lora, 2, [&](int t, int64_t n, float y) {
            store(a + t * I + n, to_float(a[t * I + n]) * rounded<T>(y));
        });
#pragma omp barrier
        add_product(layer.down, layer.down_bias, act.data(), I, H, lora_of(layer, 6));
    }

    void logits() {
        const int S = s.num_samples;
#pragma omp for
        for (int i = 0; i < S; ++i)
            rms_norm(hidden() + s.sample_rows[i] * H, static_cast<const T*>(m.final_norm), H, m.eps, xn.data() + i * H);
        if (S == 0) return;  // every thread alike, after the barrier
        const int64_t V = m.vocab_size;
        int64_t p0, p1;
        share_panels(panels(V), p0, p1);
        const T* bias = static_cast<const T*>(m.lm_head_bias);
        T* out = static_cast<T*>(s.logits);
        panel_products(S, xn.data(), H, static_cast<const T*>(m.lm_head), H, V, p0, p1,
                       [&](int i, int64_t n, float v) { store(out + i * V + n, v + bias_at(bias, n)); });
    }

    // After check_attention: the step's query_start_loc and seq_lens are in range.
    void mark_prompt_rows() {
        if (!s.prompt_lens) return;
        prompt_rows.assign(L, 0);
        bool any = false;
        for (int i = 0; i < s.num_seqs; ++i) {
            const int q0 = s.query_start_loc[i], q1 = s.query_start_loc[i + 1], first = s.seq_lens[i] - (q1 - q0);
            for (int t = q0; t < q1; ++t) any |= prompt_rows[t] = first + (t - q0) < s.prompt_lens[i];
        }
        prompt = any ? prompt_rows.data() : nullptr;
    }

    // One parallel region for the whole step; every layer's attention reads the same indices, checked once.
    int run() {
        if (const int status = check_attention(problem(m.layers[0]))) return status;
        mark_prompt_rows();
#pragma omp parallel num_threads(s.num_threads)
        {
            for (int l = 0; l < m.num_layers; ++l) {
                if (l > 0) {
                    finish_layer(m.layers[l - 1]);
#pragma omp barrier
                }
                project_qkv(m.layers[l]);
                attention_in_team(problem(m.layers[l]), m.dtype);
            }
            finish_layer(m.layers[m.num_layers - 1]);
#pragma omp barrier
            logits();
        }
        return 0;
    }
};

template <typename T>
void linear(const T* x, int64_t xs, int M, int64_t K, const T* w, const T* bias, T* y, int64_t ys, int64_t N,
            int threads) {
#pragma omp parallel num_threads(threads)
    {
        int64_t n0, n1;
        share(N, n0, n1);
        products(M, x, xs, w, K, n0, n1, [&](int m, int64_t n, float v) { store(y + m * ys + n, v + bias_at(bias, n)); });
    }
}

}  // namespace

// y[m, n] = x[m] . w[n] + bias[n] for M <= 8 rows (bias may be null); dtype 0: fp32, 1: bf16. 0 on success.
extern "C" int hf_paged_linear(const void* x, int64_t x_stride, int32_t M, int64_t K, const void* w, const void* bias,
                               void* y, int64_t y_stride, int64_t N, int32_t dtype, int32_t num_threads) {
    if (M < 1 || M > kMaxRows) return 1;
    if (dtype == 0)
        linear(static_cast<const float*>(x), x_stride, M, K, static_cast<const float*>(w),
               static_cast<const float*>(bias), static_cast<float*>(y), y_stride, N, num_threads);
    else if (dtype == 1)
        linear(static_cast<const uint16_t*>(x), x_stride, M, K, static_cast<const uint16_t*>(w),
               static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), y_stride, N, num_threads);
    else
        return 2;
    return 0;
}

// The decoder stack and the logits of the sampled rows for one step of <= kMaxTokens tokens. 0 on success, else the
// attention kernel's status (cpu_ops.py names them) or 1 (bad sizes) / 2 (bad dtype).
extern "C" int hf_paged_decoder_forward(const DecoderModel* m, const DecoderStep* s) {
    if (s->num_tokens < 1 || s->num_tokens > kMaxTokens || s->num_samples > s->num_tokens || m->head_dim > 512 ||
        m->num_layers < 1)
        return 1;
    if (m->dtype == 0) return Forward<float>(*m, *s).run();
    if (m->dtype == 1) return Forward<uint16_t>(*m, *s).run();
    return 2;
}

extern "C" int hf_paged_decoder_struct_sizes(int which) {
    return which == 0   ? sizeof(DecoderLayer)
           : which == 1 ? sizeof(DecoderModel)
           : which == 2 ? sizeof(DecoderStep)
                        : sizeof(LoraLinear);
}

extern "C" int hf_paged_max_rows() { return kMaxRows; }

// The rows up to which hf_paged_linear streams a plain weight faster than oneDNN's packed GEMM: with AVX2 alone,
// SmolLM2's layers at 4 and 8 rows ran 0.8x and 0.46x oneDNN's speed (1 and 2 rows: 1.15x), else all of kMaxRows.
extern "C" int hf_paged_linear_rows() { return HF_PAGED_AVX2 ? 2 : kMaxRows; }

extern "C" int hf_paged_decoder_max_tokens() { return kMaxTokens; }

// Whether bf16 prompt rows are multiplied with AMX tiles (tile_products).
extern "C" int hf_paged_decoder_prompt_tiles() {
#if HF_PAGED_AMX
    return amx_granted();
#else
    return 0;
#endif
}

// The steps (in tokens) up to which the decoder runs faster than the Transformers forward with oneDNN's packed GEMMs,
// by dtype (0 fp32, 1 bf16). With AVX2 alone, fp32 prompts of SmolLM2 alone in a step ran 1.25x faster natively at 128
// tokens, 1.06x at 160, 0.92x at 192 and 0.61x at 512; bf16 (oneDNN widens it on such CPUs) 2.96-4.52x faster
// natively from 128 to 512. With AVX-512 every size up to kMaxTokens ran faster natively in both dtypes; on a CPU with
// AMX, bf16 prompts did only once their rows took the tiles (one prompt alone: 1.5x oneDNN's speed at 235 tokens,
// 1.1-1.2x at 480; 0.6x at 235 on the vector kernels).
extern "C" int hf_paged_decoder_faster_tokens(int dtype) { return HF_PAGED_AVX2 && dtype == 0 ? 160 : kMaxTokens; }
