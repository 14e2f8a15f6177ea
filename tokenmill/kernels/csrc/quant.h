// Shared by the quantized-weight kernels: the integer form the activations take for integer dot
// products, fp16/fp32 scale loading, and the checks on a packed or fp8 weight's tensors.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
#include <vector>

namespace tokenmill {

// Values per quantization block, for weights and activations alike: one ymm register of int8.
constexpr int64_t kQuantBlock = 32;

// Rows of fp32 activations quantized per block of 32 values, as llama.cpp's Q8_1 does it:
// integer values q = round(x * L / max|x|), the scale d = max|x| / L (so x ~ d * q), and
// d * sum(q), which asymmetric weights need (a weight offset m adds m * d * sum(q) per block).
// L is 127 for int8 values (for int4 weights, whose kernel is compute-bound) and 32767 for
// int16 (for int8 weights: memory-bound, so the wider product costs little, and their rounding
// of the activations becomes negligible). A row of k values takes `blocks` >= ceil(k / 32)
// blocks, zero past k. The rows live in memory the caller provides (storage_bytes of it), so
// the decode loop can set it aside before its parallel region.
template <typename T>
class QuantizedRows {
 public:
  static constexpr int kLimit = sizeof(T) == 1 ? 127 : 32767;

  static int64_t storage_bytes(int64_t rows, int64_t blocks) {
    return rows * blocks * (2 * sizeof(float) + kQuantBlock * sizeof(T));
  }

  // `rows` rows of `blocks` blocks laid out in `storage`, which must be 4-byte aligned.
  QuantizedRows(void* storage, int64_t rows, int64_t blocks)
      : blocks_(blocks),
        scales_(static_cast<float*>(storage)),
        sums_(scales_ + rows * blocks),
        values_(reinterpret_cast<T*>(sums_ + rows * blocks)) {}

  // x [rows, k] into these rows, the blocks shared out among the enclosing parallel region's
  // threads (team.h).
  void quantize(const float* x, int64_t rows, int64_t k);

  int64_t blocks() const { return blocks_; }
  const T* values(int64_t row) const { return values_ + row * blocks_ * kQuantBlock; }
  const float* scales(int64_t row) const { return scales_ + row * blocks_; }
  const float* sums(int64_t row) const { return sums_ + row * blocks_; }

 private:
  int64_t blocks_;
  float* scales_;  // [rows, blocks]
  float* sums_;    // [rows, blocks]
  T* values_;      // [rows, blocks * 32]
};

// Bytes per packed weight row of k inputs: int8 rows pad k to a multiple of 32, int4 rows to a
// multiple of 64 (32 bytes, the unit the int4 kernel unpacks at once).
inline int64_t packed_row_bytes(int64_t k, bool int4) {
  return int4 ? (k + 63) / 64 * 32 : (k + kQuantBlock - 1) / kQuantBlock * kQuantBlock;
}

inline float to_float(float v) { return v; }
inline float to_float(at::Half v) { return _cvtsh_ss(v.x); }

// Eight consecutive scales as fp32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Runs `body` with a null pointer of the C++ type of `scales` (float32 or float16), so one
// template serves both scale precisions.
template <typename Body>
auto with_scale_type(const at::Tensor& scales, Body body) {
  if (scales.scalar_type() == at::kHalf) return body(static_cast<const at::Half*>(nullptr));
  TORCH_CHECK(scales.scalar_type() == at::kFloat,
              "quantized weights: scales must be float16 or float32");
  return body(static_cast<const float*>(nullptr));
}

// Every quantized format's groups are whole blocks of 32 inputs.
inline void check_group_size(const char* op, int64_t group_size) {
  TORCH_CHECK(group_size > 0 && group_size % kQuantBlock == 0, op,
              ": group_size must be a positive multiple of 32, got ", group_size);
}

// Checks a packed weight of n rows of `row_bytes` bytes and its [n, ceil(k / group_size)]
// per-group tensors (scales, and mins for int4), all contiguous and with one scale dtype.
inline void check_packed_weight(const char* op, const at::Tensor& qweight, at::ScalarType qdtype,
                                int64_t row_bytes, const std::vector<at::Tensor>& per_group,
                                int64_t k, int64_t group_size) {
  check_group_size(op, group_size);
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == qdtype && qweight.is_contiguous(),
              op, ": qweight must be a contiguous 2-D ", qdtype, " tensor");
  TORCH_CHECK(qweight.size(1) == row_bytes, op, ": qweight rows hold ", qweight.size(1),
              " bytes; ", k, " inputs need ", row_bytes);
  const int64_t groups = (k + group_size - 1) / group_size;
  for (const at::Tensor& t : per_group) {
    TORCH_CHECK(t.scalar_type() == per_group[0].scalar_type(), op,
                ": scales and mins must share a dtype");
    TORCH_CHECK(t.dim() == 2 && t.size(0) == qweight.size(0) && t.size(1) == groups &&
                    t.is_contiguous(),
                op, ": scales/mins must be contiguous [", qweight.size(0), ", ", groups, "]");
  }
}

// Checks an fp8 weight: contiguous float8_e4m3fn codes [N, K] and contiguous float32 scales [N].
inline void check_fp8_weight(const char* op, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kFloat8_e4m3fn &&
                  qweight.is_contiguous(),
              op, ": qweight must be a contiguous float8_e4m3fn [N, K]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == qweight.size(0),
              op, ": scales must be a contiguous float32 [N]");
}

}  // namespace tokenmill
