// Grouped-query attention for a few queries a sequence (a decode step, a verified block) over a
// bfloat16 KV cache, on an AVX2 + FMA CPU, in float32 (see decode_attention.py).
//
// One work item is one sequence's kv head: its keys and values are converted to float32 once, into a
// buffer of this thread's, and every query row of the heads that share them (groups x T rows) reads
// them from there. A row's scores are dot products in a fixed order (an 8-lane sum over the head
// dimension, then across lanes), its softmax weights exp(s - max) divided by their sum at the end, and
// its output the weighted sum of the values in key order: each row is computed alone, in the same
// order whatever rows, keys past its own or sequences it is batched with, so a block of k + 1 tokens
// gives each token the bits of its own decode step. Masked keys weigh exactly 0.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "share.h"

namespace {
constexpr int64_t KB = 32;  // keys a block: 32 x 128 float32 values, 16 KB

inline __m256 bf16x8(const uint16_t* p) {  // 8 bfloat16 -> float32: the high half of each float
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// e^x for x <= 0 (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6 polynomial in r, times 2^n);
// x below -87 (a masked key's -inf included) gives exactly 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 floor = _mm256_set1_ps(-87.f);
  const __m256 live = _mm256_cmp_ps(x, floor, _CMP_GT_OQ);
  x = _mm256_max_ps(x, floor);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(pow2n)), live);
}

// The sums of eight vectors' lanes, one a lane, in a fixed order.
inline __m256 reduce8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// One query row's scores (q float32 [D]) against keys [L8][D] (the rows past L zero), eight keys at a
// time: s[l] = scale * q . k_l where mask[l] (uint8, L8 of them) lets the query see key l, else -inf.
inline void score_row(const float* q, const float* kf, int64_t L8, int64_t D, float scale, const uint8_t* mask,
                      float* s) {
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), sc = _mm256_set1_ps(scale);
  for (int64_t l0 = 0; l0 < L8; l0 += 8) {
    const float* k = kf + l0 * D;
    __m256 acc[8];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * D + d), acc[j]);
    }
    const __m256i seen = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mask + l0)));
    const __m256 hidden = _mm256_castsi256_ps(_mm256_cmpeq_epi32(seen, _mm256_setzero_si256()));
    _mm256_storeu_ps(s + l0, _mm256_blendv_ps(_mm256_mul_ps(reduce8(acc), sc), minus_inf, hidden));
  }
}

// A row's scores to softmax numerators in place, exp(s - max) (the masked 0); returns their sum.
inline float exp_row(float* s, int64_t L8) {
  __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t l = 0; l < L8; l += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + l));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  const __m256 top = _mm256_set1_ps(*std::max_element(lanes, lanes + 8));
  __m256 total = _mm256_setzero_ps();
  for (int64_t l = 0; l < L8; l += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + l), top));
    _mm256_storeu_ps(s + l, e);
    total = _mm256_add_ps(total, e);
  }
  return hsum(total);
}

// out[D] += sum over keys l0..l1 - 1 of w[l] * v[l] (v float32 [L][D]), 64 columns at a time in 8 registers.
inline void weigh_values(const float* w, const float* vf, int64_t l0, int64_t l1, int64_t D, float* out) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_loadu_ps(out + d0 + 8 * j);
    for (int64_t l = l0; l < l1; ++l) {
      const __m256 wl = _mm256_set1_ps(w[l]);
      const float* v = vf + l * D + d0;
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(v + 8 * j), acc[j]);
    }
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + d0 + 8 * j, acc[j]);
  }
}

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch converts (finite inputs)
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}
}  // namespace

// q [B, H, T, D], keys and values [B, kv_heads, L, D] (bfloat16, the last dim contiguous; any other
// strides: a view of the cache); mask [B, T, L] bool (uint8), whether query t sees key l. Returns
// [B, T, H, D] bfloat16 (the layout o_proj reads), head h reading kv head h / (H / kv_heads).
torch::Tensor attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor mask, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
              values.scalar_type() == at::kBFloat16, "attend: bfloat16 q, keys and values");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes(), "attend: 4-D q, keys, values");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t kv = keys.size(1), L = keys.size(2), groups = H / kv;
  TORCH_CHECK(keys.size(0) == B && keys.size(3) == D && H % kv == 0 && D % 64 == 0,
              "attend: keys [B, kv_heads, L, D] with D a multiple of 64 and heads a multiple of kv_heads");
  TORCH_CHECK(q.stride(3) == 1 && keys.stride(3) == 1 && values.stride(3) == 1, "attend: the last dim contiguous");
  auto m = mask.to(at::kByte).contiguous();
  TORCH_CHECK(m.dim() == 3 && m.size(0) == B && m.size(1) == T && m.size(2) == L, "attend: mask [B, T, L]");
  auto y = at::empty({B, T, H, D}, q.options());
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(keys.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>());
  const uint8_t* mp = m.data_ptr<uint8_t>();
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const float sc = static_cast<float>(scale);
  const int64_t rows = groups * T, L8 = (L + 7) / 8 * 8;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), ks2 = keys.stride(2);
  const int64_t vs0 = values.stride(0), vs1 = values.stride(1), vs2 = values.stride(2);
  share(B * kv, 1, [&](auto take) {  // a sequence's kv head at a time
    // this thread's buffers: the item's keys (rows past L zero) and values in float32, its query rows,
    // their scores (then weights), their outputs' sums; each query's mask, padded with 0 to L8
    std::vector<float> kf(L8 * D, 0.f), vf(L * D), qf(rows * D), s(rows * L8), out(rows * D), inv(rows);
    std::vector<uint8_t> seen(T * L8, 0);
    for (int64_t begin, end; take(begin, end);)
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv, g = item % kv;  // row i: head g * groups + i / T, query i % T
      const uint16_t *ks = kp + b * ks0 + g * ks1, *vs = vp + b * vs0 + g * vs1;
      for (int64_t l = 0; l < L; ++l)
        for (int64_t d = 0; d < D; d += 8) {
          _mm256_storeu_ps(&kf[l * D + d], bf16x8(ks + l * ks2 + d));
          _mm256_storeu_ps(&vf[l * D + d], bf16x8(vs + l * vs2 + d));
        }
      for (int64_t t = 0; t < T; ++t) std::memcpy(&seen[t * L8], mp + (b * T + t) * L, L);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t d = 0; d < D; d += 8)
          _mm256_storeu_ps(&qf[i * D + d], bf16x8(qp + b * qs0 + (g * groups + i / T) * qs1 + (i % T) * qs2 + d));
      // a block of keys at a time, in L1 while every row reads it
      for (int64_t l0 = 0; l0 < L8; l0 += KB)
        for (int64_t i = 0; i < rows; ++i)
          score_row(&qf[i * D], &kf[l0 * D], std::min(KB, L8 - l0), D, sc, &seen[(i % T) * L8 + l0], &s[i * L8 + l0]);
      for (int64_t i = 0; i < rows; ++i) inv[i] = 1.f / exp_row(&s[i * L8], L8);
      std::fill(out.begin(), out.end(), 0.f);
      for (int64_t l0 = 0; l0 < L; l0 += KB)
        for (int64_t i = 0; i < rows; ++i) weigh_values(&s[i * L8], &vf[0], l0, std::min(L, l0 + KB), D, &out[i * D]);
      for (int64_t i = 0; i < rows; ++i) {
        uint16_t* y_row = yp + ((b * T + i % T) * H + g * groups + i / T) * D;
        for (int64_t d = 0; d < D; ++d) y_row[d] = to_bf16(out[i * D + d] * inv[i]);
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "grouped-query attention of a few queries a sequence over a bfloat16 cache, in float32");
}
