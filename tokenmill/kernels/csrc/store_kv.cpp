// Stores a step's new keys and values into their slots of a paged KV cache.
//
// The torch path costs two dtype casts, a view and two index_copy_ calls per layer, a dozen
// microseconds of dispatch for a decode's few hundred bytes. Here each token's heads are
// copied where they lie: k and v are usually column slices of the merged qkv output, so any
// token and head stride is taken as it comes, as long as each head's d values are contiguous.

#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "team.h"

namespace tokenmill {
namespace {

// One head of d floats to 8-bit codes and its scale, exactly as ops.quantize_kv_reference does:
// codes = x * (qmax / max|x|) clamped to +-qmax, rounded to nearest even (int8) or by e4m3's own
// rounding (fp8); scale = max|x| / qmax. A head of zeros gets zero codes and scale 0.
struct Int8Code {
  using Storage = int8_t;
  static constexpr float kMax = 127.0f;
  static Storage encode(float x) { return static_cast<int8_t>(std::nearbyint(x)); }
};

struct Fp8Code {
  using Storage = uint8_t;
  static constexpr float kMax = 448.0f;
  static Storage encode(float x) { return c10::Float8_e4m3fn(x).x; }
};

// T: float, or at::BFloat16 (a bfloat16 model's k and v, widened exactly, as the reference's
// `.float()` widens them).
template <typename Code, typename T>
float quantize_head(const T* x, int64_t dim, typename Code::Storage* codes) {
  float max_abs = 0.0f;
  for (int64_t i = 0; i < dim; ++i)
    max_abs = std::max(max_abs, std::fabs(static_cast<float>(x[i])));
  const float inverse = max_abs > 0.0f ? Code::kMax / max_abs : 0.0f;
  for (int64_t i = 0; i < dim; ++i) {
    const float scaled = static_cast<float>(x[i]) * inverse;
    codes[i] = Code::encode(std::clamp(scaled, -Code::kMax, Code::kMax));
  }
  return max_abs / Code::kMax;
}

template <typename Code, typename T>
void store_quantized(const at::Tensor& values, const at::Tensor& scales, const int64_t* slot,
                     const at::Tensor& k, const at::Tensor& v) {
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2);
  const int64_t num_slots = values.size(1) * values.size(2);
  auto* codes = reinterpret_cast<typename Code::Storage*>(values.data_ptr());
  float* scale = scales.data_ptr<float>();
  const T* sources[2] = {k.data_ptr<T>(), v.data_ptr<T>()};
  const int64_t token_strides[2] = {k.stride(0), v.stride(0)};
  const int64_t head_strides[2] = {k.stride(1), v.stride(1)};
#pragma omp for schedule(static)
  for (int64_t t = 0; t < tokens; ++t)
    for (int which = 0; which < 2; ++which)
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t row = (which * num_slots + slot[t]) * heads + h;
        scale[row] = quantize_head<Code, T>(
            sources[which] + t * token_strides[which] + h * head_strides[which], dim,
            codes + row * dim);
      }
}

// Rejects slots outside the cache. Checked before the parallel loop: an exception cannot leave
// an OpenMP region.
void check_slots(const int64_t* slot, int64_t tokens, int64_t num_slots, const char* op) {
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, op, ": slot ", slot[t],
                " is outside the cache's ", num_slots, " slots");
}

// The checks both stores share: a contiguous cache [2, blocks, block_size, kv_heads, d] (floats
// or codes), k and v [T, kv_heads, d] of one dtype whose heads are contiguous, and one int64
// slot per token, inside the cache. Returns the slots, contiguous.
at::Tensor check_store(const char* op, const at::Tensor& cache, const at::Tensor& slot_mapping,
                       const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous(), op,
              ": the cache must be a contiguous [2, blocks, block_size, kv_heads, d]");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), op, ": k and v must be [T, kv_heads, d]");
  TORCH_CHECK(cache.size(3) == k.size(1) && cache.size(4) == k.size(2), op,
              ": k's heads and head_dim must match the cache's");
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), op, ": k and v must have one dtype");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, op, ": each head must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == k.size(0), op,
              ": slot_mapping must be int64 with one slot per token");
  at::Tensor slots = slot_mapping.contiguous();
  check_slots(slots.data_ptr<int64_t>(), k.size(0), cache.size(1) * cache.size(2), op);
  return slots;
}

// body(Int8Code{}) or body(Fp8Code{}), by the dtype of a quantized cache's codes.
template <typename Body>
void with_code(const at::Tensor& values, Body body) {
  if (values.scalar_type() == at::kChar)
    body(Int8Code{});
  else
    body(Fp8Code{});
}

// Each token's heads copied as they are: T is float, or at::BFloat16 for a bfloat16 model.
template <typename T>
void store_plain(const at::Tensor& kv_cache, const int64_t* slot, const at::Tensor& k,
                 const at::Tensor& v) {
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2);
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  T* cache = kv_cache.data_ptr<T>();
  const int64_t row = heads * dim, half = num_slots * row;
  const T* sources[2] = {k.data_ptr<T>(), v.data_ptr<T>()};
  const int64_t token_strides[2] = {k.stride(0), v.stride(0)};
  const int64_t head_strides[2] = {k.stride(1), v.stride(1)};
#pragma omp for schedule(static)
  for (int64_t t = 0; t < tokens; ++t)
    for (int which = 0; which < 2; ++which) {
      T* dst = cache + which * half + slot[t] * row;
      const T* src = sources[which] + t * token_strides[which];
      if (head_strides[which] == dim) {
        std::memcpy(dst, src, row * sizeof(T));
      } else {
        for (int64_t h = 0; h < heads; ++h)
          std::memcpy(dst + h * dim, src + h * head_strides[which], dim * sizeof(T));
      }
    }
}

}  // namespace

void store_kv_team(const at::Tensor& kv_cache, const at::Tensor* scales, const at::Tensor& slots,
                   const at::Tensor& k, const at::Tensor& v) {
  const int64_t* slot = slots.data_ptr<int64_t>();
  if (scales == nullptr && kv_cache.scalar_type() == at::kBFloat16) {
    store_plain<at::BFloat16>(kv_cache, slot, k, v);
  } else if (scales == nullptr) {
    store_plain<float>(kv_cache, slot, k, v);
  } else {
    with_code(kv_cache, [&](auto code) {
      using Code = decltype(code);
      if (k.scalar_type() == at::kBFloat16)
        store_quantized<Code, at::BFloat16>(kv_cache, *scales, slot, k, v);
      else
        store_quantized<Code, float>(kv_cache, *scales, slot, k, v);
    });
  }
}

void store_kv(const at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& k,
              const at::Tensor& v) {
  const at::Tensor slots = check_store("store_kv", kv_cache, slot_mapping, k, v);
  TORCH_CHECK((kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16) &&
                  k.scalar_type() == kv_cache.scalar_type(),
              "store_kv: kv_cache, k and v must be all float32 or all bfloat16");
#pragma omp parallel if (k.numel() >= kParallelMinElements)
  store_kv_team(kv_cache, nullptr, slots, k, v);
}

// values: int8 or float8_e4m3fn [2, blocks, block_size, kv_heads, d]; scales: float32
// [2, blocks, block_size, kv_heads]. Each token's k and v heads are quantized on their own.
void store_kv_quantized(const at::Tensor& values, const at::Tensor& scales,
                        const at::Tensor& slot_mapping, const at::Tensor& k, const at::Tensor& v) {
  const at::Tensor slots = check_store("store_kv_quantized", values, slot_mapping, k, v);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.sizes() == values.sizes().slice(0, 4),
              "store_kv_quantized: scales must be a contiguous float32 [2, blocks, block_size, "
              "kv_heads]");
  TORCH_CHECK(values.scalar_type() == at::kChar || values.scalar_type() == at::kFloat8_e4m3fn,
              "store_kv_quantized: values must be int8 or float8_e4m3fn");
  TORCH_CHECK(k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16,
              "store_kv_quantized: k and v must be float32 or bfloat16");
#pragma omp parallel if (k.numel() >= kParallelMinElements)
  store_kv_team(values, &scales, slots, k, v);
}

}  // namespace tokenmill
