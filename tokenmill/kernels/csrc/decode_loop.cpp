// A decode step with the decoder-layer loop in C++ (Llama family and Gemma 3).
//
// At batch 1, calling a decode step's kernels from Python (module dispatch, argument checks,
// views: about 12 calls a layer, 30 layers) added a large share to the kernels' own time. This
// loop makes the same kernel calls in the same order as the Python layers, so
// its hidden states are bit-identical to theirs, without returning to Python between them. The
// role is the one CUDA graphs play for GPU decode in vLLM: take the host out of the hot loop.
//
// It also keeps the host out from between the kernels. A step's arguments are checked and its
// buffers allocated once, then one OpenMP parallel region runs every kernel of every layer
// through their team functions (team.h), each ending in a barrier. Calling the kernels' own
// entry points instead opened and closed ~10 regions a layer, and between them the second
// thread waited while the first allocated outputs and checked arguments: in a profile of a
// GGUF step at batch 1 it spent a large part of the step waiting.

#include "decode_loop.h"

#include <ATen/ATen.h>

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <tuple>
#include <utility>

#include "kquant.h"
#include "quant.h"
#include "team.h"

namespace tokenmill {

LinearKernel LinearKernel::float32(at::Tensor weight, std::optional<at::Tensor> bias,
                                   std::optional<at::Tensor> packed) {
  const int64_t n = weight.size(0);
  return {Kind::kFloat32, std::move(weight), {}, {}, 0, std::move(bias),
          packed.value_or(at::Tensor()), n};
}

LinearKernel LinearKernel::int8(at::Tensor values, at::Tensor scales, int64_t n,
                                int64_t group_size, std::optional<at::Tensor> bias) {
  return {Kind::kInt8, std::move(values), std::move(scales), {}, group_size, std::move(bias),
          {},          n};
}

LinearKernel LinearKernel::w8a8(at::Tensor values, at::Tensor scales, int64_t n,
                                int64_t group_size, std::optional<at::Tensor> bias) {
  LinearKernel kernel = int8(std::move(values), std::move(scales), n, group_size, std::move(bias));
  kernel.kind = Kind::kW8a8;
  return kernel;
}

LinearKernel LinearKernel::int4(at::Tensor values, at::Tensor scales, at::Tensor mins,
                                int64_t n, int64_t group_size, std::optional<at::Tensor> bias) {
  return {Kind::kInt4, std::move(values), std::move(scales), std::move(mins), group_size,
          std::move(bias), {}, n};
}

LinearKernel LinearKernel::fp8(at::Tensor qweight, at::Tensor scales,
                               std::optional<at::Tensor> bias) {
  const int64_t n = qweight.size(0);
  return {Kind::kFp8, std::move(qweight), std::move(scales), {}, 0, std::move(bias), {}, n};
}

LinearKernel LinearKernel::bfloat16(at::Tensor packed, int64_t n,
                                    std::optional<at::Tensor> bias) {
  if (bias.has_value()) bias = bias->to(at::kFloat).contiguous();
  return {Kind::kBfloat16, std::move(packed), {}, {}, 0, std::move(bias), {}, n};
}

LinearKernel LinearKernel::nf4(at::Tensor codes, at::Tensor qabsmax, at::Tensor second,
                               int64_t group_size, std::optional<at::Tensor> bias) {
  const int64_t n = codes.size(0);
  return {Kind::kNf4,     std::move(codes), std::move(qabsmax), std::move(second), group_size,
          std::move(bias), {},              n};
}

LinearKernel LinearKernel::q5_0(at::Tensor values, at::Tensor scales, int64_t n,
                                int64_t group_size, std::optional<at::Tensor> bias) {
  TORCH_CHECK(group_size == kQuantBlock, "LinearKernel.q5_0: Q5_0 blocks are groups of 32");
  return {Kind::kQ50, std::move(values), std::move(scales), {}, group_size, std::move(bias),
          {},         n};
}

LinearKernel LinearKernel::q6_k(at::Tensor values, at::Tensor sub_scales,
                               at::Tensor super_scales, std::optional<at::Tensor> mins,
                               int64_t n, std::optional<at::Tensor> bias) {
  return {Kind::kQ6K,      std::move(values), std::move(sub_scales), mins.value_or(at::Tensor()),
          0,               std::move(bias),   {},                    n,
          std::move(super_scales)};
}

void LinearKernel::check(const std::string& name, int64_t k, int64_t n) const {
  const char* op = name.c_str();
  TORCH_CHECK(out_features == n, op, ": has ", out_features, " outputs, the model needs ", n);
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                op, ": bias must be a contiguous float32 [", n, "]");
  switch (kind) {
    case Kind::kFloat32:
      if (packed.defined()) return check_packed_linear_weight(op, packed, n, k);
      TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat &&
                      weight.is_contiguous() && weight.size(1) == k,
                  op, ": weight must be a contiguous float32 [", n, ", ", k, "]");
      return;
    case Kind::kInt8:
    case Kind::kW8a8:
      return check_int8_panels(op, weight, scales, n, k, group_size);
    case Kind::kInt4:
      return check_int4_panels(op, weight, scales, mins, n, k, group_size);
    case Kind::kFp8:
      check_fp8_weight(op, weight, scales);
      TORCH_CHECK(weight.size(1) == k, op, ": weight must have ", k, " inputs");
      return;
    case Kind::kBfloat16:
      return check_bfloat16_linear_weight(op, weight, n, k);
    case Kind::kNf4:
      return check_nf4_weight(op, weight, scales, mins, n, k, group_size);
    case Kind::kQ6K:
      return check_q6_k_panels(op, weight, scales, super_scales, mins, n, k);
    case Kind::kQ50:
      return check_q5_0_panels(op, weight, scales, n, k);
  }
}

int64_t LinearKernel::scratch_bytes(int64_t m, int64_t k) const {
  switch (kind) {
    case Kind::kFloat32:
      return packed.defined() ? packed_linear_scratch_bytes(m, k) : 0;
    case Kind::kInt8:
    case Kind::kW8a8:
      return int8_linear_scratch_bytes(m, k);
    case Kind::kInt4:
      return int4_linear_scratch_bytes(m, k);
    case Kind::kFp8:
    case Kind::kNf4:
      return 0;
    case Kind::kBfloat16:
      return bfloat16_linear_scratch_bytes(m, k);
    case Kind::kQ6K:
      return q6_k_linear_scratch_bytes(m, k);
    case Kind::kQ50:
      return q5_0_linear_scratch_bytes(m, k);
  }
  return 0;
}

void LinearKernel::run(const at::Tensor& x, const at::Tensor& y, void* scratch) const {
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  switch (kind) {
    case Kind::kFloat32:
      if (packed.defined()) return packed_linear_team(x, packed, b, y, scratch);
      return skinny_linear_team(x, weight, b, y);
    case Kind::kInt8:
    case Kind::kW8a8:
      return int8_linear_team(x, weight, scales, group_size, b, y, scratch);
    case Kind::kInt4:
      return int4_linear_team(x, weight, scales, mins, group_size, b, y, scratch);
    case Kind::kFp8:
      return fp8_linear_team(x, weight, scales, b, y);
    case Kind::kBfloat16:
      return bfloat16_linear_team(x, weight, b, y, scratch);
    case Kind::kNf4:
      return nf4_linear_team(x, weight, scales, mins, group_size, b, y);
    case Kind::kQ6K:
      return q6_k_linear_team(x, weight, scales, super_scales, mins, b, y, scratch);
    case Kind::kQ50:
      return q5_0_linear_team(x, weight, scales, b, y, scratch);
  }
}

namespace {

// Throws unless `norm` is a contiguous vector of n weights of the model's dtype (or undefined,
// when optional).
void check_norm(const at::Tensor& norm, int64_t n, at::ScalarType dtype, const std::string& name,
                bool optional) {
  if (optional && !norm.defined()) return;
  TORCH_CHECK(norm.defined() && norm.scalar_type() == dtype && norm.is_contiguous() &&
                  norm.numel() == n,
              "DecodeLoop: ", name, " must be a contiguous ", c10::toString(dtype),
              " vector of ", n);
}

// Throws unless every cache has the first one's shape and dtype, one per layer, with scales of
// the matching shape when quantized (kv_scales not empty) and values of the model's dtype
// otherwise.
void check_caches(const std::vector<at::Tensor>& kv_caches,
                  const std::vector<at::Tensor>& kv_scales, int64_t num_layers,
                  at::ScalarType model_dtype) {
  TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == num_layers,
              "DecodeLoop: one KV cache per layer");
  const bool quantized = !kv_scales.empty();
  TORCH_CHECK(!quantized || static_cast<int64_t>(kv_scales.size()) == num_layers,
              "DecodeLoop: kv_scales must be empty or one per layer");
  const at::Tensor& first = kv_caches.front();
  const auto dtype = first.scalar_type();
  TORCH_CHECK(quantized ? dtype == at::kChar || dtype == at::kFloat8_e4m3fn
                        : dtype == model_dtype,
              "DecodeLoop: KV caches must have the model's dtype, or be int8 / float8_e4m3fn "
              "with kv_scales");
  for (int64_t i = 0; i < num_layers; ++i) {
    TORCH_CHECK(kv_caches[i].sizes() == first.sizes() && kv_caches[i].scalar_type() == dtype &&
                    kv_caches[i].is_contiguous(),
                "DecodeLoop: every layer's KV cache must be contiguous, shaped and typed alike");
    if (quantized)
      TORCH_CHECK(kv_scales[i].scalar_type() == at::kFloat && kv_scales[i].is_contiguous() &&
                      kv_scales[i].sizes() == first.sizes().slice(0, 4),
                  "DecodeLoop: kv_scales must be contiguous float32 [2, blocks, block_size, "
                  "kv_heads]");
  }
}

// Sums the time since the previous lap into the lap's entry of `ns`; without `ns` (a profile
// off, or not the first thread) a lap is one branch.
class OpClock {
 public:
  explicit OpClock(int64_t* ns) : ns_(ns), last_(ns == nullptr ? 0 : now()) {}
  void lap(LoopOp op) {
    if (ns_ == nullptr) return;
    const int64_t t = now();
    ns_[static_cast<int>(op)] += t - last_;
    last_ = t;
  }

 private:
  static int64_t now() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  int64_t* ns_;
  int64_t last_;
};

}  // namespace

DecodeLoop::DecodeLoop(std::vector<DecoderLayerWeights> layers, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                       GatedActivation activation)
    : layers_(std::move(layers)),
      num_heads_(num_heads),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      eps_(eps),
      scale_(scale),
      activation_(activation) {
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0,
              "DecodeLoop: num_heads must be a positive multiple of num_kv_heads");
  TORCH_CHECK(!layers_.empty(), "DecodeLoop: no layers");
  hidden_size_ = layers_.front().input_norm.numel();
  dtype_ = layers_.front().input_norm.scalar_type();
  TORCH_CHECK(dtype_ == at::kFloat || dtype_ == at::kBFloat16,
              "DecodeLoop: the norms must be float32 or bfloat16");
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const int64_t gated = layers_.front().gate_up.out_features;
  TORCH_CHECK(gated % 2 == 0, "DecodeLoop: gate_up must have an even number of outputs");
  max_positions_ = layers_.front().cos.size(0);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DecoderLayerWeights& layer = layers_[i];
    const std::string name = "DecodeLoop layer " + std::to_string(i) + " ";
    check_norm(layer.input_norm, hidden_size_, dtype_, name + "input_norm", false);
    check_norm(layer.mlp_norm, hidden_size_, dtype_, name + "mlp_norm", false);
    check_norm(layer.q_norm, head_dim, dtype_, name + "q_norm", !layer.k_norm.defined());
    check_norm(layer.k_norm, head_dim, dtype_, name + "k_norm", !layer.q_norm.defined());
    check_norm(layer.attention_out_norm, hidden_size_, dtype_, name + "attention_out_norm", true);
    check_norm(layer.mlp_out_norm, hidden_size_, dtype_, name + "mlp_out_norm", true);
    for (const LinearKernel* linear : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down})
      TORCH_CHECK((linear->kind == LinearKernel::Kind::kBfloat16) == (dtype_ == at::kBFloat16),
                  name, "linears must be bfloat16 ones in a bfloat16 model, and only there");
    layer.qkv.check(name + "qkv", hidden_size_, q_size + 2 * kv_size);
    layer.o.check(name + "o", q_size, hidden_size_);
    layer.gate_up.check(name + "gate_up", hidden_size_, gated);
    layer.down.check(name + "down", gated / 2, hidden_size_);
    TORCH_CHECK(layer.cos.scalar_type() == at::kFloat && layer.cos.is_contiguous() &&
                    layer.cos.dim() == 2 && layer.cos.size(1) == head_dim / 2 &&
                    layer.sin.sizes() == layer.cos.sizes() &&
                    layer.sin.scalar_type() == at::kFloat && layer.sin.is_contiguous(),
                name, "cos and sin must be contiguous float32 [max_positions, head_dim / 2]");
    max_positions_ = std::min(max_positions_, layer.cos.size(0));
  }
}

std::tuple<at::Tensor, at::Tensor> DecodeLoop::run(
    const at::Tensor& hidden, const at::Tensor& positions, const std::vector<at::Tensor>& kv_caches,
    const std::vector<at::Tensor>& kv_scales, const std::vector<at::Tensor>& slot_mappings,
    const std::vector<at::Tensor>& block_tables, const at::Tensor& seq_lens,
    const std::optional<at::Tensor>& key_mask, const std::optional<at::Tensor>& op_ns) const {
  const auto num_layers = static_cast<int64_t>(layers_.size());
  check_caches(kv_caches, kv_scales, num_layers, dtype_);
  const bool quantized = !kv_scales.empty();
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) > 0 && hidden.size(1) == hidden_size_ &&
                  hidden.scalar_type() == dtype_,
              "DecodeLoop: hidden must be ", c10::toString(dtype_), " [T, ", hidden_size_,
              "] with T > 0");
  const int64_t tokens = hidden.size(0);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == tokens,
              "DecodeLoop: positions must be int64 with one entry per token");
  TORCH_CHECK(static_cast<int64_t>(slot_mappings.size()) == num_layers &&
                  static_cast<int64_t>(block_tables.size()) == num_layers,
              "DecodeLoop: one slot_mapping and one block_tables per layer (layers of a KV-cache "
              "group share them)");
  const at::Tensor pos = positions.contiguous();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t p = pos.data_ptr<int64_t>()[t];
    TORCH_CHECK(p >= 0 && p < max_positions_, "DecodeLoop: position ", p,
                " is outside the rotary tables of ", max_positions_, " rows");
  }
  // Each layer's slots and tables, checked once per distinct tensor.
  const int64_t num_slots = kv_caches.front().size(1) * kv_caches.front().size(2);
  std::vector<at::Tensor> slots(num_layers);
  for (int64_t i = 0; i < num_layers; ++i) {
    if (i > 0 && slot_mappings[i].is_same(slot_mappings[i - 1])) {
      slots[i] = slots[i - 1];
      continue;
    }
    TORCH_CHECK(slot_mappings[i].scalar_type() == at::kLong && slot_mappings[i].numel() == tokens,
                "DecodeLoop: slot_mapping must be int64 with one entry per token");
    slots[i] = slot_mappings[i].contiguous();
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t s = slots[i].data_ptr<int64_t>()[t];
      TORCH_CHECK(s >= 0 && s < num_slots, "DecodeLoop: slot ", s, " is outside the cache's ",
                  num_slots, " slots");
    }
  }

  // The step's buffers, each reused by every layer.
  const at::TensorOptions options = hidden.options();  // the model's dtype: float32 or bfloat16
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  const int64_t gated = layers_.front().gate_up.out_features, inner = gated / 2;
  // The residual stream starts as the first layer's input and is updated in place.
  const at::Tensor residual = hidden.contiguous();
  const at::Tensor normed = at::empty({tokens, hidden_size_}, options);
  const at::Tensor qkv = at::empty({tokens, q_size + 2 * kv_size}, options);
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads_, head_dim_});
  const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
  const at::Tensor v =
      qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
  const at::Tensor attended = at::empty({tokens, q_size}, options);
  const at::Tensor projected = at::empty({tokens, hidden_size_}, options);
  const at::Tensor gate_up = at::empty({tokens, gated}, options);
  const at::Tensor activated = at::empty({tokens, inner}, options);
  const at::Tensor down = at::empty({tokens, hidden_size_}, options);
  // Gemma's per-head q / k norms and output norms write here.
  const bool gemma = std::any_of(layers_.begin(), layers_.end(), [](const auto& layer) {
    return layer.q_norm.defined() || layer.attention_out_norm.defined() ||
           layer.mlp_out_norm.defined();
  });
  const at::Tensor q_normed =
      gemma ? at::empty({tokens, num_heads_, head_dim_}, options) : q;
  const at::Tensor k_normed =
      gemma ? at::empty({tokens, num_kv_heads_, head_dim_}, options) : k;
  const at::Tensor post_normed = gemma ? at::empty({tokens, hidden_size_}, options) : down;
  std::vector<at::Tensor> tables(num_layers);
  at::Tensor lens;
  int64_t max_blocks = 0;
  for (int64_t i = 0; i < num_layers; ++i) {
    if (i > 0 && block_tables[i].is_same(block_tables[i - 1])) {
      tables[i] = tables[i - 1];
      continue;
    }
    std::tie(tables[i], lens) =
        check_decode_attention("DecodeLoop", q, kv_caches.front(), block_tables[i], seq_lens);
    max_blocks = std::max(max_blocks, tables[i].size(1));
  }
  const at::Tensor mask =
      key_mask.has_value() ? check_key_mask("DecodeLoop", *key_mask, lens) : at::Tensor();
  // One buffer serves each kernel in turn: each ends in the region's barrier before the next.
  int64_t scratch_bytes = decode_attention_scratch_bytes(tokens, num_heads_, head_dim_,
                                                         kv_caches.front().size(2), max_blocks);
  for (const DecoderLayerWeights& layer : layers_)
    scratch_bytes = std::max({scratch_bytes, layer.qkv.scratch_bytes(tokens, hidden_size_),
                              layer.o.scratch_bytes(tokens, q_size),
                              layer.gate_up.scratch_bytes(tokens, hidden_size_),
                              layer.down.scratch_bytes(tokens, inner)});
  const at::Tensor scratch_buffer = at::empty({scratch_bytes}, options.dtype(at::kByte));
  void* scratch = scratch_buffer.data_ptr();
  void* residual_ptr = residual.data_ptr();
  const float eps = static_cast<float>(eps_);
  int64_t* op_ns_ptr = nullptr;
  if (op_ns.has_value()) {
    TORCH_CHECK(op_ns->scalar_type() == at::kLong && op_ns->is_contiguous() &&
                    op_ns->numel() == static_cast<int64_t>(LoopOp::kCount),
                "DecodeLoop: op_ns must be a contiguous int64 [", static_cast<int>(LoopOp::kCount),
                "]");
    op_ns_ptr = op_ns->data_ptr<int64_t>();
  }

#pragma omp parallel
  {
    OpClock clock(omp_get_thread_num() == 0 ? op_ns_ptr : nullptr);
    const at::Tensor* x = &residual;  // each layer's input, before it joins the residual stream
    for (int64_t i = 0; i < num_layers; ++i) {
      const DecoderLayerWeights& layer = layers_[i];
      const at::Tensor* layer_scales = quantized ? &kv_scales[i] : nullptr;
      // The previous layer's output joins the residual stream inside the norm.
      add_rms_norm_team(*x, i == 0 ? nullptr : residual_ptr, layer.input_norm, eps, normed);
      clock.lap(LoopOp::kNorm);
      layer.qkv.run(normed, qkv, scratch);
      clock.lap(LoopOp::kQkv);
      if (layer.q_norm.defined()) {
        add_rms_norm_team(q, nullptr, layer.q_norm, eps, q_normed);
        add_rms_norm_team(k, nullptr, layer.k_norm, eps, k_normed);
        clock.lap(LoopOp::kNorm);
      }
      const at::Tensor& layer_q = layer.q_norm.defined() ? q_normed : q;
      const at::Tensor& layer_k = layer.q_norm.defined() ? k_normed : k;
      rotary_embedding_team(pos, layer_q, layer_k, layer.cos, layer.sin);
      clock.lap(LoopOp::kRotary);
      store_kv_team(kv_caches[i], layer_scales, slots[i], layer_k, v);
      clock.lap(LoopOp::kStoreKv);
      paged_decode_attention_team(layer_q, kv_caches[i], layer_scales, tables[i], lens, scale_,
                                  layer.window, attended, scratch,
                                  mask.defined() ? &mask : nullptr);
      clock.lap(LoopOp::kAttention);
      layer.o.run(attended, projected, scratch);
      clock.lap(LoopOp::kO);
      const at::Tensor* attention_out = &projected;
      if (layer.attention_out_norm.defined()) {
        add_rms_norm_team(projected, nullptr, layer.attention_out_norm, eps, post_normed);
        attention_out = &post_normed;
      }
      add_rms_norm_team(*attention_out, residual_ptr, layer.mlp_norm, eps, normed);
      clock.lap(LoopOp::kNorm);
      layer.gate_up.run(normed, gate_up, scratch);
      clock.lap(LoopOp::kGateUp);
      gated_activation_team(activation_, gate_up, activated);
      clock.lap(LoopOp::kActivation);
      layer.down.run(activated, down, scratch);
      clock.lap(LoopOp::kDown);
      x = &down;
      if (layer.mlp_out_norm.defined()) {
        add_rms_norm_team(down, nullptr, layer.mlp_out_norm, eps, post_normed);
        x = &post_normed;
        clock.lap(LoopOp::kNorm);
      }
    }
  }
  const at::Tensor& out = layers_.back().mlp_out_norm.defined() ? post_normed : down;
  return {out, residual};
}

}  // namespace tokenmill
