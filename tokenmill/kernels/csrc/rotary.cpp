// Rotary position embedding (GPT-NeoX layout: pairs (i, i + d/2)) applied in place to q and k.
//
// The torch path spends a gather of the cos/sin rows plus chunk, four products, two sums and a
// cat per tensor; here each head is rotated where it lies. q and k are usually column slices of
// the merged qkv projection's output, so the token and head strides are taken as they come and
// only each head's d values must be contiguous.
//
// A bfloat16 model's q and k (cos and sin stay float32) are rotated in float32 and rounded back
// to bfloat16 once, as torch's reference computes them (its products of bfloat16 and float32
// are float32). That reference is about 20 small torch calls a layer where this is one, a
// visible part of a single-stream bfloat16 step.

#include <ATen/ATen.h>

#include "team.h"

namespace tokenmill {
namespace {

// One tensor's heads as laid out in memory: head j of token t starts at
// data + t * token_stride + j * head_stride. T: float, or at::BFloat16.
template <typename T>
struct Heads {
  T* data;
  int64_t count, token_stride, head_stride;
};

template <typename T>
Heads<T> heads_of(const at::Tensor& t) {
  return {t.data_ptr<T>(), t.size(1), t.stride(0), t.stride(1)};
}

// The halves never overlap, so __restrict lets GCC vectorise this plain loop. A bfloat16 value
// widens to float exactly, and the result rounds back to nearest (ties to even) as torch does.
template <typename T>
void rotate_head(T* __restrict first, T* __restrict second, const float* __restrict cos,
                 const float* __restrict sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = first[i], x2 = second[i];
    first[i] = static_cast<T>(x1 * cos[i] - x2 * sin[i]);
    second[i] = static_cast<T>(x2 * cos[i] + x1 * sin[i]);
  }
}

template <typename T>
void rotate_tokens(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                   const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = q.size(0), half = q.size(2) / 2;
  const int64_t* pos_ptr = positions.data_ptr<int64_t>();
  const Heads<T> both[2] = {heads_of<T>(q), heads_of<T>(k)};
  const float* cos_ptr = cos.data_ptr<float>();
  const float* sin_ptr = sin.data_ptr<float>();
#pragma omp for schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos_ptr + pos_ptr[t] * half;
    const float* s = sin_ptr + pos_ptr[t] * half;
    for (const Heads<T>& h : both)
      for (int64_t j = 0; j < h.count; ++j) {
        T* head = h.data + t * h.token_stride + j * h.head_stride;
        rotate_head(head, head + half, c, s, half);
      }
  }
}

void check_args(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "rotary_embedding: q and k must be [T, heads, d]");
  const int64_t tokens = q.size(0), dim = q.size(2);
  TORCH_CHECK(k.size(0) == tokens && positions.numel() == tokens && k.size(2) == dim,
              "rotary_embedding: q, k and positions must agree on T and d");
  TORCH_CHECK(dim % 2 == 0, "rotary_embedding: head_dim must be even");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == dim / 2 && sin.sizes() == cos.sizes(),
              "rotary_embedding: cos and sin must be [max_positions, d / 2]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rotary_embedding: cos and sin must be float32");
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  k.scalar_type() == q.scalar_type(),
              "rotary_embedding: q and k must be both float32 or both bfloat16");
  // Written in place, so a contiguous copy would silently drop the result.
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1,
              "rotary_embedding: each head of q and k must be contiguous");
  TORCH_CHECK(positions.scalar_type() == at::kLong, "rotary_embedding: positions must be int64");
}

}  // namespace

void rotary_embedding_team(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& cos, const at::Tensor& sin) {
  if (q.scalar_type() == at::kBFloat16) return rotate_tokens<at::BFloat16>(positions, q, k, cos, sin);
  rotate_tokens<float>(positions, q, k, cos, sin);
}

void rotary_embedding(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& cos, const at::Tensor& sin) {
  check_args(positions, q, k, cos, sin);
  const at::Tensor pos = positions.contiguous();
  const at::Tensor cos_c = cos.contiguous(), sin_c = sin.contiguous();
  const int64_t tokens = q.size(0), max_positions = cos.size(0);
  const int64_t* pos_ptr = pos.data_ptr<int64_t>();
  // Checked before the parallel loop: an exception cannot leave an OpenMP region.
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos_ptr[t] >= 0 && pos_ptr[t] < max_positions, "rotary_embedding: position ",
                pos_ptr[t], " is outside the cos/sin tables of ", max_positions, " rows");
  const int64_t work = tokens * (q.size(1) + k.size(1)) * q.size(2);
#pragma omp parallel if (work >= kParallelMinElements)
  rotary_embedding_team(pos, q, k, cos_c, sin_c);
}

}  // namespace tokenmill
