// Shared by the native CPU kernels (cpu_attention.cpp, cpu_decoder.cpp): bf16 conversions, 16-float vectors, and
// the attention problem that cpu_decoder.cpp hands to the attention kernel.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HF_PAGED_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define HF_PAGED_AMX 0
#endif

// AVX2 without AVX-512: 16 vector registers of 8 floats, for which some kernels are blocked differently (the vec16
// loops written for AVX-512's 32 registers of 16 floats spill there).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define HF_PAGED_AVX2 1
#else
#define HF_PAGED_AVX2 0
#endif

namespace hf_paged {

// Internal linkage: each source compiles these with its own flags (cpu_attention.cpp with -ffast-math).
namespace {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {  // bfloat16
    uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}
inline void store(float* dst, float x) { *dst = x; }
inline void store(uint16_t* dst, float x) {  // round to nearest even
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) {
        *dst = 0x7fc0;
        return;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);
    *dst = static_cast<uint16_t>(bits >> 16);
}

// The inner loops on vectors of 16 floats (GCC vector extensions: AVX-512, AVX2 or SSE, whatever -march gives).
typedef float vec16 __attribute__((vector_size(64)));
typedef uint16_t half16 __attribute__((vector_size(32)));
typedef uint32_t word16 __attribute__((vector_size(64)));

inline vec16 load16(const float* p) {
    vec16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
inline vec16 load16(const uint16_t* p) {  // bfloat16 -> float: the bits shifted into the high half
    half16 h;
    std::memcpy(&h, p, sizeof h);
    const word16 w = __builtin_convertvector(h, word16) << 16;
    vec16 v;
    std::memcpy(&v, &w, sizeof v);
    return v;
}
inline float sum16(vec16 v) {
    float s = 0.0f;
    for (int i = 0; i < 16; ++i) s += v[i];
    return s;
}

// The sums of four vectors: out[i] = sum of the lanes of v_i. Two shuffle-and-add levels put four partial sums of
// each vector side by side, two more finish them: cheaper than four separate horizontal sums.
inline void sum4(vec16 a, vec16 b, vec16 c, vec16 d, float* out) {
    const vec16 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                     __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const vec16 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                     __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const vec16 x = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                    __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const vec16 y = x + __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    const vec16 z = y + __builtin_shufflevector(y, y, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    out[0] = z[0];
    out[1] = z[4];
    out[2] = z[8];
    out[3] = z[12];
}

// f(n, i) for runs of n <= 4 items [i, i + n) covering N (n an std::integral_constant).
template <typename F>
inline void in_fours(int N, F&& f) {
    int i = 0;
    for (; i + 4 <= N; i += 4) f(std::integral_constant<int, 4>{}, i);
    switch (N - i) {
        case 3: f(std::integral_constant<int, 3>{}, i); break;
        case 2: f(std::integral_constant<int, 2>{}, i); break;
        case 1: f(std::integral_constant<int, 1>{}, i); break;
    }
}

#if HF_PAGED_AMX
// Linux hands a process the tile registers only on request (once per process); false where it refuses.
inline bool amx_granted() {
    static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return granted;
}

struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// All eight tiles 16 rows of 64 bytes: 16 fp32 sums, 32 bf16 of a row, or 16 pairs of bf16 per row.
inline void configure_tiles() {
    TileConfig config{};
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}
#endif

}  // namespace

struct Problem {
    const void* query;  // [T, Hq, D], head_dim contiguous; sequence s owns rows [query_start_loc[s], [s + 1])
    int64_t q_stride_token, q_stride_head;
    const int32_t* query_start_loc;  // [S + 1]
    void* k_cache;  // [N, bs, Hkv, D] seen through strides, head_dim contiguous
    void* v_cache;
    int64_t c_stride_block, c_stride_row, c_stride_head;
    const int32_t* block_tables;  // [S, width]
    int64_t bt_stride;
    const int32_t* seq_lens;  // [S]
    void* out;  // [T, Hq, D] contiguous
    int32_t num_seqs, num_heads, num_kv_heads, head_dim, block_size;
    int32_t num_tokens, num_blocks, bt_width;  // query rows, cache blocks, block-table columns
    float scale;
    int32_t sliding_window;  // <= 0: none
    float softcap;  // <= 0: none
    int32_t num_threads;
    // This step's new keys and values [T, Hkv, D] (head_dim contiguous), stored into their flat slots
    // (block * block_size + row; -1: not stored) before any query reads the cache. key == nullptr: nothing to store.
    const void* key;
    const void* value;
    int64_t k_stride_token, k_stride_head, v_stride_token, v_stride_head;
    const int64_t* slot_mapping;  // [T]
    // [T] or null: the rows that are prompt tokens, which take tile_attention in bf16 where it fits (the others, and
    // every row in fp32, the row kernel). A sequence's prompt rows come before its other rows.
    const uint8_t* prompt_rows;
    // [Hq] fp32 attention sinks (gpt-oss's), or null: each row's softmax denominator also holds exp(sinks[head]).
    const float* sinks;
};

// Whether bf16 prompt rows of this head size take tile_attention: AMX granted, head_dim a multiple of 32 up to 256.
bool tile_attention_fits(int head_dim);

// The tiles of 16 query rows of sequence s that start at rows j0, j0 + dj, ... below j1 (dj a multiple of 16; rows
// below j1 all prompt rows), all query heads of kv head h, attended on AMX tiles (bf16 caches; tile_attention_fits).
// A row's output depends on the row alone, not on the others in its tile or task.
void tile_attention(const Problem& p, int s, int h, int j0, int j1, int dj);

// The checks of hf_paged_attention alone: 0, or the status it would return (cpu_ops.py names them).
int check_attention(const Problem& p);

// hf_paged_attention without its checks, called by every thread of an enclosing OpenMP parallel region with the same
// problem (dtype 0: fp32, 1: bf16); all threads leave together.
int attention_in_team(const Problem& p, int dtype);

}  // namespace hf_paged

// Stores the step's new keys and values (when given), then attends every query row; 0 on success (see cpu_ops.py).
extern "C" int hf_paged_attention(const hf_paged::Problem* p, int dtype);
