// Decode attention (one query token per sequence) read straight through a paged KV cache.
//
// The torch path first gathers every sequence's blocks into a contiguous copy. Here each
// sequence (or, in a small batch, each of its KV heads) walks its own block table and reads keys
// and values in place, one block at a time, with an online softmax: a running maximum,
// denominator and weighted sum of values per query head, rescaled whenever a block raises the
// maximum. No context copy and no full score row is ever materialised.
//
// A bfloat16 cache (a bfloat16 model's) is read the same way, 8 elements at a time widened to
// floats (a bfloat16 is the top half of a float), so it streams half of float32's bytes. A
// quantized cache (int8 or fp8 e4m3 codes, an fp32 scale per token and KV head) too: 8 codes at a
// time become 8 floats (a sign extension, or e4m3's bits moved into fp16, fp8.h) and the token's
// scale multiplies the finished dot product and the value's softmax weight. Over either, a
// bfloat16 model's query is widened as it is read and the output rounded once. Where the CPU
// has AVX-512, the same walk runs 16 lanes at a time (paged_attention_avx512.inc).
//
// A key mask hides some of each query's last keys: a draft tree's node, verified as a decode
// whose context ends at its own slot, sees the context, the root and its own ancestors, not
// the other branches drafted between them. Hidden keys score -inf, so they take no weight.

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <omp.h>
#include <vector>

#include "fp8.h"
#include "simd.h"
#include "team.h"

namespace tokenmill {
namespace {

constexpr int64_t kLineBytes = 64;

[[gnu::always_inline]] inline void prefetch_bytes(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t i = 0; i < bytes; i += kLineBytes) _mm_prefetch(p + i, _MM_HINT_T0);
}

// How a cache's elements become floats, 8 at a time (load8) or the last n < 8 of a row with
// zeros after them (load_tail), and whether rows carry a scale (a quantized cache). float32 and
// bfloat16 (widened exactly, simd.h) take Lanes<T>'s loads and no scale.
template <typename T>
struct PlainElements {
  using Storage = T;
  static constexpr bool kScaled = false;
  static constexpr float kScale = 1.0f;
  static __m256 load8(const T* p) { return Lanes<T>::load(p); }
  static __m256 load_tail(const T* p, int64_t n) { return Lanes<T>::load_tail(p, n); }
};
using Float32Elements = PlainElements<float>;
using Bfloat16Elements = PlainElements<c10::BFloat16>;

// Codes are copied into a zeroed buffer for a tail: nothing past the row is read.
template <typename Codes>
__m256 load_code_tail(const typename Codes::Storage* p, int64_t n) {
  typename Codes::Storage padded[8] = {};
  std::copy_n(p, n, padded);
  return Codes::load8(padded);
}

// int8 codes: 8 at a time sign-extended to int32, then converted.
struct Int8Elements {
  using Storage = int8_t;
  static constexpr bool kScaled = true;
  static constexpr float kScale = 1.0f;  // what the loaded values are multiplied by
  static __m256 load8(const int8_t* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static __m256 load_tail(const int8_t* p, int64_t n) { return load_code_tail<Int8Elements>(p, n); }
};

// fp8 e4m3 codes, loaded as their values times 2^-8 (fp8.h); the token scales undo that exactly.
struct Fp8Elements {
  using Storage = uint8_t;
  static constexpr bool kScaled = true;
  static constexpr float kScale = kFp8DecodeScale;
  static __m256 load8(const uint8_t* p) { return fp8x8_scaled(p); }
  static __m256 load_tail(const uint8_t* p, int64_t n) { return load_code_tail<Fp8Elements>(p, n); }
};

// One paged cache, float32 or quantized, read through key() / value() rows: a row's elements
// and the factor its products take (its token's scale, 1 for float32). HeadGroup and
// attend_heads below serve every element type through it.
template <typename E>
struct PagedCache {
  using Elements = E;
  using Element = typename E::Storage;
  struct Row {
    const Element* data;
    float scale;
  };
  const Element* keys;      // [num_blocks, block_size, kv_heads, head_dim]
  const Element* values;    // same layout as keys
  const float* key_scales;  // [num_blocks, block_size, kv_heads]; unused for float32
  const float* value_scales;
  int64_t block_size, kv_heads, head_dim;

  Row key(int64_t block, int64_t slot, int64_t head) const {
    return row(keys, key_scales, index(block, slot, head));
  }
  Row value(int64_t block, int64_t slot, int64_t head) const {
    return row(values, value_scales, index(block, slot, head));
  }
  [[gnu::always_inline]] void prefetch(int64_t block, int64_t slot, int64_t head) const {
    const int64_t i = index(block, slot, head);
    prefetch_bytes(keys + i * head_dim, head_dim * sizeof(Element));
    prefetch_bytes(values + i * head_dim, head_dim * sizeof(Element));
    if constexpr (E::kScaled) {
      _mm_prefetch(reinterpret_cast<const char*>(key_scales + i), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(value_scales + i), _MM_HINT_T0);
    }
  }
  int64_t index(int64_t block, int64_t slot, int64_t head) const {
    return (block * block_size + slot) * kv_heads + head;
  }

 private:
  Row row(const Element* data, const float* scales, int64_t i) const {
    if constexpr (E::kScaled) return {data + i * head_dim, scales[i] * E::kScale};
    return {data + i * head_dim, 1.0f};
  }
};

// Keys scored together: four dot products share each load of the query and reduce together.
constexpr int64_t kKeyTile = 4;

// q . k[j] for four key rows, as four lanes. Four accumulators make four independent FMA chains
// (one chain per dot product stalled on FMA latency, measured), reduced together (sum4).
template <typename Cache>
__m128 score4(const Cache& cache, const float* q, const typename Cache::Row (&k)[kKeyTile]) {
  using E = typename Cache::Elements;
  const int64_t dim = cache.head_dim;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 8 <= dim; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(qv, E::load8(k[0].data + i), a0);
    a1 = _mm256_fmadd_ps(qv, E::load8(k[1].data + i), a1);
    a2 = _mm256_fmadd_ps(qv, E::load8(k[2].data + i), a2);
    a3 = _mm256_fmadd_ps(qv, E::load8(k[3].data + i), a3);
  }
  if (i < dim) {
    const int64_t n = dim - i;
    const __m256 qv = _mm256_maskload_ps(q + i, tail_mask(n));
    a0 = _mm256_fmadd_ps(qv, E::load_tail(k[0].data + i, n), a0);
    a1 = _mm256_fmadd_ps(qv, E::load_tail(k[1].data + i, n), a1);
    a2 = _mm256_fmadd_ps(qv, E::load_tail(k[2].data + i, n), a2);
    a3 = _mm256_fmadd_ps(qv, E::load_tail(k[3].data + i, n), a3);
  }
  const __m128 sums = sum4(a0, a1, a2, a3);
  if constexpr (E::kScaled)
    return _mm_mul_ps(sums, _mm_setr_ps(k[0].scale, k[1].scale, k[2].scale, k[3].scale));
  return sums;
}

// The key rows of positions [t, t + kKeyTile) of a block (a short last tile repeats its last
// row), asking for the next block's rows of the same positions (`next_tokens` of them; 0: none)
// one token at a time (HeadGroup::attend_block says why).
template <typename Cache>
[[gnu::always_inline]] inline void key_tile(const Cache& cache, int64_t block, int64_t t,
                                            int64_t tokens, int64_t kv_head, int64_t next_block,
                                            int64_t next_tokens,
                                            typename Cache::Row (&k)[kKeyTile]) {
  for (int64_t j = 0; j < kKeyTile; ++j) {
    if (t + j < next_tokens) cache.prefetch(next_block, t + j, kv_head);
    k[j] = cache.key(block, std::min(t + j, tokens - 1), kv_head);
  }
}

// acc[0, width) += sum over tokens [first, tokens) of weights[t] * v_t[offset, offset + width),
// the accumulator columns held in registers across the block's tokens (8 FMA chains when
// width is 64) instead of loaded and stored once per token.
template <int Vectors, typename Cache>
[[gnu::always_inline]] inline void add_value_columns(const Cache& cache, int64_t block,
                                                     int64_t first, int64_t tokens,
                                                     int64_t kv_head, const float* weights,
                                                     int64_t offset, float* acc) {
  using E = typename Cache::Elements;
  __m256 c[Vectors];
  for (int j = 0; j < Vectors; ++j) c[j] = _mm256_loadu_ps(acc + offset + 8 * j);
  for (int64_t t = first; t < tokens; ++t) {
    const auto v = cache.value(block, t, kv_head);
    const __m256 w = _mm256_set1_ps(weights[t] * v.scale);
    for (int j = 0; j < Vectors; ++j)
      c[j] = _mm256_fmadd_ps(w, E::load8(v.data + offset + 8 * j), c[j]);
  }
  for (int j = 0; j < Vectors; ++j) _mm256_storeu_ps(acc + offset + 8 * j, c[j]);
}

template <typename Cache>
void add_values(const Cache& cache, int64_t block, int64_t first, int64_t tokens,
                int64_t kv_head, const float* weights, float* acc) {
  using E = typename Cache::Elements;
  const int64_t dim = cache.head_dim;
  int64_t i = 0;
  for (; i + 64 <= dim; i += 64)
    add_value_columns<8>(cache, block, first, tokens, kv_head, weights, i, acc);
  for (; i + 8 <= dim; i += 8)
    add_value_columns<1>(cache, block, first, tokens, kv_head, weights, i, acc);
  if (i < dim) {
    const int64_t n = dim - i;
    const __m256i mask = tail_mask(n);
    __m256 c = _mm256_maskload_ps(acc + i, mask);
    for (int64_t t = first; t < tokens; ++t) {
      const auto v = cache.value(block, t, kv_head);
      c = _mm256_fmadd_ps(_mm256_set1_ps(weights[t] * v.scale), E::load_tail(v.data + i, n), c);
    }
    _mm256_maskstore_ps(acc + i, mask, c);
  }
}

// One block's part of a head's softmax: its scores' maximum, joined with the running one, and
// the sum of the weights exp(s - max) they became.
struct BlockWeights {
  float max;
  float sum;
};

// The key mask's part of one block: positions [from, block's end) are visible where
// visible[t - from] holds; visible == nullptr: the mask hides none of the block.
struct BlockMask {
  const bool* visible = nullptr;
  int64_t from = 0;
};

// Each query's key mask: row b (`width` flags) covers the last `width` keys of its context,
// [seq_len - width, seq_len) (flags before position 0 unused); a cleared flag hides that key.
// rows == nullptr: no mask.
struct KeyMask {
  const bool* rows = nullptr;
  int64_t width = 0;
  const bool* row(int64_t b) const { return rows == nullptr ? nullptr : rows + b * width; }
};

// The first position a query of `seq_len` keys reads: 0, or with a sliding window (> 0) the
// position of the window-th last key its mask row (`visible`, `width` flags; nullptr: none)
// leaves visible. A tree node's hidden keys are other branches, not positions on its path, so
// its window spans `window` positions of its own path, as a chain's does.
int64_t window_start(int64_t seq_len, int64_t window, const bool* visible, int64_t width) {
  if (window <= 0) return 0;
  const int64_t mask_start = seq_len - (visible == nullptr ? 0 : width);
  int64_t seen = 0;
  for (int64_t key = seq_len - 1; key >= std::max<int64_t>(mask_start, 0); --key)
    if (visible[key - mask_start] && ++seen == window) return key;
  return std::max<int64_t>(0, mask_start - (window - seen));
}

// The AVX-512 path: kWideAttention, namespace wide and for_head_runs.
#include "paged_attention_avx512.inc"

// Asks for one block's key and value rows of one KV head ahead of use. Blocks sit anywhere in
// the cache and a pair reads only its head's slice of each token row, so the hardware
// prefetcher cannot predict these reads; asking ahead shortened a large batch's attention.
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
      : heads_(heads), dim_(head_dim), block_size_(block_size),
        wide_(kWideAttention && head_dim % 16 == 0), query_(heads * head_dim),
        acc_(heads * head_dim), max_(heads), denom_(heads),
        weights_(heads * (block_size + kKeyTile)) {}

  // Starts a new pair; the scale is folded into the query once instead of into every score.
  // Q: float, or at::BFloat16 (a bfloat16 model's query, widened exactly).
  template <typename Q>
  void reset(const Q* query, float scale) {
    for (int64_t i = 0; i < heads_ * dim_; ++i) query_[i] = static_cast<float>(query[i]) * scale;
    std::fill(acc_.begin(), acc_.end(), 0.0f);
    std::fill(max_.begin(), max_.end(), -std::numeric_limits<float>::infinity());
    std::fill(denom_.begin(), denom_.end(), 0.0f);
  }

  // Folds positions [first, tokens) of one cache block into the running sums (first > 0 only
  // where a sliding window starts mid-block), asking for the next block's rows (`next_tokens`
  // of them; 0 after the last block) one token per token computed here: spread out this way
  // the requests overlap the arithmetic, where a burst of them for a whole block stalled it
  // (measured on a large batch, alternating runs of both builds). Each key and value row is
  // read from memory once and used by every head of the group while it is in L1 (on the
  // AVX-512 path, in registers): grouping heads by KV head is what makes GQA cost one read of
  // K and V, not one per query head.
  // `hidden`: which of the block's positions the key mask hides (BlockMask), if any.
  template <typename Cache>
  void attend_block(const Cache& cache, int64_t block, int64_t first, int64_t tokens,
                    int64_t kv_head, int64_t next_block, int64_t next_tokens,
                    const BlockMask& hidden) {
    prefetch_block(cache, next_block, 0, std::min(first, next_tokens), kv_head);
    if (wide_) {
      attend_block_wide(cache, block, first, tokens, kv_head, next_block, next_tokens, hidden);
      return;
    }
    for (int64_t t = first; t < tokens; t += kKeyTile) {
      typename Cache::Row k[kKeyTile];
      key_tile(cache, block, t, tokens, kv_head, next_block, next_tokens, k);
      for (int64_t g = 0; g < heads_; ++g)
        _mm_storeu_ps(&weight(g, t), score4(cache, &query_[g * dim_], k));
    }
    hide(hidden, tokens);
    for (int64_t g = 0; g < heads_; ++g) rebase(g, first, tokens);
    for (int64_t g = 0; g < heads_; ++g)
      add_values(cache, block, first, tokens, kv_head, &weight(g, 0), &acc_[g * dim_]);
  }

  // A bfloat16 output rounds once, to nearest even, as torch's `.to(torch.bfloat16)` would.
  template <typename Q>
  void write_output(Q* out) const {
    for (int64_t g = 0; g < heads_; ++g) {
      const float inv = 1.0f / denom_[g];
      for (int64_t i = 0; i < dim_; ++i)
        out[g * dim_ + i] = static_cast<Q>(acc_[g * dim_ + i] * inv);
    }
  }

  // The sums of one partition of the context, for merge_partitions: head g's maximum,
  // denominator and weighted values at `partial + g * stride`.
  void write_partial(float* partial, int64_t stride) const {
    for (int64_t g = 0; g < heads_; ++g) {
      float* row = partial + g * stride;
      row[0] = max_[g];
      row[1] = denom_[g];
      std::copy_n(&acc_[g * dim_], dim_, row + 2);
    }
  }

 private:
  // A row per head, kKeyTile - 1 longer than a block: a short tile's extra lanes land there.
  float& weight(int64_t g, int64_t t) { return weights_[g * (block_size_ + kKeyTile) + t]; }

  // attend_block on the AVX-512 path: the query heads in runs of up to kWideHeads.
  template <typename Cache>
  void attend_block_wide(const Cache& cache, int64_t block, int64_t first, int64_t tokens,
                         int64_t kv_head, int64_t next_block, int64_t next_tokens,
                         const BlockMask& hidden) {
    const int64_t stride = block_size_ + kKeyTile;
    for_head_runs(heads_, [&](int64_t g, auto count) {
      wide::score_block<count.value>(cache, block, first, tokens, kv_head, &query_[g * dim_],
                                     &weight(g, 0), stride, next_block, g == 0 ? next_tokens : 0);
    });
    hide(hidden, tokens);
    for (int64_t g = 0; g < heads_; ++g) rebase(g, first, tokens);
    for_head_runs(heads_, [&](int64_t g, auto count) {
      wide::add_values<count.value>(cache, block, first, tokens, kv_head, &weight(g, 0), stride,
                                    &acc_[g * dim_]);
    });
  }

  // Scores of the positions the key mask hides become -inf: weight exp(-inf - max) = 0, and a
  // block hidden whole before any key was seen leaves the sums as they were (weigh_scores
  // zeroes the NaN of -inf - -inf, as it zeroes anything below float's range).
  void hide(const BlockMask& hidden, int64_t tokens) {
    if (hidden.visible == nullptr) return;
    for (int64_t t = hidden.from; t < tokens; ++t)
      if (!hidden.visible[t - hidden.from])
        for (int64_t g = 0; g < heads_; ++g) weight(g, t) = -std::numeric_limits<float>::infinity();
  }

  // Moves head g's sums to the maximum including this block's scores (exp(old - new) is 0 on
  // the first block, where old is -inf) and turns the scores into weights exp(s - max), so
  // every exponent is <= 0 and nothing overflows. Most blocks leave the maximum where it was,
  // and then the sums stay as they are.
  void rebase(int64_t g, int64_t first, int64_t tokens) {
    float* scores = &weight(g, 0);
    const BlockWeights block = wide_ ? wide::weigh_scores(scores, first, tokens, max_[g])
                                     : weigh_scores(scores, first, tokens, max_[g]);
    if (block.max != max_[g]) {
      const float correction = std::exp(max_[g] - block.max);
      for (int64_t i = 0; i < dim_; ++i) acc_[g * dim_ + i] *= correction;
      denom_[g] *= correction;
      max_[g] = block.max;
    }
    denom_[g] += block.sum;
  }

  // rebase's weights on the AVX2 path.
  static BlockWeights weigh_scores(float* scores, int64_t first, int64_t tokens,
                                   float running_max) {
    float new_max = running_max;
    for (int64_t t = first; t < tokens; ++t) new_max = std::max(new_max, scores[t]);
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
    return {new_max, horizontal_sum(sums)};
  }

  int64_t heads_, dim_, block_size_;
  bool wide_;                   // the AVX-512 path
  std::vector<float> query_;    // [heads, dim], pre-scaled
  std::vector<float> acc_;      // [heads, dim]: sum over seen positions of exp(s - max) v
  std::vector<float> max_;      // [heads]
  std::vector<float> denom_;    // [heads]: sum over seen positions of exp(s - max)
  std::vector<float> weights_;  // [heads, block_size + 4]: a block's scores, then weights
};

// A long context is cut into partitions of this many tokens (whole blocks), each a work item of
// its own whose sums merge_partitions combines: without them a single sequence's decode is only
// its KV heads' worth of items (SmolLM2's 3 over 2 threads, one thread idle for a third of the
// time; Gemma 3's 1 leaves a thread idle throughout). The cut depends on the sequence alone,
// never on the batch, so a sequence's output has the same bits whatever runs beside it.
constexpr int64_t kPartitionTokens = 512;

int64_t partition_blocks(int64_t block_size) {
  return std::max<int64_t>(1, kPartitionTokens / block_size);
}

// The most partitions a sequence can have whose block table has `max_blocks` columns.
int64_t max_partitions(int64_t max_blocks, int64_t block_size) {
  const int64_t per_partition = partition_blocks(block_size);
  return (max_blocks + per_partition - 1) / per_partition;
}

// The blocks a sequence of `seq_len` tokens reads: [first, end), with a sliding window (> 0)
// only those of its last `window` positions (window_start; `visible`: its key mask row).
struct ContextBlocks {
  int64_t start;  // the first position read
  int64_t first, end;
  ContextBlocks(int64_t seq_len, int64_t window, int64_t block_size,
                const bool* visible = nullptr, int64_t width = 0)
      : start(window_start(seq_len, window, visible, width)),
        first(start / block_size),
        end((seq_len + block_size - 1) / block_size) {}
  int64_t partitions(int64_t per_partition) const {
    return (end - first + per_partition - 1) / per_partition;
  }
};

// Where one sequence's partition sums go: query head hq's of partition p at `sums + hq *
// head_stride + p * (head_dim + 2)`. nullptr: the context is one partition, whose output is
// written directly.
struct PartitionSums {
  float* sums;
  int64_t head_stride;
};

// KV heads [first_head, last_head) of one sequence over partitions [first_partition,
// last_partition) of its context, each partition's sums into `partial`, or the output into out.
// Block by block, every head of the range takes its turn on the block before the next block:
// a block holds its tokens' rows of all KV heads side by side, so the range reads it as one
// run of memory instead of a head's 256-byte slice every 768 bytes (with SmolLM2's 9 query and
// 3 KV heads), which shortened a large batch's attention, as holding score4's sums and the value
// columns in registers did again. One block of prefetch ahead is enough: a block's arithmetic
// outlasts a DRAM round trip; the first block is requested in one burst, as nothing could
// overlap it. The prefetches run on across partitions.
template <typename Cache, typename Q>
void attend_heads(HeadGroup* states, const Cache& cache, const int64_t* blocks, int64_t seq_len,
                  const ContextBlocks& context, int64_t per_partition, int64_t first_partition,
                  int64_t last_partition, int64_t first_head, int64_t last_head, const Q* query,
                  float scale, Q* out, int64_t group_stride, PartitionSums partial,
                  const bool* visible, int64_t mask_width) {
  const int64_t block_size = cache.block_size, dim = cache.head_dim;
  const int64_t mask_start = seq_len - mask_width;
  // Block i's part of the key mask (none when the mask covers none of its positions).
  const auto hidden_in = [&](int64_t i) {
    const int64_t base = i * block_size;
    if (visible == nullptr || base + block_size <= mask_start) return BlockMask{};
    const int64_t from = std::max<int64_t>(0, mask_start - base);
    return BlockMask{visible + (base + from - mask_start), from};
  };
  const int64_t group = group_stride / dim;
  const int64_t begin = context.first + first_partition * per_partition;
  const int64_t end = std::min(context.end, context.first + last_partition * per_partition);
  const auto tokens_in = [&](int64_t i) { return std::min(block_size, seq_len - i * block_size); };
  const auto first_in = [&](int64_t i) {
    return i == context.first ? context.start - i * block_size : 0;
  };
  for (int64_t h = first_head; h < last_head; ++h)
    prefetch_block(cache, blocks[begin], first_in(begin), tokens_in(begin), h);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t p = (i - context.first) / per_partition;
    if (i == begin || (i - context.first) % per_partition == 0)
      for (int64_t h = first_head; h < last_head; ++h)
        states[h - first_head].reset(query + h * group_stride, scale);
    const bool more = i + 1 < end;
    for (int64_t h = first_head; h < last_head; ++h)
      states[h - first_head].attend_block(cache, blocks[i], first_in(i), tokens_in(i), h,
                                          more ? blocks[i + 1] : 0, more ? tokens_in(i + 1) : 0,
                                          hidden_in(i));
    if (more && (i + 1 - context.first) % per_partition != 0) continue;
    for (int64_t h = first_head; h < last_head; ++h) {
      if (partial.sums == nullptr)
        states[h - first_head].write_output(out + h * group_stride);
      else
        states[h - first_head].write_partial(
            partial.sums + h * group * partial.head_stride + p * (dim + 2), partial.head_stride);
    }
  }
}

// One query head's output from its partitions' sums (`partitions` rows of write_partial's, `dim
// + 2` floats apart): each partition's sums moved to the largest maximum, then added.
// `acc`: dim floats of room.
template <typename Q>
void merge_partitions(const float* partial, int64_t partitions, int64_t dim, float* acc, Q* out) {
  const int64_t row = dim + 2;
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < partitions; ++p) max = std::max(max, partial[p * row]);
  float denom = 0;
  std::fill_n(acc, dim, 0.0f);
  for (int64_t p = 0; p < partitions; ++p) {
    const float* sums = partial + p * row;
    const float weight = std::exp(sums[0] - max);
    denom += sums[1] * weight;
    for (int64_t i = 0; i < dim; ++i) acc[i] += sums[2 + i] * weight;
  }
  const float inv = 1.0f / denom;
  for (int64_t i = 0; i < dim; ++i) out[i] = static_cast<Q>(acc[i] * inv);
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

// Every (sequence, KV head) pair of the batch over `cache` into out [B, H, d], contiguous; q is
// [B, H, d] with contiguous heads and any token stride. Q, q's and out's element: float, or
// at::BFloat16 (a bfloat16 model's, whose cache is bfloat16 or 8-bit). `scratch`: the partitions'
// sums (decode_attention_scratch_bytes).
template <typename Q, typename Cache>
void attend_batch(const Cache& cache, const at::Tensor& q, const at::Tensor& tables,
                  const at::Tensor& lens, double scale, int64_t window, const KeyMask& mask,
                  const at::Tensor& out, float* scratch) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), q_stride = q.stride(0);
  const int64_t kv_heads = cache.kv_heads, block_size = cache.block_size;
  const int64_t group = heads / kv_heads, max_blocks = tables.size(1);
  const int64_t per_partition = partition_blocks(block_size);
  const int64_t partitions = max_partitions(max_blocks, block_size);
  const Q* q_ptr = q.data_ptr<Q>();
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  Q* out_ptr = out.data_ptr<Q>();
  // A work item is a sequence with all its KV heads, or where that leaves threads idle (a few
  // sequences) a single KV head of one over one partition of its context.
  const bool few = batch < 4 * omp_get_num_threads();
  const int64_t heads_per_item = few ? 1 : kv_heads;
  const int64_t head_items = kv_heads / heads_per_item;
  const int64_t partition_items = few ? partitions : 1;
  // A query head's partitions' sums: `partitions` rows of dim + 2 floats.
  const int64_t row = dim + 2, head_rows = partitions * row;
  std::vector<HeadGroup> states(heads_per_item, HeadGroup(group, dim, block_size));
  // Dynamic: sequences differ in length, so equal counts of items are not equal work.
#pragma omp for schedule(dynamic)
  for (int64_t item = 0; item < batch * head_items * partition_items; ++item) {
    const int64_t b = item / (head_items * partition_items);
    const int64_t first_head = item / partition_items % head_items * heads_per_item;
    const ContextBlocks context(len[b], window, block_size, mask.row(b), mask.width);
    const int64_t used = context.partitions(per_partition);
    const int64_t first_partition = few ? item % partition_items : 0;
    if (first_partition >= used) continue;
    const PartitionSums partial{used == 1 ? nullptr : scratch + b * heads * head_rows, head_rows};
    // KV head h's query heads h * group ... are adjacent rows of q and of out.
    attend_heads(states.data(), cache, table + b * max_blocks, len[b], context, per_partition,
                 first_partition, few ? first_partition + 1 : used, first_head,
                 first_head + heads_per_item, q_ptr + b * q_stride, static_cast<float>(scale),
                 out_ptr + b * heads * dim, group * dim, partial, mask.row(b), mask.width);
  }
  if (partitions == 1) return;
  std::vector<float> merged(dim);
#pragma omp for schedule(static)
  for (int64_t r = 0; r < batch * heads; ++r) {
    const int64_t b = r / heads;
    const int64_t used =
        ContextBlocks(len[b], window, block_size, mask.row(b), mask.width).partitions(per_partition);
    if (used > 1)
      merge_partitions(scratch + r * head_rows, used, dim, merged.data(), out_ptr + r * dim);
  }
}

// The cache's elements and layout for attend_batch: float32 or bfloat16, or int8 / fp8 codes
// with `scales`.
template <typename Body>
void with_cache(const at::Tensor& kv_cache, const at::Tensor* scales, Body body) {
  const int64_t block_size = kv_cache.size(2), kv_heads = kv_cache.size(3), dim = kv_cache.size(4);
  // K and V halves by pointer arithmetic: kv_cache[0] would cost a dispatched select per call.
  if (kv_cache.scalar_type() == at::kBFloat16) {
    const auto* keys = kv_cache.data_ptr<c10::BFloat16>();
    body(PagedCache<Bfloat16Elements>{keys, keys + kv_cache.stride(0), nullptr, nullptr,
                                      block_size, kv_heads, dim});
    return;
  }
  if (scales == nullptr) {
    const float* keys = kv_cache.data_ptr<float>();
    body(PagedCache<Float32Elements>{keys, keys + kv_cache.stride(0), nullptr, nullptr,
                                     block_size, kv_heads, dim});
    return;
  }
  const float* key_scales = scales->data_ptr<float>();
  const float* value_scales = key_scales + scales->stride(0);
  if (kv_cache.scalar_type() == at::kChar) {
    const int8_t* keys = kv_cache.data_ptr<int8_t>();
    body(PagedCache<Int8Elements>{keys, keys + kv_cache.stride(0), key_scales, value_scales,
                                  block_size, kv_heads, dim});
    return;
  }
  const auto* keys = static_cast<const uint8_t*>(kv_cache.data_ptr());
  body(PagedCache<Fp8Elements>{keys, keys + kv_cache.stride(0), key_scales, value_scales,
                               block_size, kv_heads, dim});
}

}  // namespace

// The checks both entry points share, on q [B, H, d] and a cache [2, blocks, block_size,
// kv_heads, d]; returns the tables and lengths as contiguous int64.
std::pair<at::Tensor, at::Tensor> check_decode_attention(const char* op, const at::Tensor& q,
                                                         const at::Tensor& cache,
                                                         const at::Tensor& block_tables,
                                                         const at::Tensor& seq_lens) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5 && cache.size(0) == 2, op,
              ": q must be [B, H, d], the cache [2, blocks, block_size, kv_heads, d]");
  TORCH_CHECK(q.scalar_type() == at::kFloat ||
                  (q.scalar_type() == at::kBFloat16 && cache.scalar_type() != at::kFloat),
              op, ": q must be float32, or bfloat16 with a bfloat16 or 8-bit cache");
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

at::Tensor check_key_mask(const char* op, const at::Tensor& key_mask, const at::Tensor& lens) {
  TORCH_CHECK(key_mask.scalar_type() == at::kBool && key_mask.dim() == 2 &&
                  key_mask.size(0) == lens.numel() && key_mask.size(1) >= 1,
              op, ": key_mask must be bool [B, width] with width >= 1");
  const at::Tensor mask = key_mask.contiguous();
  const int64_t width = mask.size(1);
  const bool* rows = mask.data_ptr<bool>();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < lens.numel(); ++b) {
    TORCH_CHECK(rows[b * width + width - 1], op, ": key_mask row ", b,
                " hides the query's own key");
  }
  return mask;
}

int64_t decode_attention_scratch_bytes(int64_t batch, int64_t heads, int64_t dim,
                                       int64_t block_size, int64_t max_blocks) {
  const int64_t partitions = max_partitions(max_blocks, block_size);
  return partitions == 1 ? 0 : batch * heads * partitions * (dim + 2) * sizeof(float);
}

void paged_decode_attention_team(const at::Tensor& q, const at::Tensor& kv_cache,
                                 const at::Tensor* scales, const at::Tensor& tables,
                                 const at::Tensor& lens, double scale, int64_t window,
                                 const at::Tensor& out, void* scratch,
                                 const at::Tensor* key_mask) {
  auto* partials = static_cast<float*>(scratch);
  const KeyMask mask = key_mask == nullptr
                           ? KeyMask{}
                           : KeyMask{key_mask->data_ptr<bool>(), key_mask->size(1)};
  with_cache(kv_cache, scales, [&](const auto& cache) {
    if (q.scalar_type() == at::kBFloat16)
      attend_batch<at::BFloat16>(cache, q, tables, lens, scale, window, mask, out, partials);
    else
      attend_batch<float>(cache, q, tables, lens, scale, window, mask, out, partials);
  });
}

namespace {

// paged_decode_attention_team over the whole batch in a parallel region of its own.
void run_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                          const at::Tensor* scales, const at::Tensor& tables,
                          const at::Tensor& lens, double scale, int64_t window,
                          const std::optional<at::Tensor>& key_mask, const at::Tensor& out) {
  const at::Tensor mask =
      key_mask.has_value() ? check_key_mask("paged_decode_attention", *key_mask, lens) : at::Tensor();
  const at::Tensor scratch = at::empty(
      {decode_attention_scratch_bytes(q.size(0), q.size(1), q.size(2), kv_cache.size(2),
                                      tables.size(1))},
      q.options().dtype(at::kByte));
  void* partials = scratch.data_ptr();
#pragma omp parallel
  paged_decode_attention_team(q, kv_cache, scales, tables, lens, scale, window, out, partials,
                              mask.defined() ? &mask : nullptr);
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  double scale, int64_t window,
                                  const std::optional<at::Tensor>& key_mask) {
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16,
              "paged_decode_attention: kv_cache must be float32 or bfloat16");
  const auto [tables, lens] =
      check_decode_attention("paged_decode_attention", q, kv_cache, block_tables, seq_lens);
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  run_decode_attention(qc, kv_cache, nullptr, tables, lens, scale, window, key_mask, out);
  return out;
}

// values: int8 or float8_e4m3fn [2, blocks, block_size, kv_heads, d]; scales: float32
// [2, blocks, block_size, kv_heads].
at::Tensor paged_decode_attention_quantized(const at::Tensor& q, const at::Tensor& values,
                                            const at::Tensor& scales,
                                            const at::Tensor& block_tables,
                                            const at::Tensor& seq_lens, double scale,
                                            int64_t window,
                                            const std::optional<at::Tensor>& key_mask) {
  constexpr const char* kOp = "paged_decode_attention_quantized";
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.sizes() == values.sizes().slice(0, 4),
              kOp, ": scales must be a contiguous float32 [2, blocks, block_size, kv_heads]");
  TORCH_CHECK(values.scalar_type() == at::kChar || values.scalar_type() == at::kFloat8_e4m3fn,
              kOp, ": values must be int8 or float8_e4m3fn");
  const auto [tables, lens] = check_decode_attention(kOp, q, values, block_tables, seq_lens);
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  run_decode_attention(qc, values, &scales, tables, lens, scale, window, key_mask, out);
  return out;
}

}  // namespace tokenmill
