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
#include <utility>
#include <vector>

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
constexpr int64_t kQueries = 8;  // int8 selection: queries per block (the rows' constants read once per block)
constexpr int64_t kTile = 1024;  // int8 selection: rows per tile (their scores in L1)

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

// The int8 pass (prompt.nearest.certified_nearest_int8; kernels.types.Int8SelectPass): gram [n, K]
// int32, the exact integer products <E_k, R_i> of the rows' and queries' int8 codes. The score of row
// k for query i is c = r_sq[k] - 2 r_scale[k] q_scale[i] gram[i, k] (float64), within
// t = 2 (r_err[k] ||r_i|| + r_coded[k] q_err[i]) + margin (r_sq[k] + q_sq[i]) of the exact score.
// U = min_k (c + t) bounds the nearest row's exact score from above; among the rows with
// c - t <= U (they hold the nearest row), the smallest float64 ||rows[k] - queries[i]||^2, exact
// ties to the smallest k. Returns positions [n] int64. One sweep over gram (the memory-bound part)
// finds min c and keeps the rows within 2 max_k t of the running minimum (the others can neither
// set U nor pass); t is evaluated for those rows only.
torch::Tensor select_int8(torch::Tensor gram, torch::Tensor q_scale, torch::Tensor q_err, torch::Tensor q_sq,
                          torch::Tensor r_scale, torch::Tensor r_err, torch::Tensor r_coded, torch::Tensor r_sq,
                          double margin, torch::Tensor queries, torch::Tensor rows) {
  TORCH_CHECK(gram.scalar_type() == torch::kInt && gram.is_contiguous() && gram.dim() == 2 && gram.device().is_cpu(),
              "select_int8: gram must be a contiguous int32 [n, K] CPU tensor");
  for (const auto& t : {q_scale, q_err, q_sq, r_scale, r_err, r_coded, r_sq})
    TORCH_CHECK(t.scalar_type() == torch::kDouble && t.is_contiguous() && t.device().is_cpu(),
                "select_int8: contiguous float64 CPU vectors");
  for (const auto& t : {queries, rows})
    TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.device().is_cpu() && t.dim() == 2,
                "select_int8: contiguous float32 CPU queries [n, d] and rows [K, d]");
  const int64_t n = gram.size(0), K = gram.size(1), d = rows.size(1);
  TORCH_CHECK(K > 0 && rows.size(0) == K && queries.size(0) == n && queries.size(1) == d &&
                  q_scale.numel() == n && q_err.numel() == n && q_sq.numel() == n && r_scale.numel() == K &&
                  r_err.numel() == K && r_coded.numel() == K && r_sq.numel() == K,
              "select_int8: shapes do not match");
  auto out = torch::empty({n}, gram.options().dtype(torch::kLong));
  const int32_t* gp = gram.data_ptr<int32_t>();
  const double *qbp = q_scale.data_ptr<double>(), *qep = q_err.data_ptr<double>(), *qsp = q_sq.data_ptr<double>();
  const double *rap = r_scale.data_ptr<double>(), *rep = r_err.data_ptr<double>();
  const double *rcp = r_coded.data_ptr<double>(), *rsp = r_sq.data_ptr<double>();
  const float* qp = queries.data_ptr<float>();
  const float* rp = rows.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // the largest t of a query is at most 2 (max err ||r|| + max coded q_err) + margin (max sq + q_sq)
  const double err_max = r_err.max().item<double>(), coded_max = r_coded.max().item<double>();
  const double sq_max = r_sq.max().item<double>();
  bool finite = true;
  at::parallel_for(0, (n + kQueries - 1) / kQueries, 1, [&](int64_t begin, int64_t end) {
    // per query of a block: (k, c) of the rows that were within 2 t_max of the running min c when
    // seen, a superset of the rows within 2 t_max of the final min (those hold min (c + t) and the window)
    std::vector<std::pair<int64_t, double>> near[kQueries];
    std::vector<double> score(kTile);  // c of one tile of rows for one query
    for (int64_t block = begin; block < end; ++block) {
      const int64_t i0 = block * kQueries, m = std::min(kQueries, n - i0);
      double b2[kQueries], least[kQueries], reach[kQueries];
      for (int64_t j = 0; j < m; ++j) {
        const int64_t i = i0 + j;
        const double qn = std::sqrt(qsp[i]);
        b2[j] = 2.0 * qbp[i];
        least[j] = std::numeric_limits<double>::infinity();
        // a row with c > min c + t_max has c + t above the argmin's c + t; a row in the window
        // (c - t <= U <= min c + t_max) has c <= min c + 2 t_max
        reach[j] = 2.0 * (2.0 * (err_max * qn + coded_max * qep[i]) + margin * (sq_max + qsp[i]));
        near[j].clear();
      }
      // one sweep over G: each tile's c in L1, the rows' constants read once per block of queries
      for (int64_t k0 = 0; k0 < K; k0 += kTile) {
        const int64_t count = std::min(kTile, K - k0);
        const double *sq = rsp + k0, *scale = rap + k0;
        for (int64_t j = 0; j < m; ++j) {
          const int32_t* g = gp + (i0 + j) * K + k0;
          double low = least[j];
#pragma omp simd reduction(min : low)
          for (int64_t k = 0; k < count; ++k) {
            score[k] = sq[k] - b2[j] * scale[k] * static_cast<double>(g[k]);
            low = score[k] < low ? score[k] : low;
          }
          least[j] = low;
          const double limit = low + reach[j];
          for (int64_t k = 0; k < count; k += kBlock) {
            const int64_t stop = std::min(k + kBlock, count);
            int hit = 0;
#pragma omp simd reduction(| : hit)
            for (int64_t x = k; x < stop; ++x) hit |= score[x] <= limit;
            if (!hit) continue;
            for (int64_t x = k; x < stop; ++x)
              if (score[x] <= limit) near[j].emplace_back(k0 + x, score[x]);
          }
        }
      }
      for (int64_t j = 0; j < m; ++j) {
        const int64_t i = i0 + j;
        if (!std::isfinite(least[j] + reach[j])) {
          finite = false;
          continue;
        }
        const double qn = std::sqrt(qsp[i]), qe = qep[i], limit = least[j] + reach[j];
        auto slack = [&](int64_t k) { return 2.0 * (rep[k] * qn + rcp[k] * qe) + margin * (rsp[k] + qsp[i]); };
        double upper = std::numeric_limits<double>::infinity();
        for (const auto& [k, c] : near[j])
          if (c <= limit) upper = std::min(upper, c + slack(k));
        double best = std::numeric_limits<double>::infinity();
        int64_t best_k = -1;
        for (const auto& [k, c] : near[j]) {  // ascending k: a tie keeps the smaller k
          if (c > limit || c - slack(k) > upper) continue;
          const double dist = squared_distance(rp + k * d, qp + i * d, d);
          if (dist < best) best = dist, best_k = k;
        }
        op[i] = best_k;
      }
    }
  });
  TORCH_CHECK(finite, "select_int8: non-finite scores (NaN or inf queries)");
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("select_within_bound", &select_within_bound, "certified nearest-candidate selection (CPU)");
  m.def("select_int8", &select_int8, "certified nearest-candidate selection of the int8 pass (CPU)");
}
