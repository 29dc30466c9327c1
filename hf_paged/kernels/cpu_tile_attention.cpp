// Prompt rows' attention on AMX tiles (bf16 caches, CPUs with AMX). A tile is up to 16 prompt rows of one sequence
// with the G query heads of one kv head: their scores against 16 keys at a time are tile products, the softmax runs
// per row in fp32 as in the row kernel (cpu_attention.cpp), and the weights, rounded to bf16 as torch's SDPA rounds
// them for bf16, multiply 32 values at a time. A task takes several of a sequence's tiles for one kv head, and lays
// out the keys and values as the tiles take them, each once for all its tiles.
//
// AMX sums in another order than the row kernel, so generated tokens (decode steps, verified guesses) stay on the row
// kernel, as their products do in cpu_decoder.cpp. For a prompt row to come out the same in any step, whatever rows
// share its tile, every sum over keys runs in groups at fixed positions (multiples of 16 or 32 from the sequence's
// first key), the keys outside the row's range adding exact zeros.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"

#if HF_PAGED_AMX && defined(__AVX512BF16__)
namespace {

using namespace hf_paged;

constexpr int kRows = 16;  // query rows of a tile
constexpr int kScoreKeys = 16;  // keys of a score tile
constexpr int kValueKeys = 32;  // keys of a weight tile: its 32 bf16 per row

alignas(64) constexpr uint16_t kZeroRow[256] = {};  // a key or value past the sequence (head_dim <= 256)

// Per thread, grown as needed and kept between tasks.
struct Scratch {
    std::vector<uint16_t> q, keys, values, weights;  // q: [G][16][D], rows past the task's zero
    std::vector<float> scores, sums, acc;
};

// The index vectors of vpermt2d that swap blocks of b = 8, 4, 2, 1 words between two rows (transpose16).
struct SwapIndices {
    int32_t lo[4][16], hi[4][16];
};
constexpr SwapIndices swap_indices() {
    SwapIndices s{};
    for (int l = 0; l < 4; ++l)
        for (int c = 0, b = 8 >> l; c < 16; ++c) {
            s.lo[l][c] = (c & b) ? 16 + c - b : c;
            s.hi[l][c] = (c & b) ? 16 + c : c + b;
        }
    return s;
}
alignas(64) constexpr SwapIndices kSwap = swap_indices();

// dst[i * 16 + k] = rows[k][i]: the transpose of 16 rows of 16 32-bit words, in four rounds of block swaps.
inline void transpose16(const uint32_t* const rows[16], uint32_t* dst) {
    __m512i r[16];
    for (int k = 0; k < 16; ++k) r[k] = _mm512_loadu_si512(rows[k]);
#pragma GCC unroll 4
    for (int l = 0; l < 4; ++l) {
        const int b = 8 >> l;
        const __m512i lo = _mm512_load_si512(kSwap.lo[l]), hi = _mm512_load_si512(kSwap.hi[l]);
        for (int i = 0; i < 16; ++i)
            if (!(i & b)) {
                const __m512i x = r[i], y = r[i + b];
                r[i] = _mm512_permutex2var_epi32(x, lo, y);
                r[i + b] = _mm512_permutex2var_epi32(x, hi, y);
            }
    }
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * 16, r[i]);
}

// Key or value row t of sequence s for kv head h, or zeros past the sequence.
inline const uint16_t* cache_row(const Problem& p, const void* cache, int s, int h, int t) {
    if (t >= p.seq_lens[s]) return kZeroRow;
    const int32_t* table = p.block_tables + s * p.bt_stride;
    return static_cast<const uint16_t*>(cache) + table[t / p.block_size] * p.c_stride_block +
           (t % p.block_size) * p.c_stride_row + h * p.c_stride_head;
}

// Keys [kb, ke) as score tiles: for each 16 keys and 32 dims, 16 rows (pairs of dims) of the 16 keys' pairs.
void lay_out_keys(const Problem& p, int s, int h, int kb, int ke, uint16_t* out) {
    const int D = p.head_dim;
    for (int t0 = kb; t0 < ke; t0 += kScoreKeys)
        for (int dc = 0; dc < D / 32; ++dc) {
            const uint32_t* rows[16];
            for (int k = 0; k < 16; ++k)
                rows[k] = reinterpret_cast<const uint32_t*>(cache_row(p, p.k_cache, s, h, t0 + k) + dc * 32);
            transpose16(rows, reinterpret_cast<uint32_t*>(out + ((t0 - kb) * D / 32 + dc * kScoreKeys) * 32));
        }
}

// Values [kb, ke) as value tiles: for each 32 keys and 16 dims, 16 rows (pairs of keys) of the 16 dims' pairs.
void lay_out_values(const Problem& p, int s, int h, int kb, int ke, uint16_t* out) {
    alignas(64) static constexpr uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    alignas(64) static constexpr uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                       24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
    const int D = p.head_dim, chunks = D / 16;
    for (int t0 = kb; t0 < ke; t0 += kValueKeys) {
        uint16_t* group = out + (t0 - kb) / kValueKeys * chunks * 512;
        for (int i = 0; i < 16; ++i) {
            const uint16_t* a = cache_row(p, p.v_cache, s, h, t0 + 2 * i);
            const uint16_t* b = cache_row(p, p.v_cache, s, h, t0 + 2 * i + 1);
            for (int c = 0; c < D / 32; ++c) {
                const __m512i x = _mm512_loadu_si512(a + c * 32), y = _mm512_loadu_si512(b + c * 32);
                _mm512_storeu_si512(group + ((2 * c) * 16 + i) * 32, _mm512_permutex2var_epi16(x, low, y));
                _mm512_storeu_si512(group + ((2 * c + 1) * 16 + i) * 32, _mm512_permutex2var_epi16(x, high, y));
            }
        }
    }
}

// scores[g][r][k] = q[g][r] . key k for N heads' 16 rows (q: [N][16][D]) against the laid-out keys, n of them.
// Tiles 0-3: the heads' sums; 4, 6, 7: queries; 5: keys.
template <int N>
void score_tiles(const uint16_t* q, int D, const uint16_t* keys, int n, float* scores, int64_t stride) {
    const int64_t head = kRows * D, head_scores = kRows * stride;
    for (int k0 = 0; k0 < n; k0 += kScoreKeys) {
        _tile_zero(0);
        if constexpr (N > 1) _tile_zero(1);
        if constexpr (N > 2) _tile_zero(2);
        if constexpr (N > 3) _tile_zero(3);
        for (int dc = 0; dc < D / 32; ++dc) {
            _tile_loadd(5, keys + (k0 * D / 32 + dc * kScoreKeys) * 32, 64);
            _tile_loadd(4, q + dc * 32, D * 2);
            _tile_dpbf16ps(0, 4, 5);
            if constexpr (N > 1) { _tile_loadd(6, q + head + dc * 32, D * 2); _tile_dpbf16ps(1, 6, 5); }
            if constexpr (N > 2) { _tile_loadd(7, q + 2 * head + dc * 32, D * 2); _tile_dpbf16ps(2, 7, 5); }
            if constexpr (N > 3) { _tile_loadd(4, q + 3 * head + dc * 32, D * 2); _tile_dpbf16ps(3, 4, 5); }
        }
        _tile_stored(0, scores + k0, stride * 4);
        if constexpr (N > 1) _tile_stored(1, scores + head_scores + k0, stride * 4);
        if constexpr (N > 2) _tile_stored(2, scores + 2 * head_scores + k0, stride * 4);
        if constexpr (N > 3) _tile_stored(3, scores + 3 * head_scores + k0, stride * 4);
    }
}

// acc[r][16 * (c0 + i) + d] = sum over the n keys of w[r][k] v[k][16 * (c0 + i) + d] for dim chunks c0 .. c0 + N of
// one head. Tiles 0-3: sums; 4: weights; 5-7: values.
template <int N>
void value_tiles(const uint16_t* w, int64_t stride, const uint16_t* values, int n, int D, int c0, float* acc) {
    const int chunks = D / 16;
    _tile_zero(0);
    if constexpr (N > 1) _tile_zero(1);
    if constexpr (N > 2) _tile_zero(2);
    if constexpr (N > 3) _tile_zero(3);
    for (int k0 = 0; k0 < n; k0 += kValueKeys) {
        const uint16_t* group = values + (k0 / kValueKeys * chunks + c0) * 512;
        _tile_loadd(4, w + k0, stride * 2);
        _tile_loadd(5, group, 64);
        _tile_dpbf16ps(0, 4, 5);
        if constexpr (N > 1) { _tile_loadd(6, group + 512, 64); _tile_dpbf16ps(1, 4, 6); }
        if constexpr (N > 2) { _tile_loadd(7, group + 1024, 64); _tile_dpbf16ps(2, 4, 7); }
        if constexpr (N > 3) { _tile_loadd(5, group + 1536, 64); _tile_dpbf16ps(3, 4, 5); }
    }
    _tile_stored(0, acc + c0 * 16, D * 4);
    if constexpr (N > 1) _tile_stored(1, acc + (c0 + 1) * 16, D * 4);
    if constexpr (N > 2) _tile_stored(2, acc + (c0 + 2) * 16, D * 4);
    if constexpr (N > 3) _tile_stored(3, acc + (c0 + 3) * 16, D * 4);
}

// e^x for the softmax's x <= 0: 2^n e^r with n = round(x / ln 2), |r| <= ln(2) / 2, e^r to degree 7 (within 2 ulp);
// x below -87 gives about 2^-126.
inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 e = _mm512_set1_ps(1.0f / 5040);
    for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
        e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(c));
    return _mm512_scalef_ps(e, n);
}

// One row's weights over its keys [lo, len) (x and w start at key kb, n keys): exp(score - max) in fp32, rounded to
// bf16 into w, zero elsewhere; returns their fp32 sum. 16 keys at a time at multiples of 16. The scores are scaled
// as they are read (scaling by a positive factor keeps the maximum where it was), capped first where softcap > 0. A
// `sink` (or null) joins the maximum and the sum as a key without a value.
float softmax_row(float* x, uint16_t* w, int kb, int n, int lo, int len, float scale, float softcap,
                  const float* sink) {
    const int a = std::max(lo, 0) / 16 * 16, z = len <= lo ? a : (len + 15) / 16 * 16;
    std::fill(w, w + (a - kb), uint16_t{0});
    std::fill(w + (z - kb), w + n, uint16_t{0});
    if (a == z) return 0.0f;
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const auto in_row = [&](int t) {  // the lanes of keys t .. t + 15 that the row sees
        const __m512i keys = _mm512_add_epi32(_mm512_set1_epi32(t), lanes);
        return _mm512_cmpge_epi32_mask(keys, _mm512_set1_epi32(lo)) &
               _mm512_cmplt_epi32_mask(keys, _mm512_set1_epi32(len));
    };
    __m512 factor = _mm512_set1_ps(scale);
    if (softcap > 0) {
        for (int i = a - kb; i < z - kb; ++i) x[i] = std::tanh(x[i] * scale) * softcap;
        factor = _mm512_set1_ps(1.0f);
    }
    __m512 mx = _mm512_set1_ps(-3.0e38f);
    for (int t = a; t < z; t += 16) mx = _mm512_mask_max_ps(mx, in_row(t), mx, _mm512_loadu_ps(x + t - kb));
    float top = _mm512_reduce_max_ps(mx) * (softcap > 0 ? 1.0f : scale);
    if (sink) top = std::max(top, *sink);
    const __m512 row_max = _mm512_set1_ps(top);
    __m512 total = _mm512_setzero_ps();
    for (int t = a; t < z; t += 16) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + t - kb), factor);
        const __m512 e = _mm512_maskz_mov_ps(in_row(t), exp_nonpositive(_mm512_sub_ps(v, row_max)));
        total = _mm512_add_ps(total, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + t - kb), (__m256i)_mm512_cvtneps_pbh(e));
    }
    alignas(64) float sums[16];
    _mm512_store_ps(sums, total);
    return sum16(load16(sums)) + (sink ? std::exp(*sink - top) : 0.0f);
}

// The tile of rows [j0, j1) of sequence s: keys [lo[r], len[r]) for row r.
struct Rows {
    int count, lo[kRows], len[kRows];
    int kb, ke;  // the keys the tile reads: [kb, ke), in whole value groups
};

Rows task_rows(const Problem& p, int s, int j0, int j1) {
    Rows rows{};
    rows.count = j1 - j0;
    const int queries = p.query_start_loc[s + 1] - p.query_start_loc[s], seq_len = p.seq_lens[s];
    int lo = seq_len, hi = 0;
    for (int r = 0; r < rows.count; ++r) {
        const int len = std::max(0, seq_len - queries + j0 + r + 1);
        rows.len[r] = len;
        rows.lo[r] = p.sliding_window > 0 ? std::max(0, len - p.sliding_window) : 0;
        lo = std::min(lo, rows.lo[r]);
        hi = std::max(hi, len);
    }
    rows.kb = lo / kValueKeys * kValueKeys;
    rows.ke = (hi + kValueKeys - 1) / kValueKeys * kValueKeys;
    return rows;
}

// The G heads' query rows into w.q ([G][16][D]), zero past the tile's rows.
void gather_queries(const Problem& p, int s, int h, int j0, int count, Scratch& w) {
    const int D = p.head_dim, G = p.num_heads / p.num_kv_heads;
    w.q.assign(static_cast<size_t>(G) * kRows * D, 0);
    const uint16_t* q = static_cast<const uint16_t*>(p.query) +
                        (p.query_start_loc[s] + j0) * p.q_stride_token + h * G * p.q_stride_head;
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < count; ++r)
            std::memcpy(w.q.data() + (g * kRows + r) * D, q + r * p.q_stride_token + g * p.q_stride_head, D * 2);
}

// Each head's weighted values (laid out from key rows.kb on), divided by the weights' sum, into the output rows.
void weigh_values(const Problem& p, int s, int h, int j0, const Rows& rows, const uint16_t* values, Scratch& w) {
    const int D = p.head_dim, G = p.num_heads / p.num_kv_heads, n = rows.ke - rows.kb;
    uint16_t* out = static_cast<uint16_t*>(p.out) + ((p.query_start_loc[s] + j0) * p.num_heads + h * G) * D;
    for (int g = 0; g < G; ++g) {
        const uint16_t* weights = w.weights.data() + static_cast<int64_t>(g) * kRows * n;
        in_fours(D / 16, [&](auto N, int c0) {
            value_tiles<decltype(N)::value>(weights, n, values, n, D, c0, w.acc.data());
        });
        for (int r = 0; r < rows.count; ++r) {
            const float sum = w.sums[g * kRows + r];
            for (int d = 0; d < D; ++d)
                store(out + (r * p.num_heads + g) * D + d, sum > 0 ? w.acc[r * D + d] / sum : 0.0f);
        }
    }
}

// One tile: rows [j0, j0 + rows.count) of sequence s, the G query heads of kv head h, reading keys and values laid
// out from key rows.kb on.
void attend_tile(const Problem& p, int s, int h, int j0, const Rows& rows, const uint16_t* keys,
                 const uint16_t* values, Scratch& w) {
    const int D = p.head_dim, G = p.num_heads / p.num_kv_heads, n = rows.ke - rows.kb;
    const size_t scores = static_cast<size_t>(G) * kRows * n;
    if (w.scores.size() < scores) w.scores.resize(scores), w.weights.resize(scores);
    w.sums.assign(G * kRows, 0.0f);
    w.acc.resize(kRows * D);
    gather_queries(p, s, h, j0, rows.count, w);
    in_fours(G, [&](auto N, int g) {
        score_tiles<decltype(N)::value>(w.q.data() + g * kRows * D, D, keys, n, w.scores.data() + g * kRows * n, n);
    });
    const float scale = p.softcap > 0 ? p.scale / p.softcap : p.scale;
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < kRows; ++r) {
            const int64_t at = static_cast<int64_t>(g * kRows + r) * n;
            if (r >= rows.count) {  // rows past the tile's: no weights
                std::fill(w.weights.data() + at, w.weights.data() + at + n, uint16_t{0});
                continue;
            }
            w.sums[g * kRows + r] = softmax_row(w.scores.data() + at, w.weights.data() + at, rows.kb, n, rows.lo[r],
                                                rows.len[r], scale, p.softcap, p.sinks ? p.sinks + h * G + g : nullptr);
        }
    weigh_values(p, s, h, j0, rows, values, w);
}

}  // namespace

// The tiles' windows of keys only move forward, so each key is laid out once per task, when a tile first reads it.
void hf_paged::tile_attention(const Problem& p, int s, int h, int j0, int j1, int dj) {
    thread_local Scratch w;
    const int D = p.head_dim;
    const int last = j0 + (j1 - 1 - j0) / dj * dj;
    const int base = task_rows(p, s, j0, std::min(j0 + kRows, j1)).kb;  // keys [base, laid) are laid out
    const size_t room = static_cast<size_t>(task_rows(p, s, last, std::min(last + kRows, j1)).ke - base) * D;
    if (w.keys.size() < room) w.keys.resize(room), w.values.resize(room);
    configure_tiles();
    for (int j = j0, laid = base; j < j1; j += dj) {
        const Rows rows = task_rows(p, s, j, std::min(j + kRows, j1));
        if (rows.ke > laid) {
            const size_t at = static_cast<size_t>(laid - base) * D;
            lay_out_keys(p, s, h, laid, rows.ke, w.keys.data() + at);
            lay_out_values(p, s, h, laid, rows.ke, w.values.data() + at);
            laid = rows.ke;
        }
        const size_t from = static_cast<size_t>(rows.kb - base) * D;
        attend_tile(p, s, h, j, rows, w.keys.data() + from, w.values.data() + from, w);
    }
    _tile_release();
}

bool hf_paged::tile_attention_fits(int head_dim) { return head_dim % 32 == 0 && head_dim <= 256 && amx_granted(); }

#else
void hf_paged::tile_attention(const Problem&, int, int, int, int, int) {}
bool hf_paged::tile_attention_fits(int) { return false; }
#endif
