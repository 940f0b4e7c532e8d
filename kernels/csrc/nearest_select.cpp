// The selection step of the certified nearest-candidate search (prompt.nearest), fused for CPU:
// one pass per query over its row of GEMM scores instead of torch's min, compare, nonzero,
// gather and scatter passes over the whole [n, K] matrix.
//
// For query i: m = min_k scores[i, k]; among the positions k with scores[i, k] <= m + slack[i]
// (the window that holds the true nearest row), the one with the smallest float64
// ||rows[k] - queries[i]||^2; exact ties go to the smallest k.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace {

double squared_distance(const float* row, const float* query, int64_t d) {
  double acc = 0.0;
#pragma omp simd reduction(+ : acc)
  for (int64_t c = 0; c < d; ++c) {
    const double diff = static_cast<double>(row[c]) - static_cast<double>(query[c]);
    acc += diff * diff;
  }
  return acc;
}

constexpr int64_t kBlock = 64;  // scores tested per vectorised step of the window scan

float row_min(const float* s, int64_t K) {
  float m = std::numeric_limits<float>::infinity();
#pragma omp simd reduction(min : m)
  for (int64_t k = 0; k < K; ++k) m = s[k] < m ? s[k] : m;  // the form that maps to vminps
  return m;
}

bool any_within(const float* s, int64_t count, float threshold) {
  int hit = 0;
#pragma omp simd reduction(| : hit)
  for (int64_t k = 0; k < count; ++k) hit |= s[k] <= threshold;
  return hit != 0;
}

}  // namespace

// scores: [n, K] float32 contiguous (||e_k||^2 - 2 <e_k, r_i>); slack: [n] float32; queries: [n, d]
// and rows: [K, d] float32 contiguous. Returns positions [n] int64. Scores must be finite.
torch::Tensor select_within_bound(torch::Tensor scores, torch::Tensor slack, torch::Tensor queries,
                                  torch::Tensor rows) {
  for (const auto& t : {scores, slack, queries, rows})
    TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.device().is_cpu(),
                "select_within_bound: contiguous float32 CPU tensors");
  TORCH_CHECK(scores.dim() == 2 && queries.dim() == 2 && rows.dim() == 2, "scores [n, K], queries [n, d], rows [K, d]");
  const int64_t n = scores.size(0), K = scores.size(1), d = rows.size(1);
  TORCH_CHECK(K > 0 && rows.size(0) == K && queries.size(0) == n && queries.size(1) == d && slack.numel() == n,
              "select_within_bound: shapes do not match");
  auto out = torch::empty({n}, scores.options().dtype(torch::kLong));
  const float* sp = scores.data_ptr<float>();
  const float* tp = slack.data_ptr<float>();
  const float* qp = queries.data_ptr<float>();
  const float* rp = rows.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  bool finite = true;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* s = sp + i * K;
      const float threshold = row_min(s, K) + tp[i];
      if (!std::isfinite(threshold)) {
        finite = false;
        op[i] = -1;
        continue;
      }
      double best = std::numeric_limits<double>::infinity();
      int64_t best_k = -1;
      for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
        const int64_t stop = std::min(k0 + kBlock, K);
        if (!any_within(s + k0, stop - k0, threshold)) continue;
        for (int64_t k = k0; k < stop; ++k) {
          if (s[k] > threshold) continue;
          const double dist = squared_distance(rp + k * d, qp + i * d, d);
          if (dist < best) best = dist, best_k = k;  // ascending k: a tie keeps the smaller k
        }
      }
      op[i] = best_k;
    }
  });
  TORCH_CHECK(finite, "select_within_bound: non-finite scores (NaN or inf queries)");
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("select_within_bound", &select_within_bound, "certified nearest-candidate selection (CPU)");
}
