// Every ISA variant of the kernel against a float64 product (1e-5 of the
// largest output) and, row by row, bitwise against its M = 1 computation,
// for M = 1..16, and of the attention kernel against a float64 softmax;
// built by tests/test_cpu_matmul.py with each -march.
#include "../spec_jax/cpu_matmul.cc"
#include <cstdio>
#include <random>
#include <vector>
#include <cmath>
static bf16 to_bf16(float f) { uint32_t b; memcpy(&b, &f, 4); b += 0x7FFF + ((b >> 16) & 1); return b >> 16; }
static float from_bf16(bf16 h) { uint32_t b = uint32_t(h) << 16; float f; memcpy(&f, &b, 4); return f; }
template <typename T> int check(const char* name, int64_t K, int64_t N) {
  std::mt19937 rng(0); std::normal_distribution<float> d;
  std::vector<T> x(16 * K), w(N * K); std::vector<double> xd(16*K), wd(N*K);
  for (int64_t i = 0; i < 16 * K; ++i) { float v = d(rng); if constexpr (std::is_same_v<T, bf16>) { x[i] = to_bf16(v); xd[i] = from_bf16(x[i]); } else { x[i] = v; xd[i] = v; } }
  for (int64_t i = 0; i < N * K; ++i) { float v = d(rng); if constexpr (std::is_same_v<T, bf16>) { w[i] = to_bf16(v); wd[i] = from_bf16(w[i]); } else { w[i] = v; wd[i] = v; } }
  std::vector<float> alone(16 * N);
  for (int r = 0; r < 16; ++r) Columns(x.data() + r * K, w.data(), alone.data() + r * N, 1, N, K, 0, N);
  int bad = 0;
  for (int m = 1; m <= 16; ++m) {
    std::vector<float> y(m * N);
    Columns(x.data(), w.data(), y.data(), m, N, K, 0, N);
    double maxref = 0, maxerr = 0;
    for (int r = 0; r < m; ++r) for (int64_t n = 0; n < N; ++n) {
      double ref = 0; for (int64_t k = 0; k < K; ++k) ref += xd[r*K+k] * wd[n*K+k];
      maxref = std::max(maxref, std::fabs(ref)); maxerr = std::max(maxerr, std::fabs(ref - y[r*N+n]));
      if (y[r*N+n] != alone[r*N+n]) bad++;
    }
    if (maxerr / maxref > 1e-5) { printf("%s M=%d rel err %g\n", name, m, maxerr / maxref); bad++; }
  }
  printf("%s %s K=%ld N=%ld: %s\n", SmallRowMatmulIsa(), name, K, N, bad ? "FAIL" : "ok");
  return bad;
}
// Two rows of 3 new tokens at slots first-first+2 and 0-2 of S, chain-causal,
// 2 key/value heads of 2 query heads, D = 20 (a vector tail); cap 0: none.
// Each kv head's queries computed together, and bitwise the same alone.
int check_attention(float cap, int64_t S, int32_t first) {
  const int64_t B = 2, T = 3, K = 2, G = 2, D = 20;
  std::mt19937 rng(1); std::normal_distribution<float> d;
  auto normal = [&](int64_t n) { std::vector<float> v(n); for (auto& x : v) x = d(rng); return v; };
  auto q = normal(B * T * K * G * D), keys = normal(B * K * S * D), values = normal(B * K * S * D);
  auto own_k = normal(B * K * T * D), own_v = normal(B * K * T * D);
  int32_t slots[B * T] = {first, first + 1, first + 2, 0, 1, 2};
  std::vector<char> visible_bytes(B * T * S);
  bool* visible = reinterpret_cast<bool*>(visible_bytes.data());
  for (int64_t i = 0; i < B * T; ++i) for (int64_t s = 0; s < S; ++s) visible[i * S + s] = s <= slots[i];
  const float scale = 3.0f;
  Attention a{q.data(), keys.data(), values.data(), own_k.data(), own_v.data(), slots, visible, B, T, K, G, S, D, scale, cap};
  std::vector<float> together(B * T * K * G * D), alone(together.size()); Scratch scratch;
  for (int64_t b = 0; b < B; ++b) for (int64_t k = 0; k < K; ++k) {
    a.Group(b, k, 0, T * G, scratch, together.data());
    for (int64_t i = 0; i < T * G; ++i) a.Group(b, k, i, i + 1, scratch, alone.data());
  }
  double maxerr = together == alone ? 0 : 1;
  for (int64_t i = 0; i < B * T * K * G; ++i) {
    const float* out = &together[i * D];
    int64_t k = i / G % K, t = i / (G * K) % T, b = i / (G * K * T);
    std::vector<double> p(S), ref(D, 0.0); double top = -1e300, total = 0;
    auto key = [&](int64_t s, const std::vector<float>& own, const std::vector<float>& cache) {
      int64_t j = s - slots[b * T];
      return j >= 0 && j < T ? &own[((b * K + k) * T + j) * D] : &cache[((b * K + k) * S + s) * D]; };
    for (int64_t s = 0; s <= slots[b * T + t]; ++s) {
      double dot = 0; const float* kv = key(s, own_k, keys);
      for (int64_t x = 0; x < D; ++x) dot += double(q[i * D + x]) * kv[x];
      p[s] = cap > 0 ? cap * std::tanh(dot / scale / cap) : dot / scale; top = std::max(top, p[s]);
    }
    for (int64_t s = 0; s <= slots[b * T + t]; ++s) total += (p[s] = std::exp(p[s] - top));
    for (int64_t s = 0; s <= slots[b * T + t]; ++s) {
      const float* vv = key(s, own_v, values);
      for (int64_t x = 0; x < D; ++x) ref[x] += p[s] / total * vv[x];
    }
    for (int64_t x = 0; x < D; ++x) maxerr = std::max(maxerr, std::fabs(ref[x] - out[x]));
  }
  printf("%s attention cap=%g S=%ld: %s\n", SmallRowMatmulIsa(), cap, S, maxerr < 1e-5 ? "ok" : "FAIL");
  return maxerr >= 1e-5;
}
int main() { int bad = check_attention(0, 11, 4) + check_attention(2, 11, 4) + check_attention(0, 80, 70); for (auto kn : {std::pair<int64_t,int64_t>{577, 37}, {100, 5}, {1536, 64}}) { bad += check<float>("f32", kn.first, kn.second); bad += check<bf16>("bf16", kn.first, kn.second); } return bad != 0; }
