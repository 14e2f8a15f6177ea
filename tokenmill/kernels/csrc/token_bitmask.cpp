// Grammar-constrained decoding's token mask, applied to the logits: every token whose bit is
// clear in its row's bitmask gets -inf. The bitmask is xgrammar's layout: int32 words, bit j of
// word w for token 32w + j, set when the grammar allows that token next. A grammar allows few
// tokens at most steps, so most words are zero and most lanes are written: float32 rows take
// eight lanes per masked store (no read of the logits), bfloat16 rows one store per clear bit.

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "team.h"

namespace tokenmill {
namespace {

// The tokens [32 * w, 32 * w + 32) of `row` whose bits are clear in `word`, limited to `width`.
template <typename T>
void mask_word_scalar(T* row, uint32_t word, int64_t first, int64_t width) {
  uint32_t forbidden = ~word;
  if (width - first < 32) forbidden &= (uint32_t{1} << (width - first)) - 1;
  const T neg_inf = -std::numeric_limits<float>::infinity();
  while (forbidden != 0) {
    row[first + __builtin_ctz(forbidden)] = neg_inf;
    forbidden &= forbidden - 1;
  }
}

void mask_row(float* row, const int32_t* words, int64_t width) {
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const int64_t full_words = width / 32;
  for (int64_t w = 0; w < full_words; ++w) {
    const uint32_t word = static_cast<uint32_t>(words[w]);
    float* out = row + 32 * w;
    if (word == 0) {
      for (int k = 0; k < 4; ++k) _mm256_storeu_ps(out + 8 * k, neg_inf);
    } else if (word != UINT32_MAX) {
      for (int k = 0; k < 4; ++k) {
        const __m256i bits = _mm256_set1_epi32(static_cast<int>((word >> (8 * k)) & 0xFF));
        const __m256i clear =
            _mm256_cmpeq_epi32(_mm256_and_si256(bits, lane_bit), _mm256_setzero_si256());
        _mm256_maskstore_ps(out + 8 * k, clear, neg_inf);
      }
    }
  }
  if (full_words * 32 < width)
    mask_word_scalar(row, static_cast<uint32_t>(words[full_words]), full_words * 32, width);
}

void mask_row(at::BFloat16* row, const int32_t* words, int64_t width) {
  for (int64_t w = 0; w * 32 < width; ++w)
    if (words[w] != -1) mask_word_scalar(row, static_cast<uint32_t>(words[w]), 32 * w, width);
}

template <typename T>
void mask_rows(const at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  T* data = logits.data_ptr<T>();
  const int32_t* words = bitmask.data_ptr<int32_t>();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  const int64_t count = rows.size(0), width = logits.size(1);
  const int64_t logits_stride = logits.stride(0), bitmask_stride = bitmask.stride(0);
#pragma omp parallel for schedule(static) if (count * width >= kParallelMinElements)
  for (int64_t i = 0; i < count; ++i)
    mask_row(data + row_ids[i] * logits_stride, words + row_ids[i] * bitmask_stride, width);
}

}  // namespace

void apply_token_bitmask(const at::Tensor& logits, const at::Tensor& bitmask,
                         const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "apply_token_bitmask: logits must be [rows, vocab] float32 or bfloat16, each row "
              "contiguous");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.stride(1) == 1 && bitmask.scalar_type() == at::kInt,
              "apply_token_bitmask: bitmask must be [rows, words] int32, each row contiguous");
  TORCH_CHECK(bitmask.size(1) * 32 >= logits.size(1),
              "apply_token_bitmask: the bitmask has fewer bits than the logits have columns");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "apply_token_bitmask: rows must be a contiguous int64 vector");
  const int64_t limit = std::min(logits.size(0), bitmask.size(0));
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < limit,
                "apply_token_bitmask: row ", row_ids[i], " is outside the logits or the bitmask");
  if (logits.scalar_type() == at::kBFloat16)
    mask_rows<at::BFloat16>(logits, bitmask, rows);
  else
    mask_rows<float>(logits, bitmask, rows);
}

}  // namespace tokenmill
