// y = x @ w^T + b for bfloat16 x and b on an AVX2 + FMA CPU, accumulated in float32 (see avx2_linear.py); w in
// bfloat16, or in int8 with a float32 scale per output column (a draft model's weights at half the bytes). And
// the same for a float32 model: x, w, b and y in float32, the same tiles loading float32 weights.
//
// The weight is packed once into blocks of 16 output columns, [N / 16][K][16], so a block streams
// from memory in one run; x is laid out as panels of up to 6 rows (split evenly: 16 rows as 6, 5, 5),
// [panels][K][6], so a k step broadcasts a panel's values from one cache line. The micro-kernel keeps
// 6 x 16 float32 sums in 12 registers (the BLIS / ggml AVX2 shape) and reads each weight once per
// panel, converting bfloat16 to float32 in registers. With one panel (decoding, verifying at one or
// two streams) each block streams once from end to end, prefetched ahead. With more, k runs in chunks
// of KC so a panel and a block stay in L1, and the panels of one chunk prefetch the next chunk into L2
// between them: memory streams while they compute, where it used to idle during the later panels and
// the first panel waited on it (a batch of 8-20 rows of the 1.5 B target: each step in 0.78-0.88x).
//
// Every output is one float32 sum over k = 0..K-1 in order, whatever M is and whichever tile
// computes it: a row's result does not depend on the rows it is batched with (scoring k + 1 tokens
// gives each the bits of a one-token step), which F.linear and oneDNN do not promise.
//
// Where the CPU has AVX-512 BF16 (Intel Cooper Lake / Sapphire Rapids, AMD Zen 4 on), a bfloat16
// weight may be packed in pairs instead, [N / 32][K / 2][2][16][2] (two blocks of 16 columns side by
// side, so a work unit streams one run, 8-12 % faster than two here): one vdpbf16ps multiplies a pair of
// x by the pairs of 16 columns and adds both products to their float32 sums, where the AVX2 path spends
// two conversions and two FMAs per 8 columns on each k step. A block of a few rows then costs about
// what one row does (the AVX2 path is compute-bound from about 4 rows). Its sums run over the pairs in
// order, each adding product 2p and 2p + 1 (denormal products flushed, as the instruction does): still
// one fixed order per output, so still independent of the rows batched together.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "share.h"

namespace {
constexpr int64_t NB = 16;   // output columns per weight block
constexpr int64_t MT = 6;    // rows per x panel (and per micro-tile)
constexpr int64_t KC = 256;  // k steps per cache chunk

// How M rows split into panels of at most MT: as evenly as the count allows (16 rows: 6, 5, 5), so no
// panel is left with a row or two, too few independent sums to keep the multipliers busy.
struct Panels {
  int64_t count, base, extra;  // panel t holds base + 1 rows for t < extra, base after
  explicit Panels(int64_t M) : count((M + MT - 1) / MT), base(M / count), extra(M % count) {}
  int64_t rows(int64_t t) const { return base + (t < extra); }
  int64_t slot(int64_t m) const {  // row m's place in the panels: panel * MT + its row there
    const int64_t tall = extra * (base + 1);
    return m < tall ? m / (base + 1) * MT + m % (base + 1) : (extra + (m - tall) / base) * MT + (m - tall) % base;
  }
};

// Lines a tile prefetches into L2 as it runs, spread evenly over its k steps: with several panels, the
// next chunk's weights, so memory streams while the later panels compute from L1 (see matmul).
struct Ahead {
  const char* base = nullptr;
  int64_t lines = 0;
  // at each of kn steps: the next line, once per kn / lines steps
  inline void step(int64_t kn, int64_t& credit, int64_t& line) const {
    credit += lines;
    if (credit >= kn) {
      credit -= kn;
      _mm_prefetch(base + 64 * line++, _MM_HINT_T1);
    }
  }
};

// float32 -> bfloat16, round to nearest even (as torch converts; inputs here are finite)
inline void store_bf16x8(uint16_t* dst, __m256 v) {
  __m256i b = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), packed);
}

// A weight format: how 16 columns of one k step are stored and turned into two float32 vectors.
struct Bf16Weights {  // 32 bytes; a bfloat16 is the high half of a float32: interleaving zero words does it
  using T = uint16_t;
  // memory order within a block: columns 0-3, 8-11, 4-7, 12-15, what the unpacks of each 128-bit half want
  static constexpr int64_t order[NB] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
  static inline void load(const T* p, __m256& lo, __m256& hi) {
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    __m256i z = _mm256_setzero_si256();
    lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
    hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
  }
};

struct Int8Weights {  // 16 bytes; each column's scale is applied once, to its finished sum
  using T = int8_t;
  static constexpr int64_t order[NB] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  static inline void load(const T* p, __m256& lo, __m256& hi) {
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v)));
  }
};

struct F32Weights {  // 64 bytes, a cache line a k step; columns in order, as int8's
  using T = float;
  static inline void load(const T* p, __m256& lo, __m256& hi) {
    lo = _mm256_loadu_ps(p);
    hi = _mm256_loadu_ps(p + 8);
  }
};

// acc[R][16] += panel[k][0..R) * w[k][16] over kn steps, for B adjacent weight blocks (B = 2 gives
// 1-2 row tiles four independent FMA chains instead of two; each output's sum runs in the same order).
template <class W, int R, int B>
inline void tile(const float* panel, const typename W::T* w, int64_t w_stride, int64_t kn, float* acc_buf) {
  constexpr int64_t steps_per_line = 64 / (NB * sizeof(typename W::T));
  constexpr int64_t ahead = 2048 / (NB * sizeof(typename W::T));  // prefetch 2 KB ahead in each block
  __m256 acc[R][2 * B];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2 * B; ++j) acc[r][j] = _mm256_loadu_ps(acc_buf + (j / 2) * MT * NB + r * NB + (j % 2) * 8);
  for (int64_t k = 0; k < kn; ++k) {
    if (k % steps_per_line == 0)
      for (int b = 0; b < B; ++b) _mm_prefetch(reinterpret_cast<const char*>(w + b * w_stride + (k + ahead) * NB), _MM_HINT_T0);
    __m256 wv[2 * B];
    for (int b = 0; b < B; ++b) W::load(w + b * w_stride + k * NB, wv[2 * b], wv[2 * b + 1]);
    for (int r = 0; r < R; ++r) {
      __m256 xb = _mm256_broadcast_ss(panel + k * MT + r);
      for (int j = 0; j < 2 * B; ++j) acc[r][j] = _mm256_fmadd_ps(xb, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2 * B; ++j) _mm256_storeu_ps(acc_buf + (j / 2) * MT * NB + r * NB + (j % 2) * 8, acc[r][j]);
}

template <class W, int B>
inline void run_tile(int64_t rows, const float* panel, const typename W::T* w, int64_t w_stride, int64_t kn,
                     float* acc) {
  switch (rows) {
    case 1: tile<W, 1, B>(panel, w, w_stride, kn, acc); return;
    case 2: tile<W, 2, B>(panel, w, w_stride, kn, acc); return;
  }
  for (int b = 0; b < B; ++b, w += w_stride, acc += MT * NB) {  // 3-6 rows fill the registers with one block
    switch (rows) {
      case 3: tile<W, 3, 1>(panel, w, w_stride, kn, acc); break;
      case 4: tile<W, 4, 1>(panel, w, w_stride, kn, acc); break;
      case 5: tile<W, 5, 1>(panel, w, w_stride, kn, acc); break;
      default: tile<W, 6, 1>(panel, w, w_stride, kn, acc); break;
    }
  }
}

// 16 outputs of a row, rounded to bfloat16 or kept in float32
inline void store16(uint16_t* dst, __m256 lo, __m256 hi) {
  store_bf16x8(dst, lo);
  store_bf16x8(dst + 8, hi);
}
inline void store16(float* dst, __m256 lo, __m256 hi) {
  _mm256_storeu_ps(dst, lo);
  _mm256_storeu_ps(dst + 8, hi);
}

// Rows of y for the 16 columns of block nb from their float32 sums (acc: [panels][2][MT][NB]), times
// each column's scale (int8) plus bias; the last block may hold fewer than 16 columns.
template <class Y>
inline void finish(int64_t nb, const float* acc, int64_t M, const Panels& panels, const float* scales,
                   const float* bp, Y* yp, int64_t n_out) {
  const int64_t col = nb * NB, width = std::min<int64_t>(NB, n_out - col);
  float bias16[NB] = {0}, scale16[NB] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  if (bp) std::memcpy(bias16, bp + col, width * sizeof(float));
  if (scales) std::memcpy(scale16, scales + col, width * sizeof(float));
  __m256 b0 = _mm256_loadu_ps(bias16), b1 = _mm256_loadu_ps(bias16 + 8);
  __m256 s0 = _mm256_loadu_ps(scale16), s1 = _mm256_loadu_ps(scale16 + 8);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t slot = panels.slot(m);
    const float* a = acc + (slot / MT) * 2 * MT * NB + (slot % MT) * NB;
    Y out[NB];
    store16(out, _mm256_fmadd_ps(_mm256_loadu_ps(a), s0, b0), _mm256_fmadd_ps(_mm256_loadu_ps(a + 8), s1, b1));
    std::memcpy(yp + m * n_out + col, out, width * sizeof(Y));
  }
}

// The AVX2 path's tiles for weight format W: x panels of float32, STEP weight values a k step per block.
// A layout's tiles: X the x panels' element, T the weight's; a work unit (two blocks) of ``steps`` k steps
// holds unit(steps) weight values, from which its k step k0 starts at k0 * STEP.
template <class W>
struct Avx2Tiles {  // [N / 16][K][16]: the unit's two blocks one after the other
  using X = float;
  using T = typename W::T;
  static constexpr int64_t STEP = NB, CHUNK = sizeof(T) == 4 ? KC / 2 : KC;  // a chunk's weights: 16 KB at most
  static int64_t unit(int64_t steps) { return 2 * steps * NB; }
  static Ahead ahead(const T*, int64_t, int64_t) { return {}; }
  static void run(int64_t rows, bool both, const X* panel, const T* w, int64_t steps, int64_t kn, float* acc,
                  const Ahead&) {  // its chunk is two runs, one per block: left to the hardware
    if (both) run_tile<W, 2>(rows, panel, w, steps * NB, kn, acc);
    else run_tile<W, 1>(rows, panel, w, steps * NB, kn, acc);
  }
};

// y [M, n_out] (bfloat16 or float32) = x panels @ w^T, times each column's scale (int8), plus bias. ``steps``:
// the k steps of a panel and a block (K, or K / 2 pairs).
template <class Tiles, class Y = uint16_t>
void matmul(const typename Tiles::X* xp, int64_t M, int64_t steps, const typename Tiles::T* wp, int64_t blocks,
            const float* scales, const float* bp, Y* yp, int64_t n_out) {
  const Panels split(M);
  const int64_t panels = split.count;
  // Work unit: a pair of adjacent blocks (32 columns) over all rows; a thread takes runs of adjacent units
  // (one stream of weights), about eight runs a thread
  const int64_t pairs = (blocks + 1) / 2;
  share(pairs, std::max<int64_t>(1, pairs / (8 * at::get_num_threads())), [&](auto take) {
    std::vector<float> acc(panels * 2 * MT * NB);  // per panel: two blocks' sums, [panels][2][MT][NB]
    for (int64_t begin, end; take(begin, end);)
    for (int64_t p = begin; p < end; ++p) {
      const int64_t nb = 2 * p;
      const bool both = nb + 1 < blocks;
      std::fill(acc.begin(), acc.end(), 0.f);
      const typename Tiles::T* w = wp + p * Tiles::unit(steps);
      const int64_t chunk = panels == 1 ? steps : Tiles::CHUNK;  // chunking never changes a sum's order
      for (int64_t k0 = 0; k0 < steps; k0 += chunk) {
        const int64_t kn = std::min(chunk, steps - k0);
        // the next chunk (this unit's, or the next unit's first), its lines shared among the panels
        const Ahead next = panels == 1 ? Ahead{}
                           : k0 + kn < steps ? Tiles::ahead(w, steps, k0 + kn)
                           : p + 1 < end ? Tiles::ahead(w + Tiles::unit(steps), steps, 0) : Ahead{};
        for (int64_t t = 0; t < panels; ++t) {
          const int64_t rows = split.rows(t);
          const int64_t first = next.lines * t / panels, last = next.lines * (t + 1) / panels;
          Tiles::run(rows, both, xp + (t * steps + k0) * MT, w + k0 * Tiles::STEP, steps, kn,
                     acc.data() + t * 2 * MT * NB, Ahead{next.base + 64 * first, last - first});
        }
      }
      finish(nb, acc.data(), M, split, scales, bp, yp, n_out);
      if (both) finish(nb + 1, acc.data() + MT * NB, M, split, scales, bp, yp, n_out);
    }
  });
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
// The AVX-512 BF16 path: x panels of bfloat16 pairs [K / 2][MT] (x[2p] low, x[2p + 1] high), weights
// [K / 2][2][16][2] a unit. acc[R][B] += pairs over kn pair steps, for the unit's first B blocks.
template <int R, int B>
void pair_tile(const uint32_t* panel, const uint16_t* w, int64_t kn, float* acc_buf, const Ahead& next) {
  constexpr int64_t ahead = 4096 / (4 * NB * sizeof(uint16_t));  // 4 KB ahead, two lines a step
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_loadu_ps(acc_buf + b * MT * NB + r * NB);
  int64_t credit = 0, line = 0;
  for (int64_t k = 0; k < kn; ++k) {
    if (next.lines) next.step(kn, credit, line);
    const uint16_t* p = w + k * 4 * NB;
    _mm_prefetch(reinterpret_cast<const char*>(p + ahead * 4 * NB), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + ahead * 4 * NB + 2 * NB), _MM_HINT_T0);
    __m512i wv[B];
    for (int b = 0; b < B; ++b) wv[b] = _mm512_loadu_si512(p + b * 2 * NB);
    for (int r = 0; r < R; ++r) {
      __m512i xb = _mm512_set1_epi32(static_cast<int>(panel[k * MT + r]));
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)xb, (__m512bh)wv[b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) _mm512_storeu_ps(acc_buf + b * MT * NB + r * NB, acc[r][b]);
}

template <int B>
void run_pair_tile(int64_t rows, const uint32_t* panel, const uint16_t* w, int64_t kn, float* acc, const Ahead& next) {
  switch (rows) {  // 6 x 2 sums fill 12 of the 32 registers
    case 1: pair_tile<1, B>(panel, w, kn, acc, next); return;
    case 2: pair_tile<2, B>(panel, w, kn, acc, next); return;
    case 3: pair_tile<3, B>(panel, w, kn, acc, next); return;
    case 4: pair_tile<4, B>(panel, w, kn, acc, next); return;
    case 5: pair_tile<5, B>(panel, w, kn, acc, next); return;
    default: pair_tile<6, B>(panel, w, kn, acc, next); return;
  }
}

struct PairTiles {  // [N / 32][K / 2][2][16][2]: the unit's two blocks side by side at each pair step
  using X = uint32_t;
  using T = uint16_t;
  static constexpr int64_t STEP = 4 * NB, CHUNK = KC / 2;
  static int64_t unit(int64_t steps) { return steps * 4 * NB; }
  // the chunk from k step k0 of a unit at w: one run of bytes
  static Ahead ahead(const T* w, int64_t steps, int64_t k0) {
    return {reinterpret_cast<const char*>(w + k0 * STEP),
            static_cast<int64_t>(std::min(CHUNK, steps - k0) * STEP * sizeof(T) / 64)};
  }
  static void run(int64_t rows, bool both, const X* panel, const T* w, int64_t, int64_t kn, float* acc,
                  const Ahead& next) {
    if (both) run_pair_tile<2>(rows, panel, w, kn, acc, next);
    else run_pair_tile<1>(rows, panel, w, kn, acc, next);
  }
};
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
// The AVX-512 VNNI path for int8 weights: x quantized too, each row in blocks of QK values (a float32 scale a
// block: its largest magnitude over 127, each value rounded to nearest even), so one vpdpbusd multiplies 4
// int8 x by 4 int8 weights for each of 16 columns and adds them to int32 sums, where the AVX2 path spends
// four conversions and two FMAs per 16 weights. vpdpbusd takes one operand unsigned: the weights are stored
// plus 128 ([N / 16][K / 4][16][4] uint8), and a block's sum comes back less 128 times the block's x sum.
// Integer sums are exact; each block's adds to the row's float32 sum in k order, so a row's result does not
// depend on the rows batched with it, nor on which thread computes it.
constexpr int64_t QK = 32;  // x values per quantization block (8 steps of 4)

inline __m512 bf16x16_to_f32(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// Rows of x [M, K] (bfloat16) -> q [M, K] int8, scale d [M, K / QK], sum s [M, K / QK] of each block's q
void quantize_rows(const uint16_t* x, int64_t M, int64_t K, int8_t* q, float* d, int32_t* s) {
  const int64_t nb = K / QK;
  for (int64_t i = 0; i < M * nb; ++i) {
    const __m512 lo = bf16x16_to_f32(x + i * QK), hi = bf16x16_to_f32(x + i * QK + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * QK), _mm512_cvtsepi32_epi8(ql));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * QK + 16), _mm512_cvtsepi32_epi8(qh));
    d[i] = amax / 127.f;
    s[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
  }
}

// out[R][16] = sum over blocks of d * (q . w) for one block of 16 columns (w: its [K / 4][64] bytes)
template <int R>
void quad_tile(const int8_t* q, const float* d, const int32_t* s, int64_t K, const uint8_t* w, float* out) {
  const int64_t nb = K / QK;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = w + b * QK * NB;  // 512 bytes: 8 steps of 4 k x 16 columns
    for (int i = 0; i < 8; ++i) _mm_prefetch(reinterpret_cast<const char*>(p + 4096 + 64 * i), _MM_HINT_T0);
    __m512i wv[8];
    for (int i = 0; i < 8; ++i) wv[i] = _mm512_loadu_si512(p + 64 * i);
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = q + r * K + b * QK;
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();  // two chains, half the latency
      for (int i = 0; i < 8; i += 2) {
        int32_t x0, x1;
        std::memcpy(&x0, xr + 4 * i, 4);
        std::memcpy(&x1, xr + 4 * i + 4, 4);
        even = _mm512_dpbusd_epi32(even, wv[i], _mm512_set1_epi32(x0));
        odd = _mm512_dpbusd_epi32(odd, wv[i + 1], _mm512_set1_epi32(x1));
      }
      const __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(even, odd), _mm512_set1_epi32(128 * s[r * nb + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d[r * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * NB, acc[r]);
}

void run_quad_tile(int64_t rows, const int8_t* q, const float* d, const int32_t* s, int64_t K, const uint8_t* w,
                   float* out) {
  switch (rows) {
    case 1: quad_tile<1>(q, d, s, K, w, out); return;
    case 2: quad_tile<2>(q, d, s, K, w, out); return;
    case 3: quad_tile<3>(q, d, s, K, w, out); return;
    case 4: quad_tile<4>(q, d, s, K, w, out); return;
    case 5: quad_tile<5>(q, d, s, K, w, out); return;
    default: quad_tile<6>(q, d, s, K, w, out); return;
  }
}

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
#pragma GCC pop_options
}  // namespace

// w [N, K] (bfloat16, float32, or int8 quantized per output column) -> [ceil(N / 16), K, 16], the rows past N zero
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat ||
                               w.scalar_type() == at::kChar),
              "pack: a 2-D bfloat16, float32 or int8 weight");
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  int64_t N = w.size(0), K = w.size(1), blocks = (N + NB - 1) / NB;
  auto padded = at::zeros({blocks * NB, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  const int64_t* order = bf16 ? Bf16Weights::order : Int8Weights::order;  // int8 and float32: in column order
  auto index = torch::from_blob(const_cast<int64_t*>(order), {NB}, torch::kLong).clone();
  return padded.view({blocks, NB, K}).index_select(1, index).transpose(1, 2).contiguous();
}

// w [N, K] (bfloat16) -> [ceil(N / 32), ceil(K / 2), 64]: each unit's two blocks of 16 columns side by side,
// a pair of k at a time; the rows past N and the k past K zero
torch::Tensor pack_pairs(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_pairs: a 2-D bfloat16 weight");
  int64_t N = w.size(0), K = w.size(1), units = (N + 2 * NB - 1) / (2 * NB), K2 = (K + 1) / 2;
  auto padded = at::zeros({units * 2 * NB, 2 * K2}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded.view({units, 2, NB, K2, 2}).permute({0, 3, 1, 2, 4}).contiguous().view({units, K2, 4 * NB});
}

bool has_avx512_bf16() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  }();
  return has;
}

// What the entry points share: x as rows [M, K], y [M, n_out] (x's dtype) to fill, the bias in float32.
struct Rows {
  std::vector<int64_t> shape;  // y's shape: x's with n_out last
  torch::Tensor x2, y, bias;   // bias undefined when there is none
  int64_t M;
  Rows(const torch::Tensor& x, int64_t K, int64_t n_out, const c10::optional<torch::Tensor>& bias_opt)
      : shape(x.sizes().vec()), x2(x.reshape({-1, K}).contiguous()) {
    shape.back() = n_out;
    M = x2.size(0);
    y = at::empty({M, n_out}, x.options());
    if (bias_opt.has_value() && bias_opt->defined()) bias = bias_opt->to(at::kFloat).contiguous();
  }
  int64_t panels() const { return (M + MT - 1) / MT; }
  // x's row m goes to this element of panels of ``steps`` k steps ([panels][steps][MT]), its later ks MT apart
  int64_t first(int64_t m, int64_t steps) const {
    const int64_t slot = Panels(M).slot(m);
    return (slot / MT) * steps * MT + slot % MT;
  }
  const uint16_t* xs() const { return reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>()); }
  uint16_t* yp() { return reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()); }
  const float* xf() const { return x2.data_ptr<float>(); }
  float* yf() { return y.data_ptr<float>(); }
  const float* bp() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }
  torch::Tensor result() const { return y.view(shape); }
};

// y = (x @ w^T) * scales + bias: x bfloat16 [..., K]; packed from ``pack``; scales float32 [n_out] for an
// int8 weight; bias bfloat16 [n_out] or none. y bfloat16 [..., n_out]. Or x, a packed weight, bias and y all
// float32 (a float32 model).
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t n_out, c10::optional<torch::Tensor> scales_opt,
                     c10::optional<torch::Tensor> bias_opt) {
  const bool int8 = packed.scalar_type() == at::kChar, f32 = packed.scalar_type() == at::kFloat;
  TORCH_CHECK(f32 ? x.scalar_type() == at::kFloat
                  : x.scalar_type() == at::kBFloat16 && (int8 || packed.scalar_type() == at::kBFloat16),
              "linear: bfloat16 x with a bfloat16 or int8 packed weight, or float32 x with a float32 one");
  TORCH_CHECK(int8 == (scales_opt.has_value() && scales_opt->defined()), "linear: scales go with an int8 weight");
  const int64_t blocks = packed.size(0), K = packed.size(1);
  TORCH_CHECK(x.size(-1) == K, "linear: x has ", x.size(-1), " features, the weight ", K);
  Rows rows(x, K, n_out, bias_opt);
  const int64_t M = rows.M;
  if (M == 0) return rows.result();
  torch::Tensor scales;
  if (int8) scales = scales_opt->to(at::kFloat).contiguous();
  // x -> float32 panels [panels][K][MT], rows past M zero
  std::vector<float> xpanel(rows.panels() * K * MT, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    float* dst = xpanel.data() + rows.first(m, K);
    if (f32) {
      const float* src = rows.xf() + m * K;
      for (int64_t k = 0; k < K; ++k) dst[k * MT] = src[k];
      continue;
    }
    const uint16_t* src = rows.xs() + m * K;
    for (int64_t k = 0; k < K; ++k) {
      uint32_t bits = static_cast<uint32_t>(src[k]) << 16;
      std::memcpy(dst + k * MT, &bits, sizeof(float));
    }
  }
  if (f32)
    matmul<Avx2Tiles<F32Weights>>(xpanel.data(), M, K, packed.data_ptr<float>(), blocks, nullptr, rows.bp(),
                                  rows.yf(), n_out);
  else if (int8)
    matmul<Avx2Tiles<Int8Weights>>(xpanel.data(), M, K, packed.data_ptr<int8_t>(), blocks, scales.data_ptr<float>(),
                                   rows.bp(), rows.yp(), n_out);
  else
    matmul<Avx2Tiles<Bf16Weights>>(xpanel.data(), M, K,
                                   reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), blocks,
                                   nullptr, rows.bp(), rows.yp(), n_out);
  return rows.result();
}

// The same for a weight from ``pack_pairs`` (a CPU with AVX-512 BF16: ``has_avx512_bf16``).
torch::Tensor linear_pairs(torch::Tensor x, torch::Tensor packed, int64_t n_out, c10::optional<torch::Tensor> bias_opt) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 &&
              packed.size(2) == 4 * NB, "linear_pairs: bfloat16 x, a weight from pack_pairs");
  TORCH_CHECK(has_avx512_bf16(), "linear_pairs: this CPU has no AVX-512 BF16");
  const int64_t blocks = (n_out + NB - 1) / NB, K2 = packed.size(1), K = x.size(-1);
  TORCH_CHECK(packed.size(0) == (blocks + 1) / 2, "linear_pairs: the weight has ", 2 * NB * packed.size(0),
              " columns (padded), n_out is ", n_out);
  TORCH_CHECK((K + 1) / 2 == K2, "linear_pairs: x has ", K, " features, the weight ", 2 * K2, " (padded)");
  Rows rows(x, K, n_out, bias_opt);
  const int64_t M = rows.M;
  if (M == 0) return rows.result();
  // x -> panels of bfloat16 pairs [panels][K2][MT], rows past M and the k past K zero
  std::vector<uint32_t> xpanel(rows.panels() * K2 * MT, 0u);
  for (int64_t m = 0; m < M; ++m) {
    uint32_t* dst = xpanel.data() + rows.first(m, K2);
    const uint16_t* src = rows.xs() + m * K;
    for (int64_t p = 0; p < K2; ++p) {
      const uint32_t hi = 2 * p + 1 < K ? src[2 * p + 1] : 0;
      dst[p * MT] = static_cast<uint32_t>(src[2 * p]) | (hi << 16);
    }
  }
  matmul<PairTiles>(xpanel.data(), M, K2, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), blocks,
                    nullptr, rows.bp(), rows.yp(), n_out);
  return rows.result();
}

bool has_avx512_vnni() {
  static const bool has = cpu_has_vnni();
  return has;
}

// int8 w [N, K] (K a multiple of 32) -> [ceil(N / 16), K / 4, 64] uint8, each weight plus 128; the columns past N
// weigh 0 (128)
torch::Tensor pack_quads(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.size(1) % QK == 0,
              "pack_quads: a 2-D int8 weight with a multiple of ", QK, " input features");
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + NB - 1) / NB;
  auto padded = at::full({blocks * NB, K}, 128, w.options().dtype(at::kByte));
  padded.narrow(0, 0, N).copy_((w.to(at::kShort) + 128).to(at::kByte));
  return padded.view({blocks, NB, K / 4, 4}).permute({0, 2, 1, 3}).contiguous().view({blocks, K / 4, 4 * NB});
}

// y = (q(x) @ w^T) * scales + bias for a weight from ``pack_quads`` (a CPU with AVX-512 VNNI: ``has_avx512_vnni``):
// x bfloat16 [..., K], quantized per row in blocks of 32; scales float32 [n_out]; bias bfloat16 [n_out] or none
torch::Tensor linear_quads(torch::Tensor x, torch::Tensor packed, int64_t n_out, torch::Tensor scales,
                           c10::optional<torch::Tensor> bias_opt) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kByte && packed.dim() == 3 &&
              packed.size(2) == 4 * NB, "linear_quads: bfloat16 x, a weight from pack_quads");
  TORCH_CHECK(has_avx512_vnni(), "linear_quads: this CPU has no AVX-512 VNNI");
  const int64_t blocks = packed.size(0), K = 4 * packed.size(1);
  TORCH_CHECK(x.size(-1) == K, "linear_quads: x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(blocks == (n_out + NB - 1) / NB, "linear_quads: the weight has ", NB * blocks,
              " columns (padded), n_out is ", n_out);
  Rows rows(x, K, n_out, bias_opt);
  const int64_t M = rows.M, nb = K / QK;
  if (M == 0) return rows.result();
  const auto scale = scales.to(at::kFloat).contiguous();
  std::vector<int8_t> q(M * K);
  std::vector<float> d(M * nb);
  std::vector<int32_t> s(M * nb);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {  // a prefill's rows on every thread; a step's on one
    quantize_rows(rows.xs() + begin * K, end - begin, K, q.data() + begin * K, d.data() + begin * nb, s.data() + begin * nb);
  });
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* bp = rows.bp();
  uint16_t* yp = rows.yp();
  share(blocks, std::max<int64_t>(1, blocks / (8 * at::get_num_threads())), [&](auto take) {
    float out[MT * NB];
    for (int64_t begin, end; take(begin, end);)
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t col = blk * NB, width = std::min<int64_t>(NB, n_out - col);
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
          const int64_t R = std::min<int64_t>(MT, M - m0);
          run_quad_tile(R, q.data() + m0 * K, d.data() + m0 * nb, s.data() + m0 * nb, K, wp + blk * K * NB, out);
          for (int64_t r = 0; r < R; ++r) {
            uint16_t y16[NB];
            for (int64_t c = 0; c < width; ++c) {  // times the column's scale, plus bias, rounded to bfloat16
              const float v = out[r * NB + c] * sp[col + c] + (bp ? bp[col + c] : 0.f);
              uint32_t bits;
              std::memcpy(&bits, &v, 4);
              y16[c] = static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
            }
            std::memcpy(yp + (m0 + r) * n_out + col, y16, width * sizeof(uint16_t));
          }
        }
      }
  });
  return rows.result();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "pack a bfloat16, float32 or int8 weight [N, K] into [ceil(N / 16), K, 16]");
  m.def("linear", &linear, "y = (x @ w^T) * scales + b, bfloat16 (or float32) x and y, float32 sums");
  m.def("pack_pairs", &pack_pairs, "pack a bfloat16 weight [N, K] into [ceil(N / 32), ceil(K / 2), 64]");
  m.def("linear_pairs", &linear_pairs, "y = x @ w^T + b for a weight from pack_pairs (AVX-512 BF16)");
  m.def("has_avx512_bf16", &has_avx512_bf16, "whether this CPU runs linear_pairs");
  m.def("pack_quads", &pack_quads, "pack an int8 weight [N, K] into [ceil(N / 16), K / 4, 64] uint8 (plus 128)");
  m.def("linear_quads", &linear_quads, "y = (q(x) @ w^T) * scales + b for a weight from pack_quads (AVX-512 VNNI)");
  m.def("has_avx512_vnni", &has_avx512_vnni, "whether this CPU runs linear_quads");
}
