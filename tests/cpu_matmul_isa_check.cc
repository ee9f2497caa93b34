// Every ISA variant of the kernel against a float64 product (1e-5 of the
// largest output) and, row by row, bitwise against its M = 1 computation,
// for M = 1..16; built by tests/test_cpu_matmul.py with each -march.
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
int main() { int bad = 0; for (auto kn : {std::pair<int64_t,int64_t>{577, 37}, {100, 5}, {1536, 64}}) { bad += check<float>("f32", kn.first, kn.second); bad += check<bf16>("bf16", kn.first, kn.second); } return bad != 0; }
