// Fused backward of a group: per unique row, the gradient summed over its
// occurrences, then one optimizer step on the row, in place. Clipping clamps
// each bag's output gradient as it is read, before it is summed into rows
// (FBGEMM's TBE clamps its output's gradient so).
//
// The training lookup already grouped occurrences by row (unique_index), so
// no sort of slots is needed: a counting pass lists each unique's
// occurrences in ascending order (the order the sum is taken in, for any
// thread count), then threads take ranges of uniques; every row is written
// by one thread only. Float ops follow ops/optimizer_update.py's order, in
// float32 with Python scalars rounded to float32 as torch does. Float16 and
// bfloat16 rows are read to float32, take the same float32 update, and are
// stored rounded to nearest even (row_dtype.h), as the torch path's
// `.to(weights.dtype)` stores them.
#include <algorithm>
#include <cmath>
#include <new>
#include <vector>

#include "kvemb_native.h"
#include "parallel.h"
#include "prefetch.h"
#include "row_dtype.h"
#include "workspace.h"

namespace kvemb {
namespace {

constexpr int64_t kUniquesPerTask = 1024;
// Rows prefetched ahead: the update is a read-modify-write of rows scattered
// over the table, so each row's miss is started a few uniques early.
constexpr int64_t kRowsAhead = 4;


int64_t element_bytes(int64_t dtype) { return dtype == KV_ROWS_FLOAT32 ? 4 : 2; }

struct Optimizer {
  int64_t kind;
  float eps, beta1, one_minus_beta1, beta2, one_minus_beta2, decay, max_gradient;
  double beta1_d, beta2_d, decay_d;
  int64_t decay_mode;
  bool clip;

  explicit Optimizer(const KvBackwardArgs& a)
      : kind(a.kind),
        eps(static_cast<float>(a.eps)),
        beta1(static_cast<float>(a.beta1)),
        one_minus_beta1(static_cast<float>(1.0 - a.beta1)),
        beta2(static_cast<float>(a.beta2)),
        one_minus_beta2(static_cast<float>(1.0 - a.beta2)),
        decay(static_cast<float>(a.weight_decay)),
        max_gradient(static_cast<float>(a.max_gradient)),
        beta1_d(a.beta1),
        beta2_d(a.beta2),
        decay_d(a.weight_decay),
        decay_mode(a.weight_decay ? a.weight_decay_mode : 0),
        clip(a.gradient_clipping != 0) {}

  // An element of a bag's output gradient as the rows take it (clipped).
  float clipped(float g) const {
    return clip ? std::min(std::max(g, -max_gradient), max_gradient) : g;
  }

  // One step on row w (dim floats) with state s and gradient g (overwritten).
  void step(float* w, float* s, float* g, int64_t dim, double lr_d, int64_t t_step) const {
    const float lr = static_cast<float>(lr_d);
    if (decay_mode == 1) {
      for (int64_t d = 0; d < dim; ++d) g[d] = g[d] + decay * w[d];
    }
    const float decoupled = decay_mode == 2 ? static_cast<float>(lr_d * decay_d) : 0.0f;
    if (kind == KV_SGD) {
      for (int64_t d = 0; d < dim; ++d) {
        const float old = w[d];
        w[d] = old - lr * g[d];
        if (decay_mode == 2) w[d] = w[d] - decoupled * old;
      }
    } else if (kind == KV_ROWWISE_ADAGRAD) {
      double square_sum = 0.0;  // why double: close to torch's cascade sum for any dim
      for (int64_t d = 0; d < dim; ++d) square_sum += static_cast<double>(g[d] * g[d]);
      const float sum = s[0] + static_cast<float>(square_sum / static_cast<double>(dim));
      s[0] = sum;
      const float rate = lr / (std::sqrt(sum) + eps);
      for (int64_t d = 0; d < dim; ++d) {
        const float old = w[d];
        w[d] = old - rate * g[d];
        if (decay_mode == 2) w[d] = w[d] - decoupled * old;
      }
    } else {
      float* m = s + KV_EXP_AVG * dim;
      float* v = s + KV_EXP_AVG_SQ * dim;  // the state blocks of KvStateBlock
      const float correction1 = static_cast<float>(1.0 - std::pow(beta1_d, t_step));
      const float correction2 = static_cast<float>(1.0 - std::pow(beta2_d, t_step));
      for (int64_t d = 0; d < dim; ++d) {
        m[d] = beta1 * m[d] + one_minus_beta1 * g[d];
        v[d] = beta2 * v[d] + one_minus_beta2 * g[d] * g[d];
        const float m_hat = m[d] / correction1;
        const float v_hat = v[d] / correction2;
        const float old = w[d];
        w[d] = old - lr * m_hat / (std::sqrt(v_hat) + eps);
        if (decay_mode == 2) w[d] = w[d] - decoupled * old;
      }
    }
  }
};

int backward(const KvBackwardArgs& a, Arena& arena) {
  const int64_t n = a.n, U = a.num_unique, dim = a.dim;
  if (a.num_bags < 0 || a.offsets[0] != 0 || a.offsets[a.num_bags] != n || a.bags_per_group < 1) {
    return KV_BAD_ARGUMENT;
  }
  // Occurrences of each unique with a row, ascending: (occurrence, bag).
  int64_t* start = arena.take<int64_t>(U + 1);
  std::fill(start, start + U + 1, 0);
  for (int64_t b = 0; b < a.num_bags; ++b) {
    if (a.offsets[b + 1] < a.offsets[b]) return KV_BAD_ARGUMENT;
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t u = a.unique_index[i];
    if (u < -1 || u >= U) return KV_BAD_ARGUMENT;
    if (u >= 0 && a.unique_slots[u] >= 0) ++start[u + 1];
  }
  for (int64_t u = 0; u < U; ++u) {
    const int64_t slot = a.unique_slots[u], t = a.unique_table[u];
    if (slot >= a.num_rows || (slot >= 0 && (t < 0 || t >= a.num_tables))) return KV_BAD_ARGUMENT;
    start[u + 1] += start[u];
  }
  int64_t* occurrence = arena.take<int64_t>(start[U]);
  int64_t* bag_of = arena.take<int64_t>(start[U]);
  {
    int64_t* next = arena.take<int64_t>(U);
    std::copy(start, start + U, next);
    for (int64_t b = 0; b < a.num_bags; ++b) {
      for (int64_t i = a.offsets[b]; i < a.offsets[b + 1]; ++i) {
        const int64_t u = a.unique_index[i];
        if (u < 0 || a.unique_slots[u] < 0) continue;
        occurrence[next[u]] = i;
        bag_of[next[u]++] = b;
      }
    }
  }

  const Optimizer optim(a);
  const int64_t dtype = a.weights_dtype;
  const bool half = dtype != KV_ROWS_FLOAT32;
  // A half-precision row to float32 (exact), and back rounded to nearest even.
  const ReadHalfRow read_row = half_row_reader(dtype);
  const WriteHalfRow write_row = half_row_writer(dtype);
  char* const weights = static_cast<char*>(a.weights);
  const int64_t weight_bytes = dim * element_bytes(dtype);
  const int64_t tasks = (U + kUniquesPerTask - 1) / kUniquesPerTask;
  const bool ok = parallel_for(tasks, a.num_threads, [&](int64_t task, int64_t) {
    std::vector<float> grad(static_cast<size_t>(dim));
    std::vector<float> half_row(half ? static_cast<size_t>(dim) : 0);  // a half row, as float32
    const int64_t grad_bytes = dim * 4, state_bytes = a.state_dim * 4;
    auto grad_row = [&](int64_t b) {
      return a.grad + (b / a.bags_per_group) * a.group_stride + (b % a.bags_per_group) * a.bag_stride;
    };
    for (int64_t u = task * kUniquesPerTask, end = std::min(U, u + kUniquesPerTask); u < end; ++u) {
      if (u + kRowsAhead < end && a.unique_slots[u + kRowsAhead] >= 0) {
        const int64_t ahead = a.unique_slots[u + kRowsAhead];
        prefetch_bytes(weights + ahead * weight_bytes, weight_bytes, true);
        if (state_bytes) prefetch_bytes(a.state + ahead * a.state_dim, state_bytes, true);
      }
      if (u + 1 < end) {  // the next unique's first gradient rows (all of them for most)
        for (int64_t e = start[u + 1]; e < std::min(start[u + 2], start[u + 1] + 8); ++e) {
          prefetch_bytes(grad_row(bag_of[e]), grad_bytes, false);
        }
      }
      const int64_t slot = a.unique_slots[u];
      if (slot < 0) continue;
      std::fill(grad.begin(), grad.end(), 0.0f);
      for (int64_t e = start[u]; e < start[u + 1]; ++e) {
        const int64_t i = occurrence[e], b = bag_of[e];
        float scale = a.per_sample_weights ? a.per_sample_weights[i] : 1.0f;
        if (a.mean) {
          const int64_t length = a.offsets[b + 1] - a.offsets[b];
          scale = scale / static_cast<float>(std::max<int64_t>(length, 1));
        }
        const float* row = grad_row(b);
        if (optim.clip) {
          for (int64_t d = 0; d < dim; ++d) grad[d] += optim.clipped(row[d]) * scale;
        } else {
          for (int64_t d = 0; d < dim; ++d) grad[d] += row[d] * scale;
        }
      }
      const int64_t t = a.unique_table[u];
      char* const row = weights + slot * weight_bytes;
      float* const w = half ? half_row.data() : reinterpret_cast<float*>(row);
      if (half) read_row(reinterpret_cast<const uint16_t*>(row), w, dim);
      optim.step(w, a.state + slot * a.state_dim, grad.data(), dim, a.learning_rate[t],
                 a.optim_step[t]);
      if (half) write_row(w, reinterpret_cast<uint16_t*>(row), dim);
    }
  });
  return ok ? KV_OK : KV_OUT_OF_MEMORY;
}

}  // namespace
}  // namespace kvemb

extern "C" int kv_fused_backward_group(const KvBackwardArgs* args) {
  if (!args || args->n < 0 || args->num_unique < 0 || args->dim < 1) return KV_BAD_ARGUMENT;
  if (args->weights_dtype < KV_ROWS_FLOAT32 || args->weights_dtype > KV_ROWS_BFLOAT16) {
    return KV_BAD_ARGUMENT;
  }
  try {
    kvemb::ArenaLease lease(args->workspace ? &args->workspace->arena : nullptr,
                            args->workspace ? &args->workspace->busy : nullptr);
    return kvemb::backward(*args, lease.arena());
  } catch (const std::bad_alloc&) {
    return KV_OUT_OF_MEMORY;
  }
}
