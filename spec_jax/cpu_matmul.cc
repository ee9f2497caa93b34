// y[M, N] = x[M, K] . w[N, K]^T for a few rows M, as an XLA FFI handler.
//
// XLA:CPU's dots of 2-16 rows read the weights at a third of the bandwidth a
// one-row product reaches. Here the k loop is outermost within a panel of
// output columns, so every weight byte is read from memory once per call and
// serves every row of x from registers.
//
// Each output element is one vector accumulator over k in steps of the vector
// width, reduced in a fixed order at the end. That order depends on neither
// M nor the other rows, so a row's output is bitwise the same whether it is
// computed alone (a decode step) or with others (a verify).
//
// Weights are float32 or bfloat16 in their stored [out, in] layout, with x in
// the same dtype (the caller rounds x to bfloat16 for bfloat16 weights, as
// `model.matmul` defines the product); sums are float32.

#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using bf16 = uint16_t;


// One vector ISA: the widest the compiler targets (-march=native).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr int kWidth = 16;
using Vec = __m512;
using Mask = __mmask16;
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Mask TailMask(int64_t n) { return (Mask)((1u << n) - 1); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec Load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
inline Vec Widen(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline Vec Load(const bf16* p) {
  return Widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline Vec Load(const bf16* p, Mask m) {
  return Widen(_mm256_maskz_loadu_epi16(m, p));
}
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float Sum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec Broadcast(float a) { return _mm512_set1_ps(a); }
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline void Store(float* p, Vec v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }
inline void Prefetch(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
}
// glibc's vector expf (libmvec).
extern "C" __m512 _ZGVeN16v_expf(__m512);
inline Vec Exp(Vec x) { return _ZGVeN16v_expf(x); }
inline Vec Max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline float ReduceMax(Vec v) { return _mm512_reduce_max_ps(v); }
// Lane i: the sum of v[i]'s lanes, by a fixed tree of in-register transposes
// (pairs, then quads within 128-bit lanes, then across them).
inline Vec SumEach(const Vec* v) {
  Vec pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]) +
               _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 4; ++i)
    quads[i] = _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44) +
               _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE);
  Vec halves[2];
  for (int i = 0; i < 2; ++i)
    halves[i] = _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88) +
                _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD);
  return _mm512_shuffle_f32x4(halves[0], halves[1], 0x88) +
         _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kWidth = 8;
using Vec = __m256;
using Mask = __m256i;
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Mask TailMask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec Load(const float* p, Mask m) { return _mm256_maskload_ps(p, m); }
inline Vec Widen(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline Vec Load(const bf16* p) {
  return Widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Vec Load(const bf16* p, Mask m) {
  // No 16-bit masked load in AVX2: copy the tail out first.
  alignas(32) int32_t lanes[kWidth];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), m);
  bf16 tail[kWidth] = {};
  for (int n = 0; n < kWidth && lanes[n]; ++n) tail[n] = p[n];
  return Load(tail);
}
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float Sum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline Vec Broadcast(float a) { return _mm256_set1_ps(a); }
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline void Store(float* p, Vec v, Mask m) { _mm256_maskstore_ps(p, m, v); }
inline void Prefetch(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
}
extern "C" __m256 _ZGVdN8v_expf(__m256);
inline Vec Exp(Vec x) { return _ZGVdN8v_expf(x); }
inline Vec Max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline float ReduceMax(Vec v) {
  alignas(32) float lanes[kWidth];
  _mm256_store_ps(lanes, v);
  return *std::max_element(lanes, lanes + kWidth);
}
inline Vec SumEach(const Vec* v) {
  Vec pairs[4], quads[2];
  for (int i = 0; i < 4; ++i)
    pairs[i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]) +
               _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 2; ++i)
    quads[i] = _mm256_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44) +
               _mm256_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE);
  return _mm256_permute2f128_ps(quads[0], quads[1], 0x20) +
         _mm256_permute2f128_ps(quads[0], quads[1], 0x31);
}
#else
constexpr int kWidth = 1;
using Vec = float;
using Mask = bool;
inline Vec Zero() { return 0.0f; }
inline Mask TailMask(int64_t) { return true; }
inline Vec Load(const float* p) { return *p; }
inline Vec Load(const float* p, Mask) { return *p; }
inline Vec Load(const bf16* p) {
  uint32_t bits = uint32_t(*p) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline Vec Load(const bf16* p, Mask) { return Load(p); }
inline Vec Fma(Vec a, Vec b, Vec c) { return a * b + c; }
inline float Sum(Vec v) { return v; }
inline Vec Broadcast(float a) { return a; }
inline void Store(float* p, Vec v) { *p = v; }
inline void Store(float* p, Vec v, Mask) { *p = v; }
inline void Prefetch(const void*) {}
inline Vec Exp(Vec x) { return std::exp(x); }
inline Vec Max(Vec a, Vec b) { return std::max(a, b); }
inline float ReduceMax(Vec v) { return v; }
inline Vec SumEach(const Vec* v) { return v[0]; }
#endif

// Output columns per pass over k, and x rows per pass: with AVX-512, 4 x 6 =
// 24 vector accumulators, 4 weight vectors and 1 x vector fit its 32
// registers; AVX2 has 16, which 4 x 3 accumulators and 3 x vectors fill when
// the weights are loaded one at a time (Tile). A panel's weights (4 rows of
// k) stay in L1 while later row tiles reuse them.
constexpr int kPanel = 4;
constexpr int kRegisters = kWidth == 16 ? 32 : 16;
// How many panels ahead the weights are prefetched, into L2 (Prefetch). Over
// SmolLM2's weights on a 2-core Zen 4, prefetching one panel ahead into L1
// left memory idle while a core computed: 9 rows took 1.35-1.4x one row's
// time. Two panels ahead into L2, 1.05-1.1x.
constexpr int kAhead = 2;
// Whether a one-row product of T weights prefetches too. Over SmolLM2's
// weights on a 2-core Zen 2 (AVX2), a one-row product of every float32
// matrix took 19.9-21.0 ms with no software prefetch in its loop against
// 23.6-25.0 with it, in three runs (XLA's dot: 23.4-24.1), while 9 rows took
// 1.34x as long without it: one row's loop leaves the hardware prefetcher
// time to keep up, and the software prefetches only compete with it.
// bfloat16 weights, widened to float32 on AVX2, took 1.36x as long without
// them. Measured on Zen 2 only, and applied to every AVX2 build; AVX-512
// keeps them.
template <typename T>
constexpr bool kPrefetchOneRow = kWidth != 8 || !std::is_same_v<T, float>;
// Rows per tile at most. A tile's FMAs wait on their own accumulators, 4
// cycles or more each, so a tile of few rows is bound by that latency, not
// by the FMA units: on a 2-core Zen 2 (AVX2), over SmolLM2's weights and the
// built-in target's, 9 rows as tiles of 3 took 0.86-0.92 of their time as
// tiles of 2 and one of 1, and a tile of one row costs about what a tile of
// two does. So Columns splits M rows evenly into the fewest tiles.
constexpr int kRowTile = kWidth == 16 ? 6 : kWidth == 8 ? 3 : 6;

template <typename V>
inline void KeepInRegister(V& v) {
#if defined(__AVX2__)
  asm volatile("" : "+v"(v));
#endif
}

// The weights of a panel of P rows are one contiguous block, and the next
// panel follows it. Each of the `tiles` row tiles of this panel prefetches
// its share of the panel kAhead further on, spread over its k loop, so
// memory streams during all of this panel's compute rather than in a burst.
struct Ahead {
  const char* next;  // the weights kAhead panels on; nullptr past the end
  int64_t bytes;     // its size
  int64_t tile, tiles;
};

// y[r * ldy + p] = the sum of acc[r][p]'s lanes. SumEach reduces kWidth
// accumulators together, a fixed tree per accumulator whatever its
// neighbours, at a fraction of the shuffles of one reduction each.
template <int R, int P>
inline void StoreSums(Vec (&acc)[R][P], float* y, int64_t ldy) {
  constexpr int n = R * P, padded = (n + kWidth - 1) / kWidth * kWidth;
  const Vec* flat = &acc[0][0];
  alignas(64) float sums[padded];
  for (int i = 0; i < n; i += kWidth) {
    Vec group[kWidth];
    for (int j = 0; j < kWidth; ++j)
      group[j] = i + j < n ? flat[i + j] : Zero();
    Store(sums + i, SumEach(group));
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) y[r * ldy + p] = sums[r * P + p];
}

// Streams this tile's share of the panel kAhead on, an equal number of
// cache lines per step of k. Set up once per tile: the k loop does no
// division.
class Prefetcher {
 public:
  Prefetcher(const Ahead& ahead, int64_t steps) {
    if (!ahead.next) return;
    int64_t share = ahead.bytes / ahead.tiles;
    at_ = ahead.next + ahead.tile * share;
    per_step_ = ((share + steps - 1) / steps + 63) / 64 * 64;
  }
  void Step() {
    for (int64_t b = 0; b < per_step_; b += 64) Prefetch(at_ + b);
    at_ += per_step_;
  }

 private:
  const char* at_ = nullptr;
  int64_t per_step_ = 0;  // 0 for the last panel: nothing to stream
};

// y[r, p] for rows r < R of x and columns p < P: R x P dot products over k.
// Stream: prefetch the weights ahead (Prefetcher), compiled out where not.
template <typename T, int P, int R, bool Stream>
void Tile(const T* x, int64_t ldx, const T* w, int64_t k_size, float* y,
          int64_t ldy, const Ahead& ahead) {
  Vec acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = Zero();
  Prefetcher prefetcher(ahead, k_size / kWidth + 1);
  int64_t k = 0;
  for (; k + kWidth <= k_size; k += kWidth) {
    if constexpr (Stream) prefetcher.Step();
    if constexpr (R * P + P + 1 <= kRegisters) {
      Vec wv[P];
      for (int p = 0; p < P; ++p) wv[p] = Load(w + p * k_size + k);
      for (int r = 0; r < R; ++r) {
        Vec xv = Load(x + r * ldx + k);
        // Keep x in a register for its P uses: left alone, gcc folds the
        // load into each FMA, and P loads per row made 9 rows 20% slower.
        KeepInRegister(xv);
        for (int p = 0; p < P; ++p) acc[r][p] = Fma(wv[p], xv, acc[r][p]);
      }
    } else {
      // P weight vectors do not fit beside the accumulators: hold the R x
      // vectors instead and load each weight vector for its R uses.
      Vec xv[R];
      for (int r = 0; r < R; ++r) {
        xv[r] = Load(x + r * ldx + k);
        KeepInRegister(xv[r]);
      }
      for (int p = 0; p < P; ++p) {
        Vec wv = Load(w + p * k_size + k);
        KeepInRegister(wv);
        for (int r = 0; r < R; ++r) acc[r][p] = Fma(wv, xv[r], acc[r][p]);
      }
    }
  }
  if (k < k_size) {
    Mask mask = TailMask(k_size - k);
    Vec wv[P];
    for (int p = 0; p < P; ++p) wv[p] = Load(w + p * k_size + k, mask);
    for (int r = 0; r < R; ++r) {
      Vec xv = Load(x + r * ldx + k, mask);
      for (int p = 0; p < P; ++p) acc[r][p] = Fma(wv[p], xv, acc[r][p]);
    }
  }
  StoreSums(acc, y, ldy);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// bfloat16 weights with the bf16 dot-product instruction: each lane sums the
// products of a pair of adjacent k (x and w both bfloat16) into float32, so
// one instruction covers 32 k. Products of two bfloat16 values are exact in
// float32, but the instruction flushes subnormal inputs and outputs to zero
// and sums in its own order, so its results differ in the last bits from the
// widening path above (a CPU without AVX512_BF16), never between calls.
template <int P, int R>
void TileDp(const bf16* x, int64_t ldx, const bf16* w, int64_t k_size,
            float* y, int64_t ldy, const Ahead& ahead) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  int64_t k = 0;
  auto step = [&](auto load) {
    __m512bh wv[P];
    for (int p = 0; p < P; ++p) wv[p] = (__m512bh)load(w + p * k_size + k);
    for (int r = 0; r < R; ++r) {
      __m512bh xv = (__m512bh)load(x + r * ldx + k);
      KeepInRegister(xv);
      for (int p = 0; p < P; ++p)
        acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xv, wv[p]);
    }
  };
  Prefetcher prefetcher(ahead, k_size / 32 + 1);
  for (; k + 32 <= k_size; k += 32) {
    prefetcher.Step();
    step([](const bf16* q) { return _mm512_loadu_si512(q); });
  }
  if (k < k_size) {
    __mmask32 mask = (__mmask32)((1ull << (k_size - k)) - 1);
    step([mask](const bf16* q) { return _mm512_maskz_loadu_epi16(mask, q); });
  }
  StoreSums(acc, y, ldy);
}
#define SPEC_JAX_HAS_DP 1
#endif

template <typename T>
using TileFn = void (*)(const T*, int64_t, const T*, int64_t, float*, int64_t,
                        const Ahead&);

// TileDp always streams: no AVX-512 CPU turns a one-row stream off.
template <typename T, int P, int R, bool Stream = true>
constexpr TileFn<T> TileOf() {
#ifdef SPEC_JAX_HAS_DP
  if constexpr (std::is_same_v<T, bf16>) return TileDp<P, R>;
#endif
  return Tile<T, P, R, Stream>;
}

template <typename T, int P>
TileFn<T> TileFor(int rows, bool stream) {
  switch (rows) {
    case 1:
      if constexpr (!kPrefetchOneRow<T>)
        if (!stream) return TileOf<T, P, 1, false>();
      return TileOf<T, P, 1>();
    case 2: return TileOf<T, P, 2>();
    case 3: return TileOf<T, P, 3>();
    case 4: return TileOf<T, P, 4>();
    case 5: return TileOf<T, P, 5>();
    default: return TileOf<T, P, 6>();
  }
}

// Columns [n_begin, n_end) of y, every row.
template <typename T>
void Columns(const T* x, const T* w, float* y, int64_t m_size, int64_t n_size,
             int64_t k_size, int64_t n_begin, int64_t n_end) {
  int64_t tiles = (m_size + kRowTile - 1) / kRowTile;
  bool stream = m_size > 1 || kPrefetchOneRow<T>;
  // The first panels have no predecessor to stream them.
  const char* first = reinterpret_cast<const char*>(w + n_begin * k_size);
  int64_t warm =
      stream ? std::min<int64_t>(kAhead * kPanel, n_end - n_begin) : 0;
  for (int64_t b = 0; b < warm * k_size * int64_t(sizeof(T)); b += 64)
    Prefetch(first + b);
  for (int64_t n = n_begin; n < n_end;) {
    bool whole = n + kPanel <= n_end;
    bool next_whole = n + (kAhead + 1) * kPanel <= n_end;
    for (int64_t t = 0; t < tiles; ++t) {
      int64_t m = t * m_size / tiles;
      int rows = (int)((t + 1) * m_size / tiles - m);
      TileFn<T> tile = whole ? TileFor<T, kPanel>(rows, stream)
                             : TileFor<T, 1>(rows, stream);
      Ahead ahead{next_whole ? reinterpret_cast<const char*>(
                                   w + (n + kAhead * kPanel) * k_size)
                             : nullptr,
                  int64_t(kPanel * k_size * sizeof(T)), t, tiles};
      tile(x + m * k_size, k_size, w + n * k_size, k_size, y + m * n_size + n,
           n_size, ahead);
    }
    n += whole ? kPanel : 1;
  }
}

// Chunks of work claimed from a counter by the caller and by tasks on XLA's
// intra-op pool. The caller never waits for a chunk nobody has claimed, so it
// cannot deadlock on a pool whose threads are busy elsewhere; a task that
// starts after every chunk is claimed returns at once. shared_ptr keeps the
// counters alive for such late tasks.
struct Chunks {
  int64_t count;
  std::function<void(int64_t)> run;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Drain() {
    for (int64_t c; (c = next.fetch_add(1)) < count;) {
      run(c);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

int64_t UsableCores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return std::max(1u, std::thread::hardware_concurrency());
}

// The workers a call may use: the caller and the pool's threads, at most one
// per core the process may run on.
int64_t Workers(ffi::ThreadPool& pool) {
  static const int64_t cores = UsableCores();
  return std::max<int64_t>(1, std::min<int64_t>(cores, pool.num_threads() + 1));
}

// run(c) for every c < count, spread over the caller and the pool.
void ParallelFor(ffi::ThreadPool& pool, int64_t count,
                 std::function<void(int64_t)> run) {
  auto chunks = std::make_shared<Chunks>();
  chunks->count = count;
  chunks->run = std::move(run);
  for (int64_t i = 1; i < std::min(Workers(pool), count); ++i)
    pool.Schedule([chunks] { chunks->Drain(); });
  chunks->Drain();
  while (chunks->done.load(std::memory_order_acquire) < count)
    std::this_thread::yield();
}

template <typename T>
void Run(ffi::ThreadPool& pool, const T* x, const T* w, float* y,
         int64_t m_size, int64_t n_size, int64_t k_size) {
  // About 4 chunks per worker, whole panels each, so a late-starting worker
  // still finds work without the chunks getting small.
  int64_t panels = (n_size + kPanel - 1) / kPanel;
  int64_t per_chunk = std::max<int64_t>(1, panels / (4 * Workers(pool)));
  ParallelFor(pool, (panels + per_chunk - 1) / per_chunk, [=](int64_t c) {
    int64_t begin = c * per_chunk * kPanel;
    int64_t end = std::min(n_size, begin + per_chunk * kPanel);
    Columns(x, w, y, m_size, n_size, k_size, begin, end);
  });
}

ffi::Error SmallRowMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                              ffi::AnyBuffer w,
                              ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto x_dims = x.dimensions();
  auto w_dims = w.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2 || x_dims[1] != w_dims[1])
    return ffi::Error::InvalidArgument(
        "small_row_matmul takes x [M, K] and w [N, K]");
  if (x.element_type() != w.element_type())
    return ffi::Error::InvalidArgument(
        "small_row_matmul takes x and w in one dtype");
  int64_t m = x_dims[0], k = x_dims[1], n = w_dims[0];
  auto y_dims = y->dimensions();
  if (y_dims.size() != 2 || y_dims[0] != m || y_dims[1] != n)
    return ffi::Error::InvalidArgument(
        "small_row_matmul returns y [M, N]");
  switch (w.element_type()) {
    case ffi::F32:
      Run(pool, x.typed_data<float>(), w.typed_data<float>(), y->typed_data(),
          m, n, k);
      return ffi::Error::Success();
    case ffi::BF16:
      Run(pool, reinterpret_cast<const bf16*>(x.untyped_data()),
          reinterpret_cast<const bf16*>(w.untyped_data()), y->typed_data(), m,
          n, k);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument(
          "small_row_matmul takes float32 or bfloat16 weights");
  }
}

// out = x * cos + rotate_half(x) * sin over rows r of x [R, H, D], each of
// its H heads turned by the row's cos and sin [R, D / 2] (the "rotate half"
// pairing: dimension i turns with i + D / 2). Fused into its neighbours, XLA
// emits this multiply-add differently for one token and for several (its
// loops, and which products become FMAs, follow the layout the consumer
// wants), so a verify's rotated keys would differ from a step's in the last
// bit. Here every element is computed by the same code whatever R is.
ffi::Error RotateImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> cos,
                      ffi::Buffer<ffi::F32> sin,
                      ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto dims = x.dimensions();
  auto angles = cos.dimensions();
  if (dims.size() != 3 || dims[2] % 2 || angles.size() != 2 ||
      angles[0] != dims[0] || 2 * angles[1] != dims[2] ||
      sin.element_count() != cos.element_count())
    return ffi::Error::InvalidArgument(
        "rotate takes x [R, H, D] and cos, sin [R, D / 2]");
  int64_t rows = dims[0], heads = dims[1], half = dims[2] / 2;
  const float* in = x.typed_data();
  float* y = out->typed_data();
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos.typed_data() + r * half;
    const float* s = sin.typed_data() + r * half;
    for (int64_t h = 0; h < heads; ++h) {
      const float* first = in + (r * heads + h) * 2 * half;
      const float* second = first + half;
      float* y_first = y + (r * heads + h) * 2 * half;
      float* y_second = y_first + half;
      for (int64_t i = 0; i < half; ++i) {
        y_first[i] = first[i] * c[i] - second[i] * s[i];
        y_second[i] = second[i] * c[i] + first[i] * s[i];
      }
    }
  }
  return ffi::Error::Success();
}


// Vectors of D summed at once in the attention's weighted sum of values, and
// seen slots (an even number) per pass over the queries that share them.
constexpr int kGroup = 4;
constexpr int kRanks = 16;

// A token's seen slots in slot order: their keys (padded to whole vectors
// with the first one's) and values.
struct Seen {
  std::vector<const float*> keys, values;
  int64_t n = 0, padded = 0;
};

// Each worker's scratch for one group of queries.
struct Scratch {
  std::vector<Seen> tokens;    // per token of the group
  std::vector<float> weights;  // [queries, padded]: scores, then softmax
  std::vector<float> sums;     // [queries, 2, kGroup * kWidth]
};

// Attention of T new tokens per row over a cache of S slots, for passes the
// small-row kernel serves. out[b, t, k, g] is the softmax over the slots s
// that token t of row b sees (visible [B, T, S]) of q[b, t, k, g] . key_s /
// scale (soft-capped by cap when cap > 0), applied to value_s. The call's own
// tokens sit at slots [B, T], consecutive from slots[b, 0]: their keys and
// values are read from own_keys and own_values [B, K, T, D], the other
// slots' from the cache keys and values [B, K, S, D], so the call may leave
// its own keys unwritten.
//
// Every sum (the dot over D, the softmax's, the values') runs over the seen
// slots in the order of their rank among them, skipping the unseen ones, in
// code that depends on neither T nor B. A token that sees no slot gets
// zeros. So a token's output is bitwise the same in a step (its key read
// from the cache), a verify (read from own_keys) and a tree pass (its
// ancestors at other slots than a chain's, in the same order).
struct Attention {
  const float *q, *keys, *values, *own_keys, *own_values;
  const int32_t* slots;
  const bool* visible;
  int64_t batch, tokens, kv_heads, group, num_slots, dim;
  float scale, cap;

  // Token t of row b's seen slots, for kv head k.
  void Find(int64_t b, int64_t t, int64_t k, Seen& seen) const {
    const bool* visible_row = visible + (b * tokens + t) * num_slots;
    const int32_t* own = slots + b * tokens;
    const float* cache_k = keys + (b * kv_heads + k) * num_slots * dim;
    const float* cache_v = values + (b * kv_heads + k) * num_slots * dim;
    const float* new_k = own_keys + (b * kv_heads + k) * tokens * dim;
    const float* new_v = own_values + (b * kv_heads + k) * tokens * dim;
    seen.keys.resize(num_slots + kWidth);
    seen.values.resize(num_slots);
    int64_t n = 0;
    for (int64_t s = 0; s < num_slots; ++s) {
      if (!visible_row[s]) continue;
      int64_t j = s - own[0];
      bool is_own = j >= 0 && j < tokens && own[j] == s;
      seen.keys[n] = is_own ? new_k + j * dim : cache_k + s * dim;
      seen.values[n++] = is_own ? new_v + j * dim : cache_v + s * dim;
    }
    seen.n = n;
    seen.padded = (n + kWidth - 1) / kWidth * kWidth;
    // Padding's scores are overwritten by Softmax.
    for (int64_t i = n; i < seen.padded; ++i) seen.keys[i] = seen.keys[0];
  }

  // weight[0 : kWidth]: the scores of a vector of seen slots, whose keys are
  // block[0 : kWidth]. Each dot product is one vector accumulator over D in
  // order, its lanes summed by SumEach.
  void Scores(const float* query, const float* const* block,
              float* weight) const {
    Vec dots[kWidth];
    for (int j = 0; j < kWidth; ++j) dots[j] = Zero();
    int64_t d = 0;
    for (; d + kWidth <= dim; d += kWidth) {
      Vec qv = Load(query + d);
      for (int j = 0; j < kWidth; ++j)
        dots[j] = Fma(qv, Load(block[j] + d), dots[j]);
    }
    if (d < dim) {
      Mask mask = TailMask(dim - d);
      Vec qv = Load(query + d, mask);
      for (int j = 0; j < kWidth; ++j)
        dots[j] = Fma(qv, Load(block[j] + d, mask), dots[j]);
    }
    Store(weight, SumEach(dots) / Broadcast(scale));
  }

  // Scores weight[0 : padded] (n of them real) become softmax weights, the
  // exponentials summed lane-wise a vector at a time.
  void Softmax(float* weight, int64_t n, int64_t padded) const {
    if (cap > 0)
      for (int64_t i = 0; i < n; ++i) weight[i] = cap * std::tanh(weight[i] / cap);
    // Padding gets exp(-inf) = 0, so it adds nothing to the lane sums.
    const float inf = std::numeric_limits<float>::infinity();
    for (int64_t i = n; i < padded; ++i) weight[i] = -inf;
    Vec top = Broadcast(-inf);
    for (int64_t i = 0; i < padded; i += kWidth)
      top = Max(top, Load(weight + i));
    Vec shift = Broadcast(ReduceMax(top)), lanes = Zero();
    for (int64_t i = 0; i < padded; i += kWidth) {
      Vec e = Exp(Load(weight + i) - shift);
      Store(weight + i, e);
      lanes = lanes + e;
    }
    Vec total = Broadcast(Sum(lanes));
    for (int64_t i = 0; i < padded; i += kWidth)
      Store(weight + i, Load(weight + i) / total);
  }

  // Seen slots [begin, end) of the weighted sum of values at D offset d, V
  // vectors (the last masked by tail), added to sums [2, V vectors]: two
  // chains, even and odd rank, so that the FMAs' latency hides; begin is
  // even, so a rank's chain does not depend on how the slots are split.
  template <int V>
  void AddValues(const Seen& seen, const float* weight, int64_t begin,
                 int64_t end, int64_t d, Mask tail, float* sums) const {
    Vec even[V], odd[V];
    for (int v = 0; v < V; ++v) {
      even[v] = Load(sums + v * kWidth);
      odd[v] = Load(sums + (V + v) * kWidth);
    }
    auto add = [&](Vec* chain, int64_t i) {
      Vec w = Broadcast(weight[i]);
      const float* value = seen.values[i] + d;
      for (int v = 0; v + 1 < V; ++v)
        chain[v] = Fma(w, Load(value + v * kWidth), chain[v]);
      chain[V - 1] = Fma(w, Load(value + (V - 1) * kWidth, tail), chain[V - 1]);
    };
    int64_t i = begin;
    for (; i + 2 <= end; i += 2) {
      add(even, i);
      add(odd, i + 1);
    }
    if (i < end) add(even, i);
    for (int v = 0; v < V; ++v) {
      Store(sums + v * kWidth, even[v]);
      Store(sums + (V + v) * kWidth, odd[v]);
    }
  }

  // Queries [first, last) of kv head k of row b, numbered t * group + g:
  // their outputs. They read the same keys and values, so each pass over a
  // block of seen slots serves them all from L1, where one query at a time
  // streamed the whole cache from L2 per query. Each query's arithmetic is
  // the same as alone, whichever others share its group.
  void Group(int64_t b, int64_t k, int64_t first, int64_t last,
             Scratch& scratch, float* y) const {
    int64_t t_first = first / group, count = last - first;
    scratch.tokens.resize((last - 1) / group + 1 - t_first);
    int64_t widest = 0;
    for (size_t t = 0; t < scratch.tokens.size(); ++t) {
      Find(b, t_first + t, k, scratch.tokens[t]);
      widest = std::max(widest, scratch.tokens[t].padded);
    }
    auto seen_of = [&](int64_t i) -> const Seen& {
      return scratch.tokens[(first + i) / group - t_first];
    };
    auto index_of = [&](int64_t i) {  // in q's [B, T, K, G] order
      return ((b * tokens + (first + i) / group) * kv_heads + k) * group +
             (first + i) % group;
    };
    scratch.weights.resize(count * widest);
    float* weights = scratch.weights.data();
    for (int64_t r = 0; r < widest; r += kWidth)
      for (int64_t i = 0; i < count; ++i)
        if (r < seen_of(i).padded)
          Scores(q + index_of(i) * dim, &seen_of(i).keys[r],
                 weights + i * widest + r);
    for (int64_t i = 0; i < count; ++i)
      Softmax(weights + i * widest, seen_of(i).n, seen_of(i).padded);
    const int64_t stride = 2 * kGroup * kWidth;
    scratch.sums.resize(count * stride);
    for (int64_t d = 0; d < dim; d += kGroup * kWidth) {
      int vectors = (int)std::min<int64_t>(kGroup, (dim - d + kWidth - 1) / kWidth);
      Mask tail = TailMask(std::min<int64_t>(kWidth, dim - d - (vectors - 1) * kWidth));
      std::fill(scratch.sums.begin(), scratch.sums.end(), 0.0f);
      for (int64_t r = 0; r < widest; r += kRanks)
        for (int64_t i = 0; i < count; ++i) {
          const Seen& seen = seen_of(i);
          int64_t end = std::min(seen.n, r + kRanks);
          if (r >= end) continue;
          const float* weight = weights + i * widest;
          float* sums = scratch.sums.data() + i * stride;
          switch (vectors) {
            case 1: AddValues<1>(seen, weight, r, end, d, tail, sums); break;
            case 2: AddValues<2>(seen, weight, r, end, d, tail, sums); break;
            case 3: AddValues<3>(seen, weight, r, end, d, tail, sums); break;
            default: AddValues<kGroup>(seen, weight, r, end, d, tail, sums);
          }
        }
      for (int64_t i = 0; i < count; ++i) {
        const float* sums = scratch.sums.data() + i * stride;
        float* out = y + index_of(i) * dim + d;
        for (int v = 0; v < vectors; ++v) {
          Vec sum = Load(sums + v * kWidth) + Load(sums + (vectors + v) * kWidth);
          if (v + 1 < vectors) Store(out + v * kWidth, sum);
          else Store(out + v * kWidth, sum, tail);
        }
      }
    }
  }
};

ffi::Error AttendImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                      ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::F32> values,
                      ffi::Buffer<ffi::F32> own_keys,
                      ffi::Buffer<ffi::F32> own_values,
                      ffi::Buffer<ffi::S32> slots,
                      ffi::Buffer<ffi::PRED> visible, float scale, float cap,
                      ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto qd = q.dimensions(), cd = keys.dimensions(), nd = own_keys.dimensions();
  if (qd.size() != 5 || cd.size() != 4 || nd.size() != 4 ||
      cd[0] != qd[0] || cd[1] != qd[2] || cd[3] != qd[4] ||
      values.dimensions().size() != 4 || own_values.dimensions().size() != 4 ||
      values.element_count() != keys.element_count() ||
      own_values.element_count() != own_keys.element_count() ||
      nd[0] != qd[0] || nd[1] != qd[2] || nd[2] != qd[1] || nd[3] != qd[4] ||
      slots.element_count() != qd[0] * qd[1] ||
      visible.element_count() != qd[0] * qd[1] * cd[2] ||
      out->element_count() != q.element_count())
    return ffi::Error::InvalidArgument(
        "attend takes q [B, T, K, G, D], keys and values [B, K, S, D], own "
        "keys and values [B, K, T, D], slots [B, T] and visible [B, T, S]");
  Attention a{q.typed_data(), keys.typed_data(), values.typed_data(),
              own_keys.typed_data(), own_values.typed_data(),
              slots.typed_data(), visible.typed_data(),
              qd[0], qd[1], qd[2], qd[3], cd[2], qd[4], scale, cap};
  float* y = out->typed_data();
  // Work items: the queries of one kv head of one row, split into pieces
  // when there are too few heads to keep every worker busy.
  int64_t heads = a.batch * a.kv_heads, per_head = a.tokens * a.group;
  int64_t pieces = std::min(per_head, (2 * Workers(pool) + heads - 1) / heads);
  ParallelFor(pool, heads * pieces, [=](int64_t c) {
    thread_local Scratch scratch;
    int64_t head = c / pieces, piece = c % pieces;
    a.Group(head / a.kv_heads, head % a.kv_heads, per_head * piece / pieces,
            per_head * (piece + 1) / pieces, scratch, y);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SmallRowMatmul, SmallRowMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Attend, AttendImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Rotate, RotateImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// What the compiler targeted, for the log line and the results files.
extern "C" const char* SmallRowMatmulIsa() {
#if defined(SPEC_JAX_HAS_DP)
  return "avx512+bf16";
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2+fma";
#else
  return "scalar";
#endif
}
