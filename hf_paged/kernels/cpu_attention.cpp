// Paged attention for CPUs: keys and values read in place through the block tables (no copy of the blocks).
// Built and loaded by cpu_ops.py; layout and masking rule as in torch_ops.py.
//
// A call first stores the step's new keys and values in their slots (when given), then runs tasks of one sequence and
// one or all of its kv heads (plan_tasks): for each of the sequence's queries, the query heads score every visible
// key, softmax in fp32, then accumulate the values, block by block. bf16 prompt rows marked in the problem take AMX
// tiles instead where the CPU has them (cpu_tile_attention.cpp).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

#include "cpu_kernels.h"

namespace {

using namespace hf_paged;

// With a low locality hint (1: prefetcht2 on x86, which fills the outer caches), not into L1: a whole block's worth
// of L1 prefetches overflows the core's miss buffers, and blocks scattered over the cache were read 1.35x slower that
// way (fp32, 48 sequences of 300-500 tokens, shuffled tables, 2-core AVX-512 machine).
template <typename T>
inline void prefetch_rows(const T* rows, int64_t row_stride, int num_rows, int row_bytes) {
    for (int r = 0; r < num_rows; ++r)
        for (int offset = 0; offset < row_bytes; offset += 64)
            __builtin_prefetch(reinterpret_cast<const char*>(rows + r * row_stride) + offset, 0, 1);
}

// Half the L2 cache (1 MiB where the system does not say). A task whose keys and values fit in it finds them in the
// cache for its further query rows, which then skip the prefetches: SmolLM2's attention over chunks of 64-512 prompt
// rows ran 1.10-1.36x faster (2-core AVX-512 machine, in one process against the kernel that always prefetched, the
// same outputs bit for bit). Over longer contexts, where the blocks spill, every row prefetches.
inline int64_t cached_bytes() {
    static const int64_t bytes = [] {
        const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
        return l2 > 0 ? static_cast<int64_t>(l2) / 2 : int64_t{1} << 20;
    }();
    return bytes;
}

// Scores of L query heads (their rows of q, kD floats each) against `rows` key rows, each loaded once:
// scores[l * stride + r] = q[l] . k[r]. Four rows at a time, so that their sums share one reduction.
template <int L, int kD, typename T>
inline void score_rows(const float* q, const T* k, int64_t row_stride, int rows, float* scores, int stride) {
    constexpr int C = kD / 16;
    vec16 qv[L][C];
    for (int l = 0; l < L; ++l)
        for (int c = 0; c < C; ++c) qv[l][c] = load16(q + l * kD + c * 16);
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
        const T* kr = k + r * row_stride;
        vec16 a[L][4] = {};
        for (int c = 0; c < C; ++c)
            for (int j = 0; j < 4; ++j) {
                const vec16 kv = load16(kr + j * row_stride + c * 16);
                for (int l = 0; l < L; ++l) a[l][j] += qv[l][c] * kv;
            }
        for (int l = 0; l < L; ++l) sum4(a[l][0], a[l][1], a[l][2], a[l][3], scores + l * stride + r);
    }
    for (; r < rows; ++r) {
        const T* kr = k + r * row_stride;
        vec16 a[L] = {};
        for (int c = 0; c < C; ++c) {
            const vec16 kv = load16(kr + c * 16);
            for (int l = 0; l < L; ++l) a[l] += qv[l][c] * kv;
        }
        for (int l = 0; l < L; ++l) scores[l * stride + r] = sum16(a[l]);
    }
}

// acc[l] += sum_r w[l * stride + r] * v[r] for L query heads over `rows` value rows, each loaded once
template <int L, int kD, typename T>
inline void accumulate_rows(const float* w, int stride, const T* v, int64_t row_stride, int rows, float* acc) {
    constexpr int C = kD / 16;
    vec16 o[L][C];
    for (int l = 0; l < L; ++l)
        for (int c = 0; c < C; ++c) o[l][c] = load16(acc + l * kD + c * 16);
    for (int r = 0; r < rows; ++r) {
        const T* vr = v + r * row_stride;
        for (int c = 0; c < C; ++c) {
            const vec16 vv = load16(vr + c * 16);
            for (int l = 0; l < L; ++l) o[l][c] += w[l * stride + r] * vv;
        }
    }
    for (int l = 0; l < L; ++l)
        for (int c = 0; c < C; ++c) std::memcpy(acc + l * kD + c * 16, &o[l][c], sizeof(vec16));
}

#if defined(__AVX512BF16__)
// bf16 caches on CPUs with AVX512-BF16: the scores come from dot products straight from the bf16 key rows and the raw
// bf16 queries (vdpbf16ps: the products are exact in fp32, the sums fp32; the scale is applied after), instead of
// widening every element to fp32 first. The values still meet fp32 weights: rounding those to bf16 was faster but
// changed greedy answers of an fp32 model over a bf16 cache.
constexpr bool kHasBf16Dot = true;

// As score_rows, from raw bf16 queries: scores[l * stride + r] = (q[l] . k[r]) * scale.
template <int L, int kD>
inline void score_rows_bf16(const uint16_t* q, const uint16_t* k, int64_t row_stride, int rows, float* scores,
                            int stride, float scale) {
    constexpr int C = kD / 32;
    __m512bh qv[L][C];
    for (int l = 0; l < L; ++l)
        for (int c = 0; c < C; ++c) qv[l][c] = (__m512bh)_mm512_loadu_si512(q + l * kD + c * 32);
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
        const uint16_t* kr = k + r * row_stride;
        __m512 a[L][4];
        for (int l = 0; l < L; ++l)
            for (int j = 0; j < 4; ++j) a[l][j] = _mm512_setzero_ps();
        for (int c = 0; c < C; ++c)
            for (int j = 0; j < 4; ++j) {
                const __m512bh kv = (__m512bh)_mm512_loadu_si512(kr + j * row_stride + c * 32);
                for (int l = 0; l < L; ++l) a[l][j] = _mm512_dpbf16_ps(a[l][j], qv[l][c], kv);
            }
        for (int l = 0; l < L; ++l) {
            float* out = scores + l * stride + r;
            sum4((vec16)a[l][0], (vec16)a[l][1], (vec16)a[l][2], (vec16)a[l][3], out);
            for (int j = 0; j < 4; ++j) out[j] *= scale;
        }
    }
    for (; r < rows; ++r) {
        const uint16_t* kr = k + r * row_stride;
        __m512 a[L];
        for (int l = 0; l < L; ++l) a[l] = _mm512_setzero_ps();
        for (int c = 0; c < C; ++c) {
            const __m512bh kv = (__m512bh)_mm512_loadu_si512(kr + c * 32);
            for (int l = 0; l < L; ++l) a[l] = _mm512_dpbf16_ps(a[l], qv[l][c], kv);
        }
        for (int l = 0; l < L; ++l) scores[l * stride + r] = sum16((vec16)a[l]) * scale;
    }
}

#else
constexpr bool kHasBf16Dot = false;
template <int L, int kD>
inline void score_rows_bf16(const uint16_t*, const uint16_t*, int64_t, int, float*, int, float) {}
#endif

// Head sizes run() has unrolled kernels for; those that are multiples of 32 take the bf16 score path.
constexpr int kUnrolledHeadDims[] = {64, 80, 96, 128, 256};
constexpr bool bf16_dot_path(int kD) { return kHasBf16Dot && kD > 0 && kD % 32 == 0; }

// The same for any head_dim, one row and one head at a time.
template <typename T>
inline void score_rows_any(const float* q, const T* k, int64_t row_stride, int rows, float* scores, int stride,
                           int L, int D) {
    for (int r = 0; r < rows; ++r)
        for (int l = 0; l < L; ++l) {
            float a = 0.0f;
#pragma omp simd reduction(+ : a)
            for (int d = 0; d < D; ++d) a += q[l * D + d] * to_float(k[r * row_stride + d]);
            scores[l * stride + r] = a;
        }
}

template <typename T>
inline void accumulate_rows_any(const float* w, int stride, const T* v, int64_t row_stride, int rows, float* acc,
                                int L, int D) {
    for (int r = 0; r < rows; ++r)
        for (int l = 0; l < L; ++l) {
            const float wl = w[l * stride + r];
#pragma omp simd
            for (int d = 0; d < D; ++d) acc[l * D + d] += wl * to_float(v[r * row_stride + d]);
        }
}

// One block's rows for all G query heads of a group (kD = 0: any head_dim).
template <int kD, typename T>
void score_block(const float* q, const T* k, int64_t row_stride, int rows, float* scores, int n, int G, int D) {
    if constexpr (kD == 0)
        score_rows_any(q, k, row_stride, rows, scores, n, G, D);
    else
        in_fours(G, [&](auto L, int g) {
            score_rows<decltype(L)::value, kD>(q + g * kD, k, row_stride, rows, scores + g * n, n);
        });
}

template <int kD, typename T>
void accumulate_block(const float* w, int n, const T* v, int64_t row_stride, int rows, float* acc, int G, int D) {
    if constexpr (kD == 0)
        accumulate_rows_any(w, n, v, row_stride, rows, acc, G, D);
    else
        in_fours(G, [&](auto L, int g) {
            accumulate_rows<decltype(L)::value, kD>(w + g * n, n, v, row_stride, rows, acc + g * kD);
        });
}

template <int kD>
void score_block_bf16(const uint16_t* q, const uint16_t* k, int64_t row_stride, int rows, float* scores, int n, int G,
                      float scale) {
    in_fours(G, [&](auto L, int g) {
        score_rows_bf16<decltype(L)::value, kD>(q + g * kD, k, row_stride, rows, scores + g * n, n, scale);
    });
}

// Query row `row` of sequence `s`, kv heads [h0, h0 + nh), seeing keys [lo, len). Block by block, the heads' rows of
// one block are read together: adjacent in memory when the cache stores a block's heads side by side; with
// `prefetch`, each next block is asked for meanwhile.
template <typename T, int kD>
void attend(const Problem& p, int s, int h0, int nh, int row, int len, bool prefetch, std::vector<float>& qf,
            std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& sums,
            std::vector<uint16_t>& half) {
    constexpr bool bf16_dot = sizeof(T) == 2 && bf16_dot_path(kD);
    const int D = p.head_dim, G = p.num_heads / p.num_kv_heads, bs = p.block_size, R = nh * G;
    T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(row) * p.num_heads + h0 * G) * D;
    const int lo = p.sliding_window > 0 ? std::max(0, len - p.sliding_window) : 0;
    const int n = len - lo;
    if (n <= 0) {
        for (int i = 0; i < R * D; ++i) store(out + i, 0.0f);
        return;
    }
    const T* q = static_cast<const T*>(p.query) + row * p.q_stride_token + h0 * G * p.q_stride_head;
    const float qscale = p.softcap > 0 ? p.scale / p.softcap : p.scale;
    uint16_t* qh = half.data();  // bf16_dot: the raw queries
    float* qd = qf.data();
    for (int r = 0; r < R; ++r) {
        const T* qr = q + r * p.q_stride_head;
        if constexpr (bf16_dot)
            std::memcpy(qh + r * kD, qr, kD * sizeof(uint16_t));  // bf16_dot: kD > 0
        else
            for (int d = 0; d < D; ++d) qd[r * D + d] = to_float(qr[d]) * qscale;
    }

    const T* kbase = static_cast<const T*>(p.k_cache) + h0 * p.c_stride_head;
    const T* vbase = static_cast<const T*>(p.v_cache) + h0 * p.c_stride_head;
    const int32_t* table = p.block_tables + s * p.bt_stride;
    const int row_bytes = D * static_cast<int>(sizeof(T));
    const int first = lo / bs, last = (len - 1) / bs;
    // Scores [R, n]: each key row is read once for all the query heads of its group.
    for (int b = first; b <= last; ++b) {
        const int t0 = std::max(lo, b * bs), t1 = std::min(len, (b + 1) * bs);
        const int64_t at = table[b] * p.c_stride_block + (t0 - b * bs) * p.c_stride_row;
        for (int i = 0; i < nh; ++i) {
            const T* k = kbase + i * p.c_stride_head;
            if (prefetch && b < last) prefetch_rows(k + table[b + 1] * p.c_stride_block, p.c_stride_row, bs, row_bytes);
            if constexpr (bf16_dot)
                score_block_bf16<kD>(qh + i * G * D, reinterpret_cast<const uint16_t*>(k + at), p.c_stride_row,
                                     t1 - t0, scores.data() + i * G * n + (t0 - lo), n, G, qscale);
            else
                score_block<kD>(qf.data() + i * G * D, k + at, p.c_stride_row, t1 - t0,
                                scores.data() + i * G * n + (t0 - lo), n, G, D);
        }
    }
    for (int r = 0; r < R; ++r) {
        float* x = scores.data() + r * n;
        if (p.softcap > 0)
            for (int i = 0; i < n; ++i) x[i] = std::tanh(x[i]) * p.softcap;
        float mx = x[0];
        for (int i = 1; i < n; ++i) mx = std::max(mx, x[i]);
        if (p.sinks) mx = std::max(mx, p.sinks[h0 * G + r]);
        float total = p.sinks ? std::exp(p.sinks[h0 * G + r] - mx) : 0.0f;
#pragma omp simd reduction(+ : total)
        for (int i = 0; i < n; ++i) {
            x[i] = std::exp(x[i] - mx);
            total += x[i];
        }
        sums[r] = total;
    }
    std::fill(acc.begin(), acc.begin() + R * D, 0.0f);
    for (int b = first; b <= last; ++b) {
        const int t0 = std::max(lo, b * bs), t1 = std::min(len, (b + 1) * bs);
        const int64_t at = table[b] * p.c_stride_block + (t0 - b * bs) * p.c_stride_row;
        for (int i = 0; i < nh; ++i) {
            const T* v = vbase + i * p.c_stride_head;
            if (prefetch && b < last) prefetch_rows(v + table[b + 1] * p.c_stride_block, p.c_stride_row, bs, row_bytes);
            accumulate_block<kD>(scores.data() + i * G * n + (t0 - lo), n, v + at, p.c_stride_row, t1 - t0,
                                 acc.data() + i * G * D, G, D);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int d = 0; d < D; ++d) store(out + r * D + d, acc[r * D + d] / sums[r]);
}

// One unit of work: the queries of sequence `s` against kv heads [h0, h0 + nh).
struct Task {
    int s, h0, nh, j0, j1, dj;  // sequence, kv heads [h0, h0 + nh), its queries j0, j0 + dj, ... below j1
    bool tiled;  // then j0, j0 + dj, ... start tiles of 16 rows on AMX (tile_attention)
};

// How many of sequence s's first rows are prompt rows (none unless `tiles`).
int prompt_rows(const Problem& p, int s, bool tiles) {
    int t = p.query_start_loc[s];
    if (tiles)
        while (t < p.query_start_loc[s + 1] && p.prompt_rows[t]) ++t;
    return t - p.query_start_loc[s];
}

// With `tiles`, each sequence's prompt rows first, in tiles of 16 rows dealt out per kv head as a head's queries are
// below (each task lays out the keys it reads once for all its tiles, so the tasks are few). Then multi-query
// sequences (prefill chunks, verified guesses) split by head, as they cost the most, and each head's queries dealt out
// in turn while there are fewer heads than twice the threads (one sequence of 8 queries over 3 kv heads left a thread
// idle for a third of the time); then the decodes, each with all its heads at once (their blocks are read as one run),
// or split by head while there are too few to share between the threads.
std::vector<Task> plan_tasks(const Problem& p, bool tiles) {
    std::vector<Task> tasks;
    std::vector<std::pair<int, int>> decodes;  // sequence, row
    const int parts = std::max(1, (2 * p.num_threads + p.num_kv_heads - 1) / p.num_kv_heads);
    for (int s = 0; s < p.num_seqs; ++s) {
        const int queries = p.query_start_loc[s + 1] - p.query_start_loc[s], tiled = prompt_rows(p, s, tiles);
        const int tile_parts = std::min((tiled + 15) / 16, parts);
        for (int h = 0; h < p.num_kv_heads; ++h)
            for (int k = 0; k < tile_parts; ++k) tasks.push_back({s, h, 1, 16 * k, tiled, 16 * tile_parts, true});
        const int rest = queries - tiled;
        if (rest > 1) {
            const int dj = std::min(rest, parts);
            for (int h = 0; h < p.num_kv_heads; ++h)
                for (int j0 = 0; j0 < dj; ++j0) tasks.push_back({s, h, 1, tiled + j0, queries, dj, false});
        } else if (rest == 1) {
            decodes.push_back({s, queries - 1});
        }
    }
    const int nh = static_cast<int>(decodes.size()) >= 2 * p.num_threads ? p.num_kv_heads : 1;
    for (const auto& [s, j] : decodes)
        for (int h = 0; h < p.num_kv_heads; h += nh) tasks.push_back({s, h, nh, j, j + 1, 1, false});
    return tasks;
}

// Whether this problem's prompt rows take tile_attention.
template <typename T>
bool takes_tiles(const Problem& p) {
    return sizeof(T) == 2 && p.prompt_rows && tile_attention_fits(p.head_dim);
}

// The whole call, run by every thread of an enclosing parallel region (its work-sharing loops are orphaned).
template <typename T>
void run_in_team(const Problem& p, const std::vector<Task>& tasks) {
    {
        if (p.key) {
            const size_t row_bytes = static_cast<size_t>(p.head_dim) * sizeof(T);
#pragma omp for schedule(static)
            for (int t = 0; t < p.num_tokens; ++t) {
                const int64_t slot = p.slot_mapping[t];
                if (slot < 0) continue;
                const int64_t at = slot / p.block_size * p.c_stride_block + slot % p.block_size * p.c_stride_row;
                for (int h = 0; h < p.num_kv_heads; ++h) {
                    std::memcpy(static_cast<T*>(p.k_cache) + at + h * p.c_stride_head,
                                static_cast<const T*>(p.key) + t * p.k_stride_token + h * p.k_stride_head, row_bytes);
                    std::memcpy(static_cast<T*>(p.v_cache) + at + h * p.c_stride_head,
                                static_cast<const T*>(p.value) + t * p.v_stride_token + h * p.v_stride_head, row_bytes);
                }
            }  // the barrier here: every new row is stored before any query reads it
        }
        const int R = p.num_heads;  // query heads of the largest task
        std::vector<float> qf(R * p.head_dim), acc(R * p.head_dim), sums(R), scores;
        std::vector<uint16_t> half(sizeof(T) == 2 ? R * p.head_dim : 0);
#pragma omp for schedule(dynamic, 1)
        for (size_t i = 0; i < tasks.size(); ++i) {
            const auto [s, h0, nh, j0, j1, dj, tiled] = tasks[i];
            if (tiled) {
                tile_attention(p, s, h0, j0, j1, dj);
                continue;
            }
            const int seq_len = p.seq_lens[s], first = p.query_start_loc[s];
            const int num_queries = p.query_start_loc[s + 1] - first;
            const size_t need = static_cast<size_t>(R) * std::max(seq_len, 1);
            if (scores.size() < need) scores.resize(need);
            const bool spills = 2 * static_cast<int64_t>(seq_len) * nh * p.head_dim * sizeof(T) > cached_bytes();
            for (int j = j0; j < j1; j += dj) {
                const int row = first + j, len = seq_len - num_queries + j + 1;  // causal: keys [.., len)
                const bool prefetch = j == j0 || spills;
                switch (p.head_dim) {  // kUnrolledHeadDims get unrolled vector loops
                    case 64: attend<T, 64>(p, s, h0, nh, row, len, prefetch, qf, scores, acc, sums, half); break;
                    case 80: attend<T, 80>(p, s, h0, nh, row, len, prefetch, qf, scores, acc, sums, half); break;
                    case 96: attend<T, 96>(p, s, h0, nh, row, len, prefetch, qf, scores, acc, sums, half); break;
                    case 128: attend<T, 128>(p, s, h0, nh, row, len, prefetch, qf, scores, acc, sums, half); break;
                    case 256: attend<T, 256>(p, s, h0, nh, row, len, prefetch, qf, scores, acc, sums, half); break;
                    default: attend<T, 0>(p, s, h0, nh, row, len, prefetch, qf, scores, acc, sums, half);
                }
            }
        }
    }
}

template <typename T>
void run(const Problem& p) {
    const std::vector<Task> tasks = plan_tasks(p, takes_tiles<T>(p));
#pragma omp parallel num_threads(p.num_threads)
    run_in_team<T>(p, tasks);
}

// The index arrays, checked before any memory is read through them (cpu_ops.py names each status).
int check_indices(const Problem& p) {
    const int32_t* qsl = p.query_start_loc;
    if (qsl[0] != 0 || qsl[p.num_seqs] != p.num_tokens) return 3;
    for (int s = 0; s < p.num_seqs; ++s) {
        if (qsl[s + 1] < qsl[s]) return 4;
        const int32_t len = p.seq_lens[s];
        if (len < 0 || static_cast<int64_t>(len) > static_cast<int64_t>(p.bt_width) * p.block_size) return 5;
        const int32_t* table = p.block_tables + s * p.bt_stride;
        for (int b = 0; b * p.block_size < len; ++b)
            if (table[b] < 0 || table[b] >= p.num_blocks) return 6;
    }
    if (p.key)
        for (int t = 0; t < p.num_tokens; ++t)
            if (p.slot_mapping[t] >= static_cast<int64_t>(p.num_blocks) * p.block_size) return 7;
    return 0;
}

}  // namespace

extern "C" int hf_paged_attention(const Problem* p, int dtype) {
    if (const int status = hf_paged::check_attention(*p)) return status;
    if (dtype == 0)
        run<float>(*p);
    else if (dtype == 1)
        run<uint16_t>(*p);
    else
        return 2;
    return 0;
}

int hf_paged::attention_in_team(const Problem& p, int dtype) {
    if (dtype == 0)
        run_in_team<float>(p, plan_tasks(p, false));
    else
        run_in_team<uint16_t>(p, plan_tasks(p, takes_tiles<uint16_t>(p)));  // each thread its own plan, all alike
    return 0;
}

int hf_paged::check_attention(const Problem& p) {
    if (p.head_dim <= 0 || p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads) return 1;
    return check_indices(p);
}

extern "C" int hf_paged_problem_size() { return static_cast<int>(sizeof(Problem)); }

// Whether bf16 prompt rows of this head size take AMX tiles (tile_attention).
extern "C" int hf_paged_tile_attention(int head_dim) { return hf_paged::tile_attention_fits(head_dim); }

// Whether bf16 caches of this head size get the AVX512-BF16 score path.
extern "C" int hf_paged_has_bf16_dot(int head_dim) {
    for (const int d : kUnrolledHeadDims)
        if (d == head_dim) return bf16_dot_path(d);
    return 0;
}
