// nnlite's CPU matrix product: an XLA FFI handler around Intel MKL's cblas_sgemm,
// cblas_dgemm and cblas_gemm_bf16bf16f32 (nnlite/core/_gemm.py finds MKL, sets its
// sequential threading layer and hands the three function pointers here once, so no
// pointer is baked into a compiled program).
//
//   nnlite_gemm(a, b) -> c,  c[..., m, n] = op(a)[..., m, k] @ op(b)[..., k, n]
//
// Row-major float32 or float64, or bfloat16 operands with a float32 result or that result
// rounded to bfloat16 (in the handler, block by block: no float32 copy written); op(x) = x^T
// (its last two axes swapped) where the attribute transpose_a / transpose_b is set; the
// leading (batch) axes of a and b are the result's or 1 (broadcast). A product is cut into
// pieces (its batch elements, else blocks of rows or of columns) that run single-threaded
// on XLA's own thread pool (_pool.h); where MKL could not be made single-threaded, one call
// on MKL's own threads.
//
// bfloat16 operands go to MKL's bfloat16 GEMM where it was handed one (a CPU with
// AVX512-BF16 or AMX). Otherwise each piece is widened to float32 block by block (at most
// kBlockRows x kBlockK of op(a) and kBlockK x kBlockCols of op(b) at a time, in this
// thread's scratch, which stays in cache) for MKL's sgemm, the blocks along k summed into
// the result: the same numbers as the float32 product of the widened operands, without
// writing them out whole.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "_pool.h"  // nnlite/core: ParallelFor
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

enum { kRowMajor = 101, kNoTrans = 111, kTrans = 112 };

// cblas_?gemm with operands of type I and a result of type O (alpha and beta: O)
template <typename I, typename O>
using cblas_gemm = void(int, int, int, int, int, int, O, const I*, int, const I*, int, O, O*,
                        int);

cblas_gemm<float, float>* g_sgemm = nullptr;
cblas_gemm<double, double>* g_dgemm = nullptr;
cblas_gemm<uint16_t, float>* g_bgemm = nullptr;  // bfloat16 operands (MKL_BF16), float32
                                                 // result; null: widened for g_sgemm
bool g_split = false;  // whether each call runs on one thread (then nnlite cuts products)

// Below this many multiply-adds a piece, cutting a product costs more than it gains.
constexpr int64_t kMinPieceMacs = int64_t(1) << 21;
// The largest blocks of a bfloat16 product. Widened, op(a)'s and op(b)'s blocks take 0.5 and
// 1 MB of float32 scratch, a rounded result's block 2 MB: within a core's L2 (2 MB on the
// Xeon measured) until MKL packs them. With k blocks of 1024 the LoRA step of a 135M Llama
// in bfloat16 took 1.14x its float32 time; with these, 1.02-1.05x.
constexpr int64_t kBlockRows = 512, kBlockK = 256, kBlockCols = 1024;

// dst[rows, cols] = src[rows, cols] (row stride ld) widened from bfloat16 to float32
void Widen(const uint16_t* src, int64_t ld, int64_t rows, int64_t cols, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* s = src + r * ld;
    float* d = dst + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      const uint32_t bits = uint32_t(s[c]) << 16;
      std::memcpy(d + c, &bits, sizeof bits);
    }
  }
}

// How many blocks of at most `most` n takes (the blocks then split n evenly).
inline int64_t Blocks(int64_t n, int64_t most) { return (n + most - 1) / most; }

// dst[rows, cols] (row stride ld) = src[rows, cols] rounded to bfloat16 (to nearest even,
// NaN kept a quiet NaN: XLA's convert)
void Round(const float* src, int64_t rows, int64_t cols, uint16_t* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = src + r * cols;
    uint16_t* d = dst + r * ld;
    for (int64_t c = 0; c < cols; ++c) {
      uint32_t bits;
      std::memcpy(&bits, s + c, sizeof bits);
      d[c] = (bits & 0x7fffffffu) > 0x7f800000u
                 ? uint16_t((bits >> 16) | 0x40u)
                 : uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
  }
}

// c[rows, cols] (row stride ldc) = op(a) op(b) over k for bfloat16 a and b (pointing at the
// piece's first row of op(a) and column of op(b)), into float32 `cf` or, rounded, into
// bfloat16 `cb`. In blocks of the result: MKL's bfloat16 GEMM where it was handed one,
// else each block's operands widened in blocks along k for sgemm, summed into the block;
// a rounded block is computed in this thread's float32 scratch first.
void Bf16Gemm(bool ta, bool tb, int64_t rows, int64_t cols, int64_t k, const uint16_t* a,
              int64_t lda, const uint16_t* b, int64_t ldb, float* cf, uint16_t* cb,
              int64_t ldc) {
  thread_local std::vector<float> sa, sb, sc;
  const int64_t nm = Blocks(rows, kBlockRows), nn = Blocks(cols, kBlockCols),
                nk = g_bgemm ? 1 : Blocks(k, kBlockK);
  const int64_t bm = (rows + nm - 1) / nm, bn = (cols + nn - 1) / nn, bk = (k + nk - 1) / nk;
  if (!g_bgemm && int64_t(sa.size()) < bm * bk) sa.resize(bm * bk);
  if (!g_bgemm && int64_t(sb.size()) < bk * bn) sb.resize(bk * bn);
  if (cb && int64_t(sc.size()) < bm * bn) sc.resize(bm * bn);
  const int oa = ta ? kTrans : kNoTrans, ob = tb ? kTrans : kNoTrans;
  for (int64_t i0 = 0; i0 < rows; i0 += bm) {
    const int64_t mi = std::min(bm, rows - i0);
    for (int64_t j0 = 0; j0 < cols; j0 += bn) {
      const int64_t nj = std::min(bn, cols - j0);
      float* c = cb ? sc.data() : cf + i0 * ldc + j0;
      const int64_t ld = cb ? nj : ldc;
      const uint16_t* ab = a + (ta ? i0 : i0 * lda);  // op(a)'s rows from i0
      const uint16_t* bb = b + (tb ? j0 * ldb : j0);  // op(b)'s columns from j0
      if (g_bgemm) {
        g_bgemm(kRowMajor, oa, ob, int(mi), int(nj), int(k), 1.0f, ab, int(lda), bb,
                int(ldb), 0.0f, c, int(ld));
      } else {
        for (int64_t p0 = 0; p0 < k; p0 += bk) {
          const int64_t kp = std::min(bk, k - p0);
          // op(a)[i0 : i0 + mi, p0 : p0 + kp] and op(b)[p0 : p0 + kp, j0 : j0 + nj], each
          // kept in its stored orientation (sgemm transposes as it reads)
          if (ta) Widen(ab + p0 * lda, lda, kp, mi, sa.data());
          else Widen(ab + p0, lda, mi, kp, sa.data());
          if (tb) Widen(bb + p0, ldb, nj, kp, sb.data());
          else Widen(bb + p0 * ldb, ldb, kp, nj, sb.data());
          g_sgemm(kRowMajor, oa, ob, int(mi), int(nj), int(kp), 1.0f, sa.data(),
                  int(ta ? mi : kp), sb.data(), int(tb ? kp : nj), p0 ? 1.0f : 0.0f, c, int(ld));
        }
      }
      if (cb) Round(c, mi, nj, cb + i0 * ldc + j0, ldc);
    }
  }
}

template <typename I, typename O>
struct Product {
  cblas_gemm<I, O>* gemm;  // float32, float64; bfloat16 operands: Bf16Gemm
  const I *A, *B;
  O* C;
  std::vector<int64_t> ad, bd, cd;  // dimensions of a, b, c
  int64_t m, n, k, split;
  bool ta, tb;

  // Piece p: batch element p / split, its block p % split of rows (m >= n) or columns.
  void Piece(int64_t p) const {
    const size_t r = cd.size();
    const int64_t i = p / split, s = p % split;
    int64_t rem = i, ai = 0, bi = 0, astride = 1, bstride = 1;
    for (size_t d = r - 2; d-- > 0;) {  // batch element i's matrices in A and B
      const int64_t idx = rem % cd[d];
      rem /= cd[d];
      if (ad[d] != 1) ai += idx * astride;
      if (bd[d] != 1) bi += idx * bstride;
      astride *= ad[d];
      bstride *= bd[d];
    }
    const int64_t lda = ad[r - 1], ldb = bd[r - 1];
    const I* a = A + ai * ad[r - 2] * lda;
    const I* b = B + bi * bd[r - 2] * ldb;
    O* c = C + i * m * n;
    int64_t rows = m, cols = n;
    if (m >= n) {  // rows [r0, r1) of c: rows of op(a)
      const int64_t r0 = m * s / split, r1 = m * (s + 1) / split;
      a += ta ? r0 : r0 * lda;
      c += r0 * n;
      rows = r1 - r0;
    } else {  // columns [c0, c1) of c: columns of op(b)
      const int64_t c0 = n * s / split, c1 = n * (s + 1) / split;
      b += tb ? c0 * ldb : c0;
      c += c0;
      cols = c1 - c0;
    }
    if (rows == 0 || cols == 0) return;
    if (k == 0) {  // a BLAS may leave c alone when k is 0: the product is zeros
      for (int64_t x = 0; x < rows; ++x) std::fill(c + x * n, c + x * n + cols, O(0));
      return;
    }
    if constexpr (std::is_same_v<I, uint16_t>) {
      if constexpr (std::is_same_v<O, uint16_t>)
        return Bf16Gemm(ta, tb, rows, cols, k, a, lda, b, ldb, nullptr, c, n);
      else
        return Bf16Gemm(ta, tb, rows, cols, k, a, lda, b, ldb, c, nullptr, n);
    } else {
      gemm(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, int(rows), int(cols),
           int(k), O(1), a, int(lda), b, int(ldb), O(0), c, int(n));
    }
  }
};

template <typename I, typename O>
ffi::Error Run(cblas_gemm<I, O>* gemm, ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b,
               ffi::Result<ffi::AnyBuffer> c, bool ta, bool tb) {
  // bfloat16 products need sgemm (MKL's bfloat16 GEMM, where handed one, comes with it)
  if ((std::is_same_v<I, uint16_t> ? (void*)g_sgemm : (void*)gemm) == nullptr)
    return ffi::Error::Internal("nnlite_gemm: no BLAS was set");
  auto ad = a.dimensions(), bd = b.dimensions(), cd = c->dimensions();
  const size_t r = cd.size();
  if (r < 2 || ad.size() != r || bd.size() != r)
    return ffi::Error::InvalidArgument("nnlite_gemm: operands and result differ in rank");
  Product<I, O> job;
  job.m = cd[r - 2], job.n = cd[r - 1], job.k = ta ? ad[r - 2] : ad[r - 1];
  if ((ta ? ad[r - 1] : ad[r - 2]) != job.m || (tb ? bd[r - 1] : bd[r - 2]) != job.k ||
      (tb ? bd[r - 2] : bd[r - 1]) != job.n)
    return ffi::Error::InvalidArgument("nnlite_gemm: operand shapes do not multiply");
  for (int64_t x : {job.m, job.n, job.k, ad[r - 1], bd[r - 1]})
    if (x > INT32_MAX) return ffi::Error::InvalidArgument("nnlite_gemm: a dimension over 2^31 - 1");
  int64_t batch = 1;
  for (size_t d = 0; d + 2 < r; ++d) {
    if ((ad[d] != cd[d] && ad[d] != 1) || (bd[d] != cd[d] && bd[d] != 1))
      return ffi::Error::InvalidArgument("nnlite_gemm: batch axes do not broadcast");
    batch *= cd[d];
  }
  if (batch == 0 || job.m == 0 || job.n == 0) return ffi::Error::Success();
  job.gemm = gemm, job.ta = ta, job.tb = tb;
  job.A = static_cast<const I*>(a.untyped_data());
  job.B = static_cast<const I*>(b.untyped_data());
  job.C = static_cast<O*>(c->untyped_data());
  job.ad.assign(ad.begin(), ad.end());
  job.bd.assign(bd.begin(), bd.end());
  job.cd.assign(cd.begin(), cd.end());
  const int64_t threads = g_split ? std::max<int64_t>(1, pool.num_threads()) : 1;
  const int64_t macs = job.m * job.n * std::max<int64_t>(job.k, 1);
  job.split = 1;
  if (batch < threads)
    job.split = std::max<int64_t>(
        1, std::min({threads, std::max(job.m, job.n), macs / kMinPieceMacs}));
  nnlite::ParallelFor(pool, batch * job.split, threads, [&](int64_t p) { job.Piece(p); });
  return ffi::Error::Success();
}

ffi::Error Gemm(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b,
                ffi::Result<ffi::AnyBuffer> c, bool transpose_a, bool transpose_b) {
  const auto in = a.element_type(), out = c->element_type();
  if (b.element_type() != in)
    return ffi::Error::InvalidArgument("nnlite_gemm: operands differ in dtype");
  if (in == ffi::F32 && out == ffi::F32)
    return Run(g_sgemm, pool, a, b, c, transpose_a, transpose_b);
  if (in == ffi::F64 && out == ffi::F64)
    return Run(g_dgemm, pool, a, b, c, transpose_a, transpose_b);
  if (in == ffi::BF16 && out == ffi::F32)
    return Run<uint16_t, float>(nullptr, pool, a, b, c, transpose_a, transpose_b);
  if (in == ffi::BF16 && out == ffi::BF16)
    return Run<uint16_t, uint16_t>(nullptr, pool, a, b, c, transpose_a, transpose_b);
  return ffi::Error::InvalidArgument(
      "nnlite_gemm: float32 or float64, or bfloat16 operands with a float32 or bfloat16 "
      "result");
}

}  // namespace

extern "C" void nnlite_gemm_set_blas(void* sgemm, void* dgemm, void* bgemm, int split) {
  g_sgemm = reinterpret_cast<cblas_gemm<float, float>*>(sgemm);
  g_dgemm = reinterpret_cast<cblas_gemm<double, double>*>(dgemm);
  g_bgemm = reinterpret_cast<cblas_gemm<uint16_t, float>*>(bgemm);
  g_split = split != 0;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(NnliteGemm, Gemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));
