// XLA FFI handlers on a CPU over a GGUF tensor's rows of blocks, as stored, computed by ggml's own CPU kernels
// (the library llama.cpp runs on). jaxserve/models/ggml.py builds, loads and checks this file.
//
//   jaxserve_ggml_matmul(x f32 [..., k], w_1 .. w_m [n_i, k of type]; type) -> y_1 .. y_m f32 [..., n_i]:
//     y_i = x w_i^T, for weights of one type that share their input (q/k/v, gate/up). A weight's rows are u8
//     bytes of `type`'s blocks, or float32 values for F32. Each row of x is rounded once to the type ggml
//     multiplies `type`'s blocks with (Q8_1 for Q4_1, Q8_K for the K types; F32 is taken as it is), then ggml's
//     vec_dot takes each pair of rows, as llama.cpp's matmul does at a few rows; one parallel loop covers every
//     weight's columns. Q4_1 and Q8_0 (the default model's weights and tied head) take four weight rows a call
//     where the CPU has AVX2 (FourRows, below): ggml's own AVX2 vec_dot, step for step, with the input block
//     loaded once for four rows and the next rows prefetched.
//   jaxserve_ggml_to_float(w u8 [..., row bytes]; type) -> f32 [..., k]: the rows dequantized.
//   jaxserve_ggml_round(x f32 [..., k]; type) -> f32 [..., k]: x rounded as jaxserve_ggml_matmul rounds it.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_threads.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define JAXSERVE_FOUR_ROWS 1
#endif

namespace ffi = xla::ffi;

// ggml's API as ggml.h and ggml-cpu.h declare it (llama-cpp-python installs ggml's libraries, not its headers).
// An enum ggml_type passes as an int.
extern "C" {
typedef void (*ggml_to_float_t)(const void* x, float* y, int64_t k);
typedef void (*ggml_from_float_t)(const float* x, void* y, int64_t k);
typedef void (*ggml_vec_dot_t)(int n, float* s, size_t bs, const void* x, size_t bx, const void* y, size_t by,
                               int nrc);
struct ggml_type_traits {
  const char* type_name;
  int64_t blck_size;
  int64_t blck_size_interleave;
  size_t type_size;
  bool is_quantized;
  ggml_to_float_t to_float;
  ggml_from_float_t from_float_ref;
};
struct ggml_type_traits_cpu {
  ggml_from_float_t from_float;
  ggml_vec_dot_t vec_dot;
  int vec_dot_type;
  int64_t nrows;
};
const ggml_type_traits* ggml_get_type_traits(int type);
const ggml_type_traits_cpu* ggml_get_type_traits_cpu(int type);
size_t ggml_row_size(int type, int64_t ne);
float ggml_fp16_to_fp32(uint16_t x);
void ggml_cpu_init(void);
}

namespace {

using jaxserve::Parallel;

constexpr int kF32 = 0, kQ4_1 = 3, kQ8_0 = 8, kQ8_1 = 9, kQ8_K = 15;  // ggml_type's values

// Four rows of a weight's blocks against one input row: out[r] = vec_dot(w + r * w_row, y), computed as ggml's
// AVX2 vec_dot computes it (the same integer products, each row's float sums in the same order: the same bits),
// with y's block loaded once for the four rows. At one input row vec_dot is bound by the instructions around its
// dot products, not by memory. Each call also prefetches its share of the four rows two calls ahead.
using FourRowsFn = void (*)(int64_t blocks, const uint8_t* w, size_t w_row, const uint8_t* y, float* out);

#ifdef JAXSERVE_FOUR_ROWS

inline float HalfToFloat(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}

inline float Sum8(__m256 x) {  // ggml's hsum_float_8
  __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}

inline void PrefetchAhead(const uint8_t* w, size_t w_row, int64_t b, int64_t blocks) {
  const char* ahead = reinterpret_cast<const char*>(w + 8 * w_row + b * 4 * w_row / blocks);
  _mm_prefetch(ahead, _MM_HINT_T0);
  _mm_prefetch(ahead + 64, _MM_HINT_T0);
}

// Q4_1 (float16 d and m, 16 bytes of nibbles) against Q8_1 (float16 d and s = d * the sum of its 32 int8).
void FourRowsQ4_1(int64_t blocks, const uint8_t* w, size_t w_row, const uint8_t* y, float* out) {
  __m256 acc[4];
  float mins[4];
  for (int r = 0; r < 4; ++r) acc[r] = _mm256_setzero_ps(), mins[r] = 0;
  const __m256i low = _mm256_set1_epi8(0xF), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < blocks; ++b) {
    PrefetchAhead(w, w_row, b, blocks);
    const uint8_t* yb = y + b * 36;
    const float dy = HalfToFloat(yb), sy = HalfToFloat(yb + 2);
    const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(yb + 4));
    for (int r = 0; r < 4; ++r) {
      const uint8_t* xb = w + r * w_row + b * 20;
      __m128i nibbles = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + 4));
      __m256i qx = _mm256_and_si256(low, _mm256_set_m128i(_mm_srli_epi16(nibbles, 4), nibbles));
      __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(ones, _mm256_maddubs_epi16(qx, qy)));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(HalfToFloat(xb) * dy), p, acc[r]);
      mins[r] = std::fma(HalfToFloat(xb + 2), sy, mins[r]);
    }
  }
  for (int r = 0; r < 4; ++r) out[r] = Sum8(acc[r]) + mins[r];
}

// Q8_0 (float16 d, 32 int8) against Q8_0.
void FourRowsQ8_0(int64_t blocks, const uint8_t* w, size_t w_row, const uint8_t* y, float* out) {
  __m256 acc[4];
  for (int r = 0; r < 4; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < blocks; ++b) {
    PrefetchAhead(w, w_row, b, blocks);
    const uint8_t* yb = y + b * 34;
    const float dy = HalfToFloat(yb);
    const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(yb + 2));
    for (int r = 0; r < 4; ++r) {
      const uint8_t* xb = w + r * w_row + b * 34;
      __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 2));
      // |x| times y with x's sign: maddubs takes one unsigned operand
      __m256i dot = _mm256_maddubs_epi16(_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(qy, qx));
      __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(ones, dot));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(HalfToFloat(xb) * dy), p, acc[r]);
    }
  }
  for (int r = 0; r < 4; ++r) out[r] = Sum8(acc[r]);
}

FourRowsFn FourRows(int type) { return type == kQ4_1 ? FourRowsQ4_1 : type == kQ8_0 ? FourRowsQ8_0 : nullptr; }

// The first rows a task reads, which no earlier call of its own prefetched.
void PrefetchRows(const uint8_t* w, size_t bytes) {
  for (size_t i = 0; i < bytes; i += 64) _mm_prefetch(reinterpret_cast<const char*>(w + i), _MM_HINT_T0);
}
#else  // ggml's vec_dot alone
FourRowsFn FourRows(int) { return nullptr; }
void PrefetchRows(const uint8_t*, size_t) {}
#endif

// One row of ggml's 8-bit input blocks back in float32: d * q. ggml has no to_float for Q8_1 (float16 d and sum,
// 32 int8) or Q8_K (float32 d, 256 int8, 16 int16 sums), which exist only as vec_dot's inputs.
void InputToFloat(int type, const uint8_t* row, float* out, int64_t k) {
  if (type == kQ8_1 || type == kQ8_K) {
    const int64_t block = type == kQ8_1 ? 32 : 256, bytes = type == kQ8_1 ? 36 : 292;
    for (int64_t b = 0; b < k / block; ++b, row += bytes) {
      float d;
      if (type == kQ8_1) {
        d = ggml_fp16_to_fp32(static_cast<uint16_t>(row[0] | row[1] << 8));
      } else {
        std::memcpy(&d, row, sizeof d);
      }
      const int8_t* q = reinterpret_cast<const int8_t*>(row + 4);  // after d (and Q8_1's sum)
      for (int64_t i = 0; i < block; ++i) out[b * block + i] = d * q[i];
    }
  } else {
    ggml_get_type_traits(type)->to_float(row, out, k);
  }
}

// x's rows in the type ggml's vec_dot multiplies `type` with: x itself where that is float32, else x rounded into
// `out` (the caller's, kept from call to call: no allocation a step).
const uint8_t* Rounded(const float* x, int64_t rows, int64_t k, int type, int* vec_type, std::vector<uint8_t>& out) {
  *vec_type = ggml_get_type_traits_cpu(type)->vec_dot_type;
  if (*vec_type == kF32) return reinterpret_cast<const uint8_t*>(x);
  size_t row = ggml_row_size(*vec_type, k);
  out.resize(row * rows);
  auto from_float = ggml_get_type_traits_cpu(*vec_type)->from_float;
  for (int64_t r = 0; r < rows; ++r) from_float(x + r * k, out.data() + r * row, k);
  return out.data();
}

ffi::Error Matmul(ffi::Buffer<ffi::F32> x, ffi::RemainingArgs weights, ffi::RemainingRets outs, int64_t type) {
  int64_t k = x.dimensions().back(), rows = x.element_count() / k;
  size_t w_row = ggml_row_size(type, k), m = weights.size();
  if (m == 0 || outs.size() != m) return ffi::Error::InvalidArgument("jaxserve_ggml_matmul: one result a weight");
  // Output columns a task: each weight row read once for every row of x, and enough of them that a task's
  // prefetches (FourRows) run ahead of it.
  constexpr int64_t kColumns = 128;
  struct Part {
    const uint8_t* w;
    float* y;
    int64_t n, first_task;
  };
  std::vector<Part> parts;
  int64_t tasks = 0;
  for (size_t i = 0; i < m; ++i) {
    auto w = weights.get<ffi::AnyBuffer>(i);
    auto y = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument("jaxserve_ggml_matmul: results not f32");
    if (w->dimensions().size() != 2 || w->size_bytes() != static_cast<size_t>(w->dimensions()[0]) * w_row)
      return ffi::Error::InvalidArgument("jaxserve_ggml_matmul: a weight's rows do not hold k values of its type");
    int64_t n = w->dimensions()[0];
    parts.push_back({static_cast<const uint8_t*>(w->untyped_data()), (*y)->typed_data(), n, tasks});
    tasks += (n + kColumns - 1) / kColumns;
  }
  int vec_type;
  thread_local std::vector<uint8_t> rounded;  // held while the helpers read it: the caller waits for them
  const uint8_t* xp = Rounded(x.typed_data(), rows, k, type, &vec_type, rounded);
  size_t x_row = ggml_row_size(vec_type, k);
  ggml_vec_dot_t vec_dot = ggml_get_type_traits_cpu(type)->vec_dot;
  FourRowsFn four = FourRows(type);
  int64_t blocks = k / ggml_get_type_traits(type)->blck_size;
  const Part* pp = parts.data();
  Parallel(tasks, [=](int64_t task) {
    const Part* p = pp;
    while (p + 1 < pp + m && p[1].first_task <= task) ++p;  // a handful of weights: a scan finds the task's
    int64_t j = (task - p->first_task) * kColumns, last = std::min(p->n, j + kColumns);
    if (four != nullptr) {
      PrefetchRows(p->w + j * w_row, std::min<int64_t>(8, last - j) * w_row);
      for (; j + 4 <= last; j += 4)
        for (int64_t r = 0; r < rows; ++r) four(blocks, p->w + j * w_row, w_row, xp + r * x_row, p->y + r * p->n + j);
    }
    for (; j < last; ++j)
      for (int64_t r = 0; r < rows; ++r) vec_dot(k, p->y + r * p->n + j, 0, p->w + j * w_row, 0, xp + r * x_row, 0, 1);
  });
  return ffi::Error::Success();
}

ffi::Error ToFloat(ffi::Buffer<ffi::U8> w, ffi::ResultBuffer<ffi::F32> y, int64_t type) {
  int64_t k = y->dimensions().back(), rows = y->element_count() / k;
  size_t w_row = ggml_row_size(type, k);
  if (static_cast<size_t>(w.dimensions().back()) != w_row)
    return ffi::Error::InvalidArgument("jaxserve_ggml_to_float: the rows do not hold k values of their type");
  const uint8_t* wp = w.typed_data();
  float* yp = y->typed_data();
  ggml_to_float_t to_float = ggml_get_type_traits(type)->to_float;
  if (to_float == nullptr)  // F32 rows are float32 already (models/ggml.py reads them as they are)
    return ffi::Error::InvalidArgument("jaxserve_ggml_to_float: ggml has no conversion for this type");
  constexpr int64_t kRows = 64;
  Parallel((rows + kRows - 1) / kRows, [=](int64_t task) {
    for (int64_t r = task * kRows; r < std::min(rows, (task + 1) * kRows); ++r) to_float(wp + r * w_row, yp + r * k, k);
  });
  return ffi::Error::Success();
}

ffi::Error Round(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y, int64_t type) {
  int64_t k = x.dimensions().back(), rows = x.element_count() / k;
  int vec_type;
  std::vector<uint8_t> buffer;
  const uint8_t* xq = Rounded(x.typed_data(), rows, k, type, &vec_type, buffer);
  size_t row = ggml_row_size(vec_type, k);
  for (int64_t r = 0; r < rows; ++r) {
    float* out = y->typed_data() + r * k;
    if (vec_type == kF32)
      std::copy(x.typed_data() + r * k, x.typed_data() + (r + 1) * k, out);
    else
      InputToFloat(vec_type, xq + r * row, out, k);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxserve_ggml_matmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("type"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxserve_ggml_to_float, ToFloat,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("type"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxserve_ggml_round, Round,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>().Attr<int64_t>(
                                  "type"));

// ggml's CPU kernels pick their instruction sets and fill their float16 tables here, once, before any call.
extern "C" void jaxserve_ggml_init(void) { ggml_cpu_init(); }
