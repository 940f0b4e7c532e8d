// Exact causal attention over spans of a paged KV cache, with log-sum-exp, in one pass per
// (query token, KV head): the CPU twin of attention.paged.gather_spans + causal_part.
//
// Reads only cache rows [start[r], min(end[r], q_pos + 1)) of the query's span r: rows outside
// the span (e.g. a private prefix before `start`) are never addressed.
#include <torch/extension.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

struct Strides {  // element strides of a [num_blocks, H_kv, block_size, d] cache view
  int64_t block, head, row, dim;
  explicit Strides(const torch::Tensor& t) : block(t.stride(0)), head(t.stride(1)), row(t.stride(2)), dim(t.stride(3)) {}
  int64_t at(int64_t b, int64_t h, int64_t r) const { return b * block + h * head + r * row; }
};

// out[i] = scale * <q, k_i> for the n rows of one block; contiguous inner loops for both K layouts
// (row-major, or dimension-major as the CPU ISA kernels may store K blocks).
template <typename scalar_t>
void block_logits(const float* q, const scalar_t* k, const Strides& ks, int64_t n, int64_t d, float scale, float* out) {
  if (ks.row == 1) {  // dimension-major: k[c * ks.dim + i]
    for (int64_t c = 0; c < d; ++c) {
      const float qc = q[c] * scale;
      const scalar_t* kc = k + c * ks.dim;
      for (int64_t i = 0; i < n; ++i) out[i] += qc * static_cast<float>(kc[i]);
    }
    return;
  }
  const int64_t dim_stride = ks.dim;
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* ki = k + i * ks.row;
    float acc = 0.f;
    if (dim_stride == 1) {  // row-major: a contiguous, vectorised dot product
#pragma omp simd reduction(+ : acc)
      for (int64_t c = 0; c < d; ++c) acc += q[c] * static_cast<float>(ki[c]);
    } else {
      for (int64_t c = 0; c < d; ++c) acc += q[c] * static_cast<float>(ki[c * dim_stride]);
    }
    out[i] = acc * scale;
  }
}

template <typename scalar_t>
void paged_exact_kernel(const torch::Tensor& q, const torch::Tensor& q_pos, const torch::Tensor& q_span,
                        const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                        const torch::Tensor& block_table, const torch::Tensor& start, const torch::Tensor& end,
                        double scale, torch::Tensor& out, torch::Tensor& lse) {
  const int64_t m = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  const int64_t groups = heads / kv_heads, table_stride = block_table.stride(0);
  const float* qp = q.data_ptr<float>();
  const int64_t* pos = q_pos.data_ptr<int64_t>();
  const int64_t* span = q_span.data_ptr<int64_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t* lo_row = start.data_ptr<int64_t>();
  const int64_t* hi_row = end.data_ptr<int64_t>();
  const scalar_t* kp = key_cache.data_ptr<scalar_t>();
  const scalar_t* vp = value_cache.data_ptr<scalar_t>();
  const Strides ks(key_cache), vs(value_cache);
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, m * kv_heads, 1, [&](int64_t begin, int64_t stop) {
    std::vector<float> logits;  // [groups, rows]
    for (int64_t task = begin; task < stop; ++task) {
      const int64_t t = task / kv_heads, kvh = task % kv_heads, r = span[t];
      const int64_t lo = lo_row[r], hi = std::min(hi_row[r], pos[t] + 1), rows = hi - lo;
      const int32_t* blocks = table + r * table_stride;
      logits.assign(groups * rows, 0.f);
      for (int64_t p = lo; p < hi;) {  // one cache block at a time: rows [p, p + n)
        const int64_t offset = p % block_size, n = std::min(block_size - offset, hi - p);
        const scalar_t* k = kp + ks.at(blocks[p / block_size], kvh, offset);
        for (int64_t g = 0; g < groups; ++g)
          block_logits(qp + (t * heads + kvh * groups + g) * d, k, ks, n, d, fscale, logits.data() + g * rows + (p - lo));
        p += n;
      }
      for (int64_t g = 0; g < groups; ++g) {
        float* lg = logits.data() + g * rows;
        const float top = *std::max_element(lg, lg + rows);
        float total = 0.f;
        for (int64_t i = 0; i < rows; ++i) total += (lg[i] = std::exp(lg[i] - top));
        const int64_t h = kvh * groups + g;
        float* o = op + (t * heads + h) * d;
        std::fill(o, o + d, 0.f);
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t p = lo + i;
          const scalar_t* v = vp + vs.at(blocks[p / block_size], kvh, p % block_size);
          const float w = lg[i];
          if (vs.dim == 1) {
            for (int64_t c = 0; c < d; ++c) o[c] += w * static_cast<float>(v[c]);
          } else {
            for (int64_t c = 0; c < d; ++c) o[c] += w * static_cast<float>(v[c * vs.dim]);
          }
        }
        const float inv = 1.f / total;
        for (int64_t c = 0; c < d; ++c) o[c] *= inv;
        lp[t * heads + h] = top + std::log(total);
      }
    }
  });
}

}  // namespace

// q: [m, H_q, d] float32; q_pos, q_span: [m] int64; caches: [nb, H_kv, bs, d] (any strides);
// block_table: [R, max_blocks] int32; start, end: [R] int64. Returns out [m, H_q, d] and
// lse [m, H_q], float32. The caller guarantees start[r] <= q_pos < end[r] for each query.
std::vector<torch::Tensor> paged_exact(torch::Tensor q, torch::Tensor q_pos, torch::Tensor q_span,
                                       torch::Tensor key_cache, torch::Tensor value_cache,
                                       torch::Tensor block_table, torch::Tensor start, torch::Tensor end,
                                       double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(), "q: [m, H, d] contiguous float32");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(), "caches: [nb, H_kv, bs, d]");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "caches of one dtype");
  TORCH_CHECK(key_cache.size(3) == q.size(2) && q.size(1) % key_cache.size(1) == 0, "head dims / GQA groups");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt && block_table.stride(1) == 1, "block_table: int32 rows");
  for (const auto& t : {q_pos, q_span, start, end})
    TORCH_CHECK(t.scalar_type() == torch::kLong && t.is_contiguous(), "positions: contiguous int64");
  auto out = torch::empty_like(q);
  auto lse = torch::empty({q.size(0), q.size(1)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key_cache.scalar_type(), "paged_exact", [&] {
    paged_exact_kernel<scalar_t>(q, q_pos, q_span, key_cache, value_cache, block_table, start, end, scale, out, lse);
  });
  return {out, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_exact", &paged_exact, "exact causal attention over paged-cache spans, with lse (CPU)");
}
