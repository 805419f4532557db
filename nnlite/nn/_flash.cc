// nnlite's fused CPU attention: softmax(q k^T * scale) v computed in blocks of keys with
// an online softmax (FlashAttention, Dao et al. 2022, and its backward from FlashAttention-2),
// so the [T, S] probabilities never reach memory. nnlite compiles this file at first use
// (nnlite/nn/_flash.py) and registers two XLA FFI handlers:
//
//   nnlite_attention_fwd(q, k, v, mask) -> (o, lse)
//   nnlite_attention_bwd(q, k, v, mask, o, lse, do) -> (dq, dk, dv)
//
// q, o, do: [B, T, H, D]; k, v: [B, S, KV, D] (KV divides H: query head h reads kv head
// h / (H / KV)); lse: [B, H, T], the log of each query's softmax denominator, which the
// backward reads instead of recomputing the forward. float32, row-major, D a multiple of 16.
// mask: boolean [Bm, Hm, Tm, Sm], each axis 1 (broadcast) or B, H, T, S: True where a query
// may see a key (read only where the attribute masked is true). A query that sees no key
// gets the mean of every value, as XLA's attention gives it. Attributes: scale; causal
// (query i sees keys j <= i + offset); window (> 0: also j > i + offset - window); masked.
//
// Work is cut into (batch, head) units run on XLA's own thread pool; the caller takes units
// too. The products are one register-blocked kernel (C += A B, A read element by element,
// B by rows of 16 floats), written with GCC vector extensions so that it compiles to the
// machine's widest vectors.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "_pool.h"  // nnlite/core: ParallelFor
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kBlock = 64;  // keys per block (and queries per block)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

typedef float vf __attribute__((vector_size(64)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf splat(float x) { return vf{} + x; }

// C[MR rows][16 * NV] (+)= A[MR][K] B[K][16 * NV]; a(i, k) = A[i * ars + k * acs].
template <int MR, int NV>
inline void Tile(int K, const float* A, int64_t ars, int64_t acs, const float* B, int64_t ldb,
                 float* C, int64_t ldc, bool accumulate) {
  vf c[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int n = 0; n < NV; ++n) c[i][n] = accumulate ? load(C + i * ldc + 16 * n) : vf{};
  for (int k = 0; k < K; ++k) {
    vf b[NV];
    for (int n = 0; n < NV; ++n) b[n] = load(B + k * ldb + 16 * n);
    for (int i = 0; i < MR; ++i) {
      const vf a = splat(A[i * ars + k * acs]);
      for (int n = 0; n < NV; ++n) c[i][n] += a * b[n];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int n = 0; n < NV; ++n) store(C + i * ldc + 16 * n, c[i][n]);
}

template <int MR>
inline void Rows(int K, int N, const float* A, int64_t ars, int64_t acs, const float* B,
                 int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  int n = 0;
  for (; n + 64 <= N; n += 64) Tile<MR, 4>(K, A, ars, acs, B + n, ldb, C + n, ldc, accumulate);
  switch ((N - n) / 16) {
    case 3: Tile<MR, 3>(K, A, ars, acs, B + n, ldb, C + n, ldc, accumulate); break;
    case 2: Tile<MR, 2>(K, A, ars, acs, B + n, ldb, C + n, ldc, accumulate); break;
    case 1: Tile<MR, 1>(K, A, ars, acs, B + n, ldb, C + n, ldc, accumulate); break;
    default: break;
  }
}

// C[M][N] (+)= A[M][K] B[K][N], N a multiple of 16.
void Gemm(int M, int N, int K, const float* A, int64_t ars, int64_t acs, const float* B,
          int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  int i = 0;
  for (; i + 4 <= M; i += 4) Rows<4>(K, N, A + i * ars, ars, acs, B, ldb, C + i * ldc, ldc, accumulate);
  switch (M - i) {
    case 3: Rows<3>(K, N, A + i * ars, ars, acs, B, ldb, C + i * ldc, ldc, accumulate); break;
    case 2: Rows<2>(K, N, A + i * ars, ars, acs, B, ldb, C + i * ldc, ldc, accumulate); break;
    case 1: Rows<1>(K, N, A + i * ars, ars, acs, B, ldb, C + i * ldc, ldc, accumulate); break;
    default: break;
  }
}

// exp(x) for 16 values x <= 0 (softmax's shifted logits): 2^n * p(r), |r| <= ln2 / 2, the
// polynomial of Cephes' expf (relative error about 2e-7); anything below -87 (and -inf) is 0.
typedef int32_t vi __attribute__((vector_size(64)));
inline vf Exp(vf x) {
  const vf lowest = splat(-87.0f), magic = splat(12582912.0f);  // 1.5 * 2^23 rounds to int
  const vi dead = x < lowest;
  x = x < lowest ? lowest : x;
  const vf n = (x * 1.44269504088896341f + magic) - magic;
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vi bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += __builtin_convertvector(n, vi) << 23;
  bits = dead ? vi{} : bits;
  vf out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float Exp(float x) {
  float one[16] = {x};
  return Exp(load(one))[0];
}

inline float Sum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}
inline float Max(vf v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, v[i]);
  return m;
}
inline vf VMax(vf a, vf b) { return a > b ? a : b; }

// -inf at the keys of a block row [0, kBlock) outside [a, z).
inline void MaskRow(float* si, int64_t a, int64_t z) {
  for (int64_t j = 0; j < std::min<int64_t>(a, kBlock); ++j) si[j] = kNegInf;
  for (int64_t j = std::max<int64_t>(z, 0); j < kBlock; ++j) si[j] = kNegInf;
}

struct Shape {
  int64_t B, T, S, H, KV, D;
  float scale;
  bool causal;
  int64_t offset, window;
  // An optional boolean mask [Bm, Hm, Tm, Sm] (each 1 or the full size: broadcast), True
  // where a query may see a key, on top of the causal one; null: none.
  const bool* mask = nullptr;
  int64_t mb = 0, mh = 0, mt = 0, ms = 0;  // its strides (0 along a broadcast axis)
  // The mask's row for (b, h, t): element j at row[j * ms]; null without a mask.
  const bool* MaskRow(int64_t b, int64_t h, int64_t t) const {
    return mask == nullptr ? nullptr : mask + b * mb + h * mh + t * mt;
  }
  // Keys [lo, hi) that query t can see.
  int64_t KeyLo(int64_t t) const {
    return causal && window > 0 ? std::max<int64_t>(0, t + offset - window + 1) : 0;
  }
  int64_t KeyHi(int64_t t) const { return causal ? std::min(S, t + offset + 1) : S; }
  // Keys [0, Needed()) that some query sees: the ones a unit gathers.
  int64_t Needed() const { return KeyHi(T - 1); }
  // The block of keys j0 .. j0 + kBlock: [a, z) of its offsets that query t can see
  // (z <= a: none).
  std::pair<int64_t, int64_t> Visible(int64_t t, int64_t j0) const {
    return {std::max<int64_t>(KeyLo(t) - j0, 0), std::min<int64_t>(KeyHi(t) - j0, kBlock)};
  }
  // Where (b, h, t)'s log-denominator is in lse [B, H, T].
  int64_t Lse(int64_t b, int64_t h, int64_t t) const { return (b * H + h) * T + t; }
};

using nnlite::ParallelFor;

// -inf at the logits si[0, kBlock) of query t against keys j0.. that it may not see: outside
// [a, z) (causal, window) or masked.
void Hide(const Shape& s, float* si, int64_t a, int64_t z, int64_t b, int64_t h, int64_t t,
          int64_t j0) {
  if (a > 0 || z < kBlock) MaskRow(si, a, z);
  if (const bool* row = s.MaskRow(b, h, t)) {
    for (int64_t j = 0; j < kBlock && j0 + j < s.S; ++j)
      if (!row[(j0 + j) * s.ms]) si[j] = kNegInf;
  }
}

// Round up to a whole number of key blocks.
inline int64_t Padded(int64_t n) { return (n + kBlock - 1) / kBlock * kBlock; }

// Row r of x: [B, T, heads, D] at (b, t, head).
inline const float* Row(const float* x, int64_t b, int64_t t, int64_t head, int64_t T,
                        int64_t heads, int64_t D) {
  return x + ((b * T + t) * heads + head) * D;
}

// Gathers of one (batch, head)'s rows into contiguous buffers, zero past n rows.
void GatherRows(const float* x, int64_t b, int64_t head, int64_t T, int64_t heads, int64_t D,
                int64_t n, int64_t padded, float* out) {
  for (int64_t t = 0; t < n; ++t) std::memcpy(out + t * D, Row(x, b, t, head, T, heads, D), D * 4);
  std::memset(out + n * D, 0, (padded - n) * D * 4);
}
void GatherTransposed(const float* x, int64_t b, int64_t head, int64_t T, int64_t heads,
                      int64_t D, int64_t n, int64_t padded, float* rows, float* out) {
  GatherRows(x, b, head, T, heads, D, n, padded, rows);  // rows: [padded][D]
  for (int64_t t0 = 0; t0 < padded; t0 += 16)  // out: [D][padded], in 16 x 16 tiles
    for (int64_t d0 = 0; d0 < D; d0 += 16)
      for (int64_t d = d0; d < d0 + 16; ++d)
        for (int64_t t = t0; t < t0 + 16; ++t) out[d * padded + t] = rows[t * D + d];
}

// This thread's scratch buffer number i, at least n floats (reused from unit to unit).
float* Buffer(int i, int64_t n) {
  thread_local std::vector<float> buffers[16];
  if (static_cast<int64_t>(buffers[i].size()) < n) buffers[i].resize(n);
  return buffers[i].data();
}

void ForwardUnit(const Shape& s, const float* q, const float* k, const float* v, float* o,
                 float* lse, int64_t b, int64_t h) {
  const int64_t D = s.D, kvh = h / (s.H / s.KV), Sp = Padded(s.S);
  float* kr = Buffer(0, Sp * D);
  float* kt = Buffer(1, D * Sp);
  float* vb = Buffer(2, Sp * D);
  float* qb = Buffer(3, kBlock * D);
  float* sb = Buffer(4, kBlock * kBlock);
  float* ob = Buffer(5, kBlock * D);
  float* m = Buffer(6, kBlock);
  float* l = Buffer(7, kBlock);
  const int64_t need = s.Needed();
  GatherTransposed(k, b, kvh, s.S, s.KV, D, need, Sp, kr, kt);
  GatherRows(v, b, kvh, s.S, s.KV, D, need, Sp, vb);
  for (int64_t t0 = 0; t0 < s.T; t0 += kBlock) {
    const int64_t rows = std::min<int64_t>(kBlock, s.T - t0);
    for (int64_t i = 0; i < rows; ++i) {
      const float* r = Row(q, b, t0 + i, h, s.T, s.H, D);
      for (int64_t d = 0; d < D; ++d) qb[i * D + d] = r[d] * s.scale;
      m[i] = kNegInf, l[i] = 0.0f;
    }
    std::fill(ob, ob + rows * D, 0.0f);
    const int64_t lo = s.KeyLo(t0), hi = s.KeyHi(t0 + rows - 1);
    for (int64_t j0 = lo / kBlock * kBlock; j0 < hi; j0 += kBlock) {
      Gemm(rows, kBlock, D, qb, D, 1, kt + j0, Sp, sb, kBlock, false);
      for (int64_t i = 0; i < rows; ++i) {
        float* si = sb + i * kBlock;
        const auto [a, z] = s.Visible(t0 + i, j0);
        if (z <= a) {  // nothing visible in this block
          std::fill(si, si + kBlock, 0.0f);
          continue;
        }
        Hide(s, si, a, z, b, h, t0 + i, j0);
        vf mv = splat(m[i]);
        for (int j = 0; j < kBlock; j += 16) mv = VMax(mv, load(si + j));
        const float mx = Max(mv);
        if (mx == kNegInf) {  // every key of this block is masked
          std::fill(si, si + kBlock, 0.0f);
          continue;
        }
        const float corr = Exp(m[i] - mx);
        vf sum{};
        for (int j = 0; j < kBlock; j += 16) {
          const vf p = Exp(load(si + j) - mx);
          store(si + j, p);
          sum += p;
        }
        l[i] = l[i] * corr + Sum(sum);
        m[i] = mx;
        if (corr != 1.0f) {
          float* oi = ob + i * D;
          for (int64_t d = 0; d < D; d += 16) store(oi + d, load(oi + d) * corr);
        }
      }
      Gemm(rows, D, kBlock, sb, kBlock, 1, vb + j0 * D, D, ob, D, true);
    }
    for (int64_t i = 0; i < rows; ++i) {
      float* out = o + ((b * s.T + t0 + i) * s.H + h) * D;
      if (l[i] > 0.0f) {
        const float inv = 1.0f / l[i];
        for (int64_t d = 0; d < D; ++d) out[d] = ob[i * D + d] * inv;
        lse[s.Lse(b, h, t0 + i)] = m[i] + std::log(l[i]);
        continue;
      }
      // A query that sees no key: the mean of every value (XLA's attention gives every
      // masked logit one large negative value, so its softmax is uniform), lse -inf.
      std::fill(out, out + D, 0.0f);
      for (int64_t t = 0; t < s.S; ++t) {
        const float* r = Row(v, b, t, kvh, s.S, s.KV, D);
        for (int64_t d = 0; d < D; ++d) out[d] += r[d];
      }
      for (int64_t d = 0; d < D; ++d) out[d] /= static_cast<float>(s.S);
      lse[s.Lse(b, h, t0 + i)] = kNegInf;
    }
  }
}

// One (batch, kv head): every query head of its group, dq written per head, dk and dv
// summed over the group.
void BackwardUnit(const Shape& s, const float* q, const float* k, const float* v,
                  const float* o, const float* lse, const float* dout, float* dq, float* dk,
                  float* dv, int64_t b, int64_t kvh) {
  const int64_t D = s.D, G = s.H / s.KV, Sp = Padded(s.S);
  float* vr = Buffer(0, Sp * D);
  float* kt = Buffer(1, D * Sp);
  float* vt = Buffer(2, D * Sp);
  float* kb = Buffer(3, Sp * D);
  float* dkb = Buffer(4, Sp * D);
  float* dvb = Buffer(5, Sp * D);
  float* qb = Buffer(6, kBlock * D);
  float* dob = Buffer(7, kBlock * D);
  float* sb = Buffer(8, kBlock * kBlock);
  float* dpb = Buffer(9, kBlock * kBlock);
  float* dqb = Buffer(10, kBlock * D);
  float* delta = Buffer(11, kBlock);
  float* lrow = Buffer(12, kBlock);
  float* empty = Buffer(13, D);  // the sum of the cotangents of queries that see no key
  std::fill(empty, empty + D, 0.0f);
  const int64_t need = s.Needed();
  GatherTransposed(k, b, kvh, s.S, s.KV, D, need, Sp, kb, kt);
  GatherTransposed(v, b, kvh, s.S, s.KV, D, need, Sp, vr, vt);
  std::fill(dkb, dkb + Sp * D, 0.0f);
  std::fill(dvb, dvb + Sp * D, 0.0f);
  for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
    for (int64_t t0 = 0; t0 < s.T; t0 += kBlock) {
      const int64_t rows = std::min<int64_t>(kBlock, s.T - t0);
      for (int64_t i = 0; i < rows; ++i) {
        const float* qr = Row(q, b, t0 + i, h, s.T, s.H, D);
        const float* orow = Row(o, b, t0 + i, h, s.T, s.H, D);
        const float* dr = Row(dout, b, t0 + i, h, s.T, s.H, D);
        float dl = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
          qb[i * D + d] = qr[d];
          dob[i * D + d] = dr[d];
          dl += dr[d] * orow[d];
        }
        delta[i] = dl;
        lrow[i] = lse[s.Lse(b, h, t0 + i)];
        if (lrow[i] == kNegInf)  // sees no key: its output is the mean of every value
          for (int64_t d = 0; d < D; ++d) empty[d] += dr[d];
      }
      std::fill(dqb, dqb + rows * D, 0.0f);
      const int64_t lo = s.KeyLo(t0), hi = s.KeyHi(t0 + rows - 1);
      for (int64_t j0 = lo / kBlock * kBlock; j0 < hi; j0 += kBlock) {
        // s = q k^T (scaled below), p = exp(s * scale - lse); dp = do v^T.
        Gemm(rows, kBlock, D, qb, D, 1, kt + j0, Sp, sb, kBlock, false);
        Gemm(rows, kBlock, D, dob, D, 1, vt + j0, Sp, dpb, kBlock, false);
        for (int64_t i = 0; i < rows; ++i) {
          float* si = sb + i * kBlock;
          float* dpi = dpb + i * kBlock;
          const auto [a, z] = s.Visible(t0 + i, j0);
          if (lrow[i] == kNegInf || z <= a) {
            std::fill(si, si + kBlock, 0.0f);
            std::fill(dpi, dpi + kBlock, 0.0f);
            continue;
          }
          Hide(s, si, a, z, b, h, t0 + i, j0);
          for (int j = 0; j < kBlock; j += 16) {
            const vf p = Exp(load(si + j) * s.scale - lrow[i]);
            store(si + j, p);                                    // p
            store(dpi + j, p * (load(dpi + j) - delta[i]));      // ds (unscaled)
          }
        }
        // dv += p^T do; dk += ds^T q; dq += ds k (dk and dq scaled at the end).
        Gemm(kBlock, D, rows, sb, 1, kBlock, dob, D, dvb + j0 * D, D, true);
        Gemm(kBlock, D, rows, dpb, 1, kBlock, qb, D, dkb + j0 * D, D, true);
        Gemm(rows, D, kBlock, dpb, kBlock, 1, kb + j0 * D, D, dqb, D, true);
      }
      for (int64_t i = 0; i < rows; ++i) {
        float* out = dq + ((b * s.T + t0 + i) * s.H + h) * D;
        for (int64_t d = 0; d < D; ++d) out[d] = dqb[i * D + d] * s.scale;
      }
    }
  }
  for (int64_t t = 0; t < s.S; ++t) {
    float* ko = dk + ((b * s.S + t) * s.KV + kvh) * D;
    float* vo = dv + ((b * s.S + t) * s.KV + kvh) * D;
    for (int64_t d = 0; d < D; ++d) {
      ko[d] = t < need ? dkb[t * D + d] * s.scale : 0.0f;
      vo[d] = (t < need ? dvb[t * D + d] : 0.0f) + empty[d] / static_cast<float>(s.S);
    }
  }
}

ffi::Error Check(const Shape& s) {
  if (s.D % 16 != 0) return ffi::Error::InvalidArgument("nnlite_attention: head_dim % 16 != 0");
  if (s.KV <= 0 || s.H % s.KV != 0)
    return ffi::Error::InvalidArgument("nnlite_attention: kv heads must divide query heads");
  if (s.causal && s.offset < 0)
    return ffi::Error::InvalidArgument("nnlite_attention: causal offset must be >= 0");
  return ffi::Error::Success();
}

Shape MakeShape(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k,
                ffi::Buffer<ffi::PRED>& mask, float scale, bool causal, int64_t offset,
                int64_t window, bool masked) {
  auto qd = q.dimensions(), kd = k.dimensions();
  Shape s{qd[0], qd[1], kd[1], qd[2], kd[2], qd[3], scale, causal, offset, window};
  if (masked) {
    auto md = mask.dimensions();
    s.mask = mask.typed_data();
    s.ms = md[3] == 1 ? 0 : 1;
    s.mt = md[2] == 1 ? 0 : md[3];
    s.mh = md[1] == 1 ? 0 : md[2] * md[3];
    s.mb = md[0] == 1 ? 0 : md[1] * md[2] * md[3];
  }
  return s;
}

ffi::Error CheckMask(const Shape& s, ffi::Buffer<ffi::PRED>& mask, bool masked) {
  if (!masked) return ffi::Error::Success();
  auto md = mask.dimensions();
  const int64_t full[4] = {s.B, s.H, s.T, s.S};
  if (md.size() != 4)
    return ffi::Error::InvalidArgument("nnlite_attention: the mask must have 4 axes");
  for (int i = 0; i < 4; ++i)
    if (md[i] != 1 && md[i] != full[i])
      return ffi::Error::InvalidArgument("nnlite_attention: the mask does not broadcast");
  return ffi::Error::Success();
}

// The shape, the mask's strides and the checks both handlers start with.
ffi::Error Prepare(Shape& s, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k,
                   ffi::Buffer<ffi::PRED>& mask, float scale, bool causal, int64_t offset,
                   int64_t window, bool masked) {
  s = MakeShape(q, k, mask, scale, causal, offset, window, masked);
  if (auto e = Check(s); e.failure()) return e;
  return CheckMask(s, mask, masked);
}

using F32 = ffi::Buffer<ffi::F32>;

ffi::Error Forward(ffi::ThreadPool pool, F32 q, F32 k, F32 v, ffi::Buffer<ffi::PRED> mask,
                   ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> lse, float scale,
                   bool causal, int64_t offset, int64_t window, bool masked) {
  Shape s;
  if (auto e = Prepare(s, q, k, mask, scale, causal, offset, window, masked); e.failure())
    return e;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  float *op = o->typed_data(), *lp = lse->typed_data();
  ParallelFor(pool, s.B * s.H, [&](int64_t u) { ForwardUnit(s, qp, kp, vp, op, lp, u / s.H, u % s.H); });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, F32 q, F32 k, F32 v, ffi::Buffer<ffi::PRED> mask,
                    F32 o, F32 lse, F32 dout, ffi::ResultBuffer<ffi::F32> dq,
                    ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv, float scale,
                    bool causal, int64_t offset, int64_t window, bool masked) {
  Shape s;
  if (auto e = Prepare(s, q, k, mask, scale, causal, offset, window, masked); e.failure())
    return e;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const float *op = o.typed_data(), *lp = lse.typed_data(), *dp = dout.typed_data();
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(), *dvp = dv->typed_data();
  ParallelFor(pool, s.B * s.KV, [&](int64_t u) {
    BackwardUnit(s, qp, kp, vp, op, lp, dp, dqp, dkp, dvp, u / s.KV, u % s.KV);
  });
  return ffi::Error::Success();
}

// What both handlers bind first: XLA's thread pool, q, k, v and the mask.
auto Operands() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<ffi::Buffer<ffi::PRED>>();
}

// ... and last: the attributes.
template <typename Binding>
auto Attributes(Binding b) {
  return std::move(b)
      .template Attr<float>("scale")
      .template Attr<bool>("causal")
      .template Attr<int64_t>("offset")
      .template Attr<int64_t>("window")
      .template Attr<bool>("masked");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(NnliteAttentionFwd, Forward,
                              Attributes(Operands().Ret<F32>().Ret<F32>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NnliteAttentionBwd, Backward,
                              Attributes(Operands().Arg<F32>().Arg<F32>().Arg<F32>()
                                             .Ret<F32>().Ret<F32>().Ret<F32>()));
