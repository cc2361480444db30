// Decode attention on a CPU as an XLA FFI call: each decode row's query over its own pages, read in place from the
// paged cache (no gather), key by key with an online softmax. pallas_kernels/cpu_attention.py builds, loads and
// checks this file against reference.tiled_paged_attention.
//
//   jaxserve_cpu_decode_attention(q f32 [n, h, d], q_pos s32 [n], k_cache f32 [slots, kvh, d], v_cache (alike),
//     tables s32 [n, w], page_pos s32 [n, w]; block_size, window) -> o f32 [n, h, d], lse f32 [n, h]
//
// Row r's query at position p sees the key at position j of entry c (j = page_pos[r, c] + i, slot
// tables[r, c] * block_size + i) when the entry is not -1, j <= p and, with a window (0: none), j > p - window.
// A row with p = -1 (padding) or no key seen gets 0 and a log-sum-exp of -inf. Tasks are rows x KV heads: a KV
// head's query group reads each key once.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Shapes {
  int64_t n, h, kvh, d, w, slots, block_size, window;
};

// Row r's KV head `head`: its group of g query heads over the keys they see.
void AttendRow(const Shapes& s, int64_t r, int64_t head, const float* q, const int32_t* q_pos, const float* k,
               const float* v, const int32_t* tables, const int32_t* page_pos, float* o, float* lse) {
  const int64_t g = s.h / s.kvh, d = s.d, p = q_pos[r];
  float* out = o + (r * s.h + head * g) * d;  // the group's g rows of d, accumulated in place
  float* out_lse = lse + r * s.h + head * g;
  std::fill(out, out + g * d, 0.0f);
  thread_local std::vector<float> scratch;
  scratch.assign(g * d + 2 * g + g * s.block_size, 0.0f);
  float *qs = scratch.data(), *m = qs + g * d, *l = m + g, *scores = l + g;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int64_t j = 0; j < g * d; ++j) qs[j] = q[(r * s.h + head * g) * d + j] * scale;
  std::fill(m, m + g, -std::numeric_limits<float>::infinity());
  for (int64_t c = 0; p >= 0 && c < s.w; ++c) {
    const int64_t page = tables[r * s.w + c], first = page_pos[r * s.w + c];
    if (page < 0 || first > p || (page + 1) * s.block_size > s.slots) continue;
    const int64_t lo = s.window > 0 ? std::max<int64_t>(0, p - s.window + 1 - first) : 0;
    const int64_t hi = std::min<int64_t>(s.block_size, p - first + 1), keys = hi - lo;
    if (keys <= 0) continue;
    for (int64_t i = 0; i < keys; ++i) {
      const float* key = k + ((page * s.block_size + lo + i) * s.kvh + head) * d;
      for (int64_t j = 0; j < g; ++j) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)  // in vector lanes (-fopenmp-simd), summed at the end
        for (int64_t e = 0; e < d; ++e) dot += qs[j * d + e] * key[e];
        scores[j * s.block_size + i] = dot;
      }
    }
    for (int64_t j = 0; j < g; ++j) {
      float* row = scores + j * s.block_size;
      const float top = std::max(m[j], *std::max_element(row, row + keys));
      const float kept = std::exp(m[j] - top);  // 0 before the first key (m = -inf)
      l[j] *= kept;
      float* acc = out + j * d;
      for (int64_t e = 0; e < d; ++e) acc[e] *= kept;
      for (int64_t i = 0; i < keys; ++i) {
        const float weight = std::exp(row[i] - top);
        const float* value = v + ((page * s.block_size + lo + i) * s.kvh + head) * d;
        l[j] += weight;
        for (int64_t e = 0; e < d; ++e) acc[e] += weight * value[e];
      }
      m[j] = top;
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    if (l[j] > 0.0f) {
      for (int64_t e = 0; e < d; ++e) out[j * d + e] /= l[j];
      out_lse[j] = m[j] + std::log(l[j]);
    } else {
      out_lse[j] = -std::numeric_limits<float>::infinity();
    }
  }
}

ffi::Error DecodeAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> page_pos,
                           ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> lse, int64_t block_size,
                           int64_t window) {
  auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || td.size() != 2 || page_pos.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("jaxserve_cpu_decode_attention: q [n, h, d], caches [slots, kvh, d]");
  Shapes s{qd[0], qd[1], kd[1], qd[2], td[1], kd[0], block_size, window};
  if (kd[2] != s.d || s.h % s.kvh || td[0] != s.n || page_pos.dimensions()[1] != s.w || block_size <= 0)
    return ffi::Error::InvalidArgument("jaxserve_cpu_decode_attention: shapes disagree");
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const int32_t *pos = q_pos.typed_data(), *tp = tables.typed_data(), *pp = page_pos.typed_data();
  float *op = o->typed_data(), *lp = lse->typed_data();
  jaxserve::Parallel(s.n * s.kvh, [=](int64_t task) {
    AttendRow(s, task / s.kvh, task % s.kvh, qp, pos, kp, vp, tp, pp, op, lp);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxserve_cpu_decode_attention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block_size")
                                  .Attr<int64_t>("window"));
