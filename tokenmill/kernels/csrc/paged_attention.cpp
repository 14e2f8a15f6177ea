// Decode attention (one query token per sequence) read straight through a paged KV cache.
//
// The torch path first gathers every sequence's blocks into a contiguous copy. Here each
// (sequence, KV head) pair walks its own block table and reads keys and values in place, one
// block at a time, with an online softmax: a running maximum, denominator and weighted sum of
// values per query head, rescaled whenever a block raises the maximum. No context copy and no
// full score row is ever materialised.
//
// A quantized cache (int8 or fp8 e4m3 codes, an fp32 scale per token and KV head) is read the
// same way: 8 codes at a time become 8 floats (a sign extension, or e4m3's bits moved into fp16,
// fp8.h) and the token's scale multiplies the finished dot product and the value's softmax
// weight.

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "fp8.h"
#include "simd.h"

namespace tokenmill {
namespace {

float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  if (i < n) {
    const __m256i mask = tail_mask(n - i);
    acc = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, mask), _mm256_maskload_ps(b + i, mask), acc);
  }
  return horizontal_sum(acc);
}

// y += alpha * x; plain loops like this one are vectorised by the compiler at -O3.
void axpy(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

constexpr int64_t kLineBytes = 64;

[[gnu::always_inline]] inline void prefetch_bytes(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t i = 0; i < bytes; i += kLineBytes) _mm_prefetch(p + i, _MM_HINT_T0);
}

// A cache's rows are read through key() / value() and used through score() / add_value(), so
// HeadGroup and attend_pair below serve the float cache and the quantized ones alike.
struct PagedCache {
  using Row = const float*;
  const float* keys;    // [num_blocks, block_size, kv_heads, head_dim]
  const float* values;  // same layout as keys
  int64_t block_size, kv_heads, head_dim;

  Row key(int64_t block, int64_t slot, int64_t head) const {
    return keys + offset(block, slot, head);
  }
  Row value(int64_t block, int64_t slot, int64_t head) const {
    return values + offset(block, slot, head);
  }
  float score(const float* query, Row k) const { return dot(query, k, head_dim); }
  void add_value(float weight, Row v, float* acc) const { axpy(weight, v, acc, head_dim); }
  [[gnu::always_inline]] void prefetch(int64_t block, int64_t slot, int64_t head) const {
    prefetch_bytes(key(block, slot, head), head_dim * sizeof(float));
    prefetch_bytes(value(block, slot, head), head_dim * sizeof(float));
  }
  int64_t offset(int64_t block, int64_t slot, int64_t head) const {
    return ((block * block_size + slot) * kv_heads + head) * head_dim;
  }
};

// int8 codes: 8 at a time sign-extended to int32, then converted.
struct Int8Codes {
  using Storage = int8_t;
  static constexpr float kScale = 1.0f;  // what the loaded values are multiplied by
  static __m256 load8(const int8_t* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static float load1(const int8_t* p) { return static_cast<float>(*p); }
};

// fp8 e4m3 codes, loaded as their values times 2^-8 (fp8.h); the token scales undo that exactly.
struct Fp8Codes {
  using Storage = uint8_t;
  static constexpr float kScale = kFp8DecodeScale;
  static __m256 load8(const uint8_t* p) { return fp8x8_scaled(p); }
  static float load1(const uint8_t* p) { return fp8_scaled(*p); }
};

template <typename Codes>
struct QuantizedPagedCache {
  using Code = typename Codes::Storage;
  struct Row {
    const Code* codes;
    float scale;
  };
  const Code* keys;  // [num_blocks, block_size, kv_heads, head_dim]
  const Code* values;
  const float* key_scales;  // [num_blocks, block_size, kv_heads]
  const float* value_scales;
  int64_t block_size, kv_heads, head_dim;

  Row key(int64_t block, int64_t slot, int64_t head) const {
    const int64_t row = index(block, slot, head);
    return {keys + row * head_dim, key_scales[row] * Codes::kScale};
  }
  Row value(int64_t block, int64_t slot, int64_t head) const {
    const int64_t row = index(block, slot, head);
    return {values + row * head_dim, value_scales[row] * Codes::kScale};
  }
  // q . (scale * codes) = scale * (q . codes): one multiply per token, not per element.
  float score(const float* query, Row k) const {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= head_dim; i += 8)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(query + i), Codes::load8(k.codes + i), acc);
    float sum = horizontal_sum(acc);
    for (; i < head_dim; ++i) sum += query[i] * Codes::load1(k.codes + i);
    return k.scale * sum;
  }
  void add_value(float weight, Row v, float* acc) const {
    const float alpha = weight * v.scale;
    const __m256 a = _mm256_set1_ps(alpha);
    int64_t i = 0;
    for (; i + 8 <= head_dim; i += 8)
      _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(a, Codes::load8(v.codes + i),
                                                _mm256_loadu_ps(acc + i)));
    for (; i < head_dim; ++i) acc[i] += alpha * Codes::load1(v.codes + i);
  }
  [[gnu::always_inline]] void prefetch(int64_t block, int64_t slot, int64_t head) const {
    const int64_t row = index(block, slot, head);
    prefetch_bytes(keys + row * head_dim, head_dim);
    prefetch_bytes(values + row * head_dim, head_dim);
    _mm_prefetch(reinterpret_cast<const char*>(key_scales + row), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(value_scales + row), _MM_HINT_T0);
  }
  int64_t index(int64_t block, int64_t slot, int64_t head) const {
    return (block * block_size + slot) * kv_heads + head;
  }
};

// Asks for one block's key and value rows of one KV head ahead of use. Blocks sit anywhere in
// the cache and a pair reads only its head's slice of each token row, so the hardware
// prefetcher cannot predict these reads (measured: 5.9 -> 4.1 ms at B=64, ~290 tokens).
// always_inline: otherwise GCC's IPA finds a function made only of prefetches free of side
// effects and deletes every call to it.
template <typename Cache>
[[gnu::always_inline]] inline void prefetch_block(const Cache& cache, int64_t block,
                                                  int64_t first, int64_t tokens,
                                                  int64_t kv_head) {
  for (int64_t t = first; t < tokens; ++t) cache.prefetch(block, t, kv_head);
}

// Online-softmax state of the query heads that share one KV head. One per thread, reused for
// every (sequence, KV head) pair the thread takes.
class HeadGroup {
 public:
  HeadGroup(int64_t heads, int64_t head_dim, int64_t block_size)
      : heads_(heads), dim_(head_dim), block_size_(block_size), query_(heads * head_dim),
        acc_(heads * head_dim), max_(heads), denom_(heads), weights_(heads * block_size) {}

  // Starts a new pair; the scale is folded into the query once instead of into every score.
  void reset(const float* query, float scale) {
    for (int64_t i = 0; i < heads_ * dim_; ++i) query_[i] = query[i] * scale;
    std::fill(acc_.begin(), acc_.end(), 0.0f);
    std::fill(max_.begin(), max_.end(), -std::numeric_limits<float>::infinity());
    std::fill(denom_.begin(), denom_.end(), 0.0f);
  }

  // Folds positions [first, tokens) of one cache block into the running sums (first > 0 only
  // where a sliding window starts mid-block), asking for the next block's rows (`next_tokens`
  // of them; 0 after the last block) one token per token computed here: spread out this way
  // the requests overlap the arithmetic, where a burst of them for a whole block stalled it
  // (B = 64, 320 tokens: 5.4 -> 3.8 ms, median of alternating runs of both builds). Each key
  // and value row is loaded once and used by every head of the group while it is in L1:
  // grouping heads by KV head is what makes GQA cost one read of K and V, not one per query head.
  template <typename Cache>
  void attend_block(const Cache& cache, int64_t block, int64_t first, int64_t tokens,
                    int64_t kv_head, int64_t next_block, int64_t next_tokens) {
    prefetch_block(cache, next_block, 0, std::min(first, next_tokens), kv_head);
    for (int64_t t = first; t < tokens; ++t) {
      if (t < next_tokens) cache.prefetch(next_block, t, kv_head);
      const auto k = cache.key(block, t, kv_head);
      for (int64_t g = 0; g < heads_; ++g) weight(g, t) = cache.score(&query_[g * dim_], k);
    }
    for (int64_t g = 0; g < heads_; ++g) rebase(g, first, tokens);
    for (int64_t t = first; t < tokens; ++t) {
      const auto v = cache.value(block, t, kv_head);
      for (int64_t g = 0; g < heads_; ++g) cache.add_value(weight(g, t), v, &acc_[g * dim_]);
    }
  }

  void write_output(float* out) const {
    for (int64_t g = 0; g < heads_; ++g) {
      const float inv = 1.0f / denom_[g];
      for (int64_t i = 0; i < dim_; ++i) out[g * dim_ + i] = acc_[g * dim_ + i] * inv;
    }
  }

 private:
  float& weight(int64_t g, int64_t t) { return weights_[g * block_size_ + t]; }

  // Moves head g's sums to the maximum including this block's scores (exp(old - new) is 0 on
  // the first block, where old is -inf) and turns the scores into weights exp(s - max), so
  // every exponent is <= 0 and nothing overflows.
  void rebase(int64_t g, int64_t first, int64_t tokens) {
    float new_max = max_[g];
    for (int64_t t = first; t < tokens; ++t) new_max = std::max(new_max, weight(g, t));
    const float correction = std::exp(max_[g] - new_max);
    float* scores = &weight(g, 0);
    const __m256 shift = _mm256_set1_ps(new_max);
    __m256 sums = _mm256_setzero_ps();
    int64_t t = first;
    for (; t + 8 <= tokens; t += 8) {
      const __m256 w = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), shift));
      _mm256_storeu_ps(scores + t, w);
      sums = _mm256_add_ps(sums, w);
    }
    if (t < tokens) {  // lanes past the block's last token are zeroed before they are summed
      const __m256i mask = tail_mask(tokens - t);
      const __m256 w = _mm256_and_ps(
          exp8(_mm256_sub_ps(_mm256_maskload_ps(scores + t, mask), shift)),
          _mm256_castsi256_ps(mask));
      _mm256_maskstore_ps(scores + t, mask, w);
      sums = _mm256_add_ps(sums, w);
    }
    const float block_sum = horizontal_sum(sums);
    if (correction != 1.0f)
      for (int64_t i = 0; i < dim_; ++i) acc_[g * dim_ + i] *= correction;
    denom_[g] = denom_[g] * correction + block_sum;
    max_[g] = new_max;
  }

  int64_t heads_, dim_, block_size_;
  std::vector<float> query_;    // [heads, dim], pre-scaled
  std::vector<float> acc_;      // [heads, dim]: sum over seen positions of exp(s - max) v
  std::vector<float> max_;      // [heads]
  std::vector<float> denom_;    // [heads]: sum over seen positions of exp(s - max)
  std::vector<float> weights_;  // [heads, block_size]: one block's scores, then its weights
};

// One (sequence, KV head) pair over its blocks: all of them, or with a sliding window (> 0) only
// the last `window` positions, the blocks before those never read. One block of prefetch ahead
// is enough: a block's arithmetic outlasts a DRAM round trip; the first block is requested in
// one burst, as nothing could overlap it.
template <typename Cache>
void attend_pair(HeadGroup& state, const Cache& cache, const int64_t* blocks, int64_t seq_len,
                 int64_t window, int64_t kv_head, const float* query, float scale, float* out) {
  const int64_t block_size = cache.block_size;
  const int64_t num_used = (seq_len + block_size - 1) / block_size;
  const int64_t start = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
  const int64_t first_block = start / block_size;
  const auto tokens_in = [&](int64_t i) { return std::min(block_size, seq_len - i * block_size); };
  const auto first_in = [&](int64_t i) { return i == first_block ? start - i * block_size : 0; };
  prefetch_block(cache, blocks[first_block], first_in(first_block), tokens_in(first_block),
                 kv_head);
  state.reset(query, scale);
  for (int64_t i = first_block; i < num_used; ++i) {
    const bool more = i + 1 < num_used;
    state.attend_block(cache, blocks[i], first_in(i), tokens_in(i), kv_head,
                       more ? blocks[i + 1] : 0, more ? tokens_in(i + 1) : 0);
  }
  state.write_output(out);
}

// Rejects lengths and block ids that would read outside the cache. Done before the parallel
// loop because an exception cannot leave an OpenMP region.
void check_tables(const at::Tensor& tables, const at::Tensor& lens, int64_t block_size,
                  int64_t num_blocks) {
  const int64_t batch = tables.size(0), max_blocks = tables.size(1);
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= max_blocks * block_size, "paged_decode_attention: ",
                "seq_lens[", b, "] = ", len[b], " is outside [1, max_blocks * block_size]");
    for (int64_t i = 0; i < (len[b] + block_size - 1) / block_size; ++i) {
      const int64_t id = table[b * max_blocks + i];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_decode_attention: block id ", id,
                  " of sequence ", b, " is outside the cache");
    }
  }
}

// Every (sequence, KV head) pair of the batch over `cache`; q is [B, H, d], contiguous.
template <typename Cache>
at::Tensor attend_batch(const Cache& cache, const at::Tensor& qc, const at::Tensor& tables,
                        const at::Tensor& lens, double scale, int64_t window) {
  const int64_t batch = qc.size(0), heads = qc.size(1), dim = qc.size(2);
  const int64_t kv_heads = cache.kv_heads, block_size = cache.block_size;
  at::Tensor out = at::empty_like(qc);
  const int64_t group = heads / kv_heads, max_blocks = tables.size(1);
  const float* q_ptr = qc.data_ptr<float>();
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
#pragma omp parallel
  {
    HeadGroup state(group, dim, block_size);
    // Dynamic: sequences differ in length, so equal counts of pairs are not equal work.
#pragma omp for schedule(dynamic)
    for (int64_t pair = 0; pair < batch * kv_heads; ++pair) {
      const int64_t b = pair / kv_heads, kv_head = pair % kv_heads;
      // The group's query heads kv_head * group ... are adjacent rows of q and of out.
      const int64_t first_row = (b * heads + kv_head * group) * dim;
      attend_pair(state, cache, table + b * max_blocks, len[b], window, kv_head,
                  q_ptr + first_row, static_cast<float>(scale), out_ptr + first_row);
    }
  }
  return out;
}

// The checks both entry points share, on q [B, H, d] and a cache [2, blocks, block_size,
// kv_heads, d]; returns the tables and lengths as contiguous int64.
std::pair<at::Tensor, at::Tensor> check_batch(const char* op, const at::Tensor& q,
                                              const at::Tensor& cache,
                                              const at::Tensor& block_tables,
                                              const at::Tensor& seq_lens) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5 && cache.size(0) == 2, op,
              ": q must be [B, H, d], the cache [2, blocks, block_size, kv_heads, d]");
  TORCH_CHECK(q.scalar_type() == at::kFloat, op, ": q must be float32");
  TORCH_CHECK(cache.is_contiguous(), op, ": the cache must be contiguous");
  TORCH_CHECK(cache.size(4) == q.size(2), op, ": head_dim of q and cache differ");
  TORCH_CHECK(q.size(1) % cache.size(3) == 0, op, ": heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  seq_lens.numel() == q.size(0),
              op, ": block_tables must be [B, max_blocks], seq_lens [B]");
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  check_tables(tables, lens, cache.size(2), cache.size(1));
  return {tables, lens};
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  double scale, int64_t window) {
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat,
              "paged_decode_attention: kv_cache must be float32");
  const auto [tables, lens] =
      check_batch("paged_decode_attention", q, kv_cache, block_tables, seq_lens);
  // K and V halves by pointer arithmetic: kv_cache[0] would cost a dispatched select per call.
  const float* keys = kv_cache.data_ptr<float>();
  const PagedCache cache{keys, keys + kv_cache.stride(0), kv_cache.size(2), kv_cache.size(3),
                         kv_cache.size(4)};
  return attend_batch(cache, q.contiguous(), tables, lens, scale, window);
}

// values: int8 or float8_e4m3fn [2, blocks, block_size, kv_heads, d]; scales: float32
// [2, blocks, block_size, kv_heads].
at::Tensor paged_decode_attention_quantized(const at::Tensor& q, const at::Tensor& values,
                                            const at::Tensor& scales,
                                            const at::Tensor& block_tables,
                                            const at::Tensor& seq_lens, double scale,
                                            int64_t window) {
  constexpr const char* kOp = "paged_decode_attention_quantized";
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.sizes() == values.sizes().slice(0, 4),
              kOp, ": scales must be a contiguous float32 [2, blocks, block_size, kv_heads]");
  const auto [tables, lens] = check_batch(kOp, q, values, block_tables, seq_lens);
  const int64_t block_size = values.size(2), kv_heads = values.size(3), dim = values.size(4);
  const float* key_scales = scales.data_ptr<float>();
  const float* value_scales = key_scales + scales.stride(0);
  const at::Tensor qc = q.contiguous();
  if (values.scalar_type() == at::kChar) {
    const int8_t* keys = values.data_ptr<int8_t>();
    const QuantizedPagedCache<Int8Codes> cache{
        keys, keys + values.stride(0), key_scales, value_scales, block_size, kv_heads, dim};
    return attend_batch(cache, qc, tables, lens, scale, window);
  }
  TORCH_CHECK(values.scalar_type() == at::kFloat8_e4m3fn, kOp,
              ": values must be int8 or float8_e4m3fn");
  const auto* keys = static_cast<const uint8_t*>(values.data_ptr());
  const QuantizedPagedCache<Fp8Codes> cache{
      keys, keys + values.stride(0), key_scales, value_scales, block_size, kv_heads, dim};
  return attend_batch(cache, qc, tables, lens, scale, window);
}

}  // namespace tokenmill
