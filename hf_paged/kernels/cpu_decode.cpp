// Paged decode attention for CPUs: one query token per sequence, keys and values read in place through the block
// table (no copy of the blocks). Built and loaded by cpu_ops.py; layout as in torch_ops.py.
//
// One task per (sequence, kv head): the group's query heads score every visible key, softmax in fp32, then
// accumulate the values. Inner loops run over head_dim and vectorise.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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

struct Problem {
    const void* query;  // [S, Hq, D], head_dim contiguous
    int64_t q_stride_seq, q_stride_head;
    const void* k_cache;  // [N, bs, Hkv, D] seen through strides, head_dim contiguous
    const void* v_cache;
    int64_t c_stride_block, c_stride_row, c_stride_head;
    const int32_t* block_tables;  // [S, width]
    int64_t bt_stride;
    const int32_t* seq_lens;  // [S]
    void* out;  // [S, Hq, D] contiguous
    int32_t num_seqs, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int32_t sliding_window;  // <= 0: none
    float softcap;  // <= 0: none
    int32_t num_threads;
};

template <typename T>
inline void prefetch_rows(const T* rows, int64_t row_stride, int num_rows, int row_bytes) {
    for (int r = 0; r < num_rows; ++r)
        for (int offset = 0; offset < row_bytes; offset += 64)
            __builtin_prefetch(reinterpret_cast<const char*>(rows + r * row_stride) + offset);
}

// L query heads against one key row, loaded once: scores[l] = q[l] . k
template <int L, typename T>
inline void score_row(const float* q, const T* k, int D, float* scores) {
    float a[L] = {};
#pragma omp simd reduction(+ : a[:L])
    for (int d = 0; d < D; ++d) {
        const float kd = to_float(k[d]);
        for (int l = 0; l < L; ++l) a[l] += q[l * D + d] * kd;
    }
    for (int l = 0; l < L; ++l) scores[l] = a[l];
}

// acc[l] += w[l] * v for L query heads, the value row loaded once
template <int L, typename T>
inline void accumulate_row(const float* w, const T* v, int D, float* acc) {
#pragma omp simd
    for (int d = 0; d < D; ++d) {
        const float vd = to_float(v[d]);
        for (int l = 0; l < L; ++l) acc[l * D + d] += w[l] * vd;
    }
}

template <typename T>
void attend(const Problem& p, int s, int h, std::vector<float>& qf, std::vector<float>& scores,
            std::vector<float>& acc, std::vector<float>& stats) {
    const int D = p.head_dim, G = p.num_heads / p.num_kv_heads, bs = p.block_size;
    const int len = p.seq_lens[s];
    T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(s) * p.num_heads + h * G) * D;
    const int lo = p.sliding_window > 0 ? std::max(0, len - p.sliding_window) : 0;
    const int n = len - lo;
    if (n <= 0) {
        for (int i = 0; i < G * D; ++i) store(out + i, 0.0f);
        return;
    }
    const T* q = static_cast<const T*>(p.query) + s * p.q_stride_seq + h * G * p.q_stride_head;
    const float qscale = p.softcap > 0 ? p.scale / p.softcap : p.scale;
    for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) qf[g * D + d] = to_float(q[g * p.q_stride_head + d]) * qscale;

    const T* kbase = static_cast<const T*>(p.k_cache) + h * p.c_stride_head;
    const T* vbase = static_cast<const T*>(p.v_cache) + h * p.c_stride_head;
    const int32_t* table = p.block_tables + s * p.bt_stride;
    const int row_bytes = D * static_cast<int>(sizeof(T));
    const int first = lo / bs, last = (len - 1) / bs;
    // Scores, token-major [n, G]: each key row is read once for all the query heads of its group.
    for (int b = first; b <= last; ++b) {
        if (b < last) prefetch_rows(kbase + table[b + 1] * p.c_stride_block, p.c_stride_row, bs, row_bytes);
        const T* block = kbase + table[b] * p.c_stride_block;
        for (int t = std::max(lo, b * bs); t < std::min(len, (b + 1) * bs); ++t) {
            const T* k = block + (t - b * bs) * p.c_stride_row;
            float* sc = scores.data() + (t - lo) * G;
            int g = 0;
            for (; g + 4 <= G; g += 4) score_row<4>(qf.data() + g * D, k, D, sc + g);
            switch (G - g) {
                case 3: score_row<3>(qf.data() + g * D, k, D, sc + g); break;
                case 2: score_row<2>(qf.data() + g * D, k, D, sc + g); break;
                case 1: score_row<1>(qf.data() + g * D, k, D, sc + g); break;
            }
        }
    }
    float* mx = stats.data();
    float* sum = stats.data() + G;
    for (int g = 0; g < G; ++g) mx[g] = scores[g], sum[g] = 0.0f;
    for (int i = 0; i < n; ++i) {
        float* x = scores.data() + i * G;
        for (int g = 0; g < G; ++g) {
            if (p.softcap > 0) x[g] = std::tanh(x[g]) * p.softcap;
            mx[g] = std::max(mx[g], x[g]);
        }
    }
    for (int i = 0; i < n; ++i) {
        float* x = scores.data() + i * G;
        for (int g = 0; g < G; ++g) {
            x[g] = std::exp(x[g] - mx[g]);
            sum[g] += x[g];
        }
    }
    std::fill(acc.begin(), acc.begin() + G * D, 0.0f);
    for (int b = first; b <= last; ++b) {
        if (b < last) prefetch_rows(vbase + table[b + 1] * p.c_stride_block, p.c_stride_row, bs, row_bytes);
        const T* block = vbase + table[b] * p.c_stride_block;
        for (int t = std::max(lo, b * bs); t < std::min(len, (b + 1) * bs); ++t) {
            const T* v = block + (t - b * bs) * p.c_stride_row;
            const float* w = scores.data() + (t - lo) * G;
            int g = 0;
            for (; g + 4 <= G; g += 4) accumulate_row<4>(w + g, v, D, acc.data() + g * D);
            switch (G - g) {
                case 3: accumulate_row<3>(w + g, v, D, acc.data() + g * D); break;
                case 2: accumulate_row<2>(w + g, v, D, acc.data() + g * D); break;
                case 1: accumulate_row<1>(w + g, v, D, acc.data() + g * D); break;
            }
        }
    }
    for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) store(out + g * D + d, acc[g * D + d] / sum[g]);
}

template <typename T>
void run(const Problem& p) {
    const int G = p.num_heads / p.num_kv_heads;
    const int tasks = p.num_seqs * p.num_kv_heads;
#pragma omp parallel num_threads(p.num_threads)
    {
        std::vector<float> qf(G * p.head_dim), acc(G * p.head_dim), stats(2 * G), scores;
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < tasks; ++task) {
            const int s = task / p.num_kv_heads, h = task % p.num_kv_heads;
            const size_t need = static_cast<size_t>(G) * std::max(p.seq_lens[s], 1);
            if (scores.size() < need) scores.resize(need);
            attend<T>(p, s, h, qf, scores, acc, stats);
        }
    }
}

}  // namespace

extern "C" int hf_paged_decode(const Problem* p, int dtype) {
    if (p->head_dim <= 0 || p->num_kv_heads <= 0 || p->num_heads % p->num_kv_heads) return 1;
    if (dtype == 0)
        run<float>(*p);
    else if (dtype == 1)
        run<uint16_t>(*p);
    else
        return 2;
    return 0;
}

extern "C" int hf_paged_problem_size() { return static_cast<int>(sizeof(Problem)); }
