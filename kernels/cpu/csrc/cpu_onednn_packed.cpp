// oneDNN's bf16 product on a weight kept in oneDNN's own layout.
//
// From kBf16BlasRows rows on, a bf16 linear of the few-row kernels runs oneDNN's bf16 product (AMX
// where the CPU has it). Given a plain [N, K] weight, oneDNN first re-lays it out for its kernel
// (VNNI blocks) on every call, which at decode sizes costs about as much as the product itself
// (1024 x 1024 weight, 16 rows, one core: 0.19 ms plain against 0.10 ms packed). Here each such
// weight is packed once, on its first use, by PyTorch's own mkldnn ops (`_reorder_linear_weight`,
// `_linear_pointwise`: what torch.compile's CPU freezing pass uses), and the packed copy is kept
// beside it. The product is the same oneDNN call on the same values: the results are bit for bit
// at::linear's (tested).
//
// The packed copies are found by the weight's data pointer and kept while the weight lives (a weak
// reference to its tensor; the shape and version are checked too); copies of weights that died are
// dropped when their address is seen again or when the table fills. The memory cost is one more
// copy of each dense bf16 matrix a decode step multiplies with 6 to 16 rows (never routed experts:
// the MoE kernels call BLAS themselves). Without PyTorch's mkldnn ops, or on a CPU without oneDNN's
// native bf16 product (onednn_bf16_native: there oneDNN refuses to lay bf16 weights out, "bf16 path
// needs the cpu support ..."), everything stays at::linear.

#include "cpu_few_rows.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace {

constexpr int64_t kPackRows = 16;  // the row count oneDNN lays the weight out for (the decode maximum)
constexpr size_t kMaxPacked = 4096;  // weights with a packed copy, at most

struct Packed {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> owner;
  std::array<int64_t, 2> sizes;
  int64_t version;  // -1: an inference tensor (no version counter)
  torch::Tensor packed;
};

std::mutex packed_mutex;
std::unordered_map<const void*, Packed> packed_weights;

const std::optional<c10::OperatorHandle>& op(int which) {
  static const std::optional<c10::OperatorHandle> reorder =
      c10::Dispatcher::singleton().findSchema({"mkldnn::_reorder_linear_weight", ""});
  static const std::optional<c10::OperatorHandle> pointwise =
      c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  return which == 0 ? reorder : pointwise;
}

int64_t version_of(const torch::Tensor& w) {
  return w.is_inference() ? -1 : static_cast<int64_t>(w._version());
}

bool same(const Packed& p, const torch::Tensor& w) {
  return p.sizes[0] == w.size(0) && p.sizes[1] == w.size(1) && p.version == version_of(w);
}

torch::Tensor pack(const torch::Tensor& w) {
  torch::jit::Stack stack{w, c10::IValue(kPackRows)};
  op(0)->callBoxed(&stack);
  return stack[0].toTensor();
}

// The packed copy of w, made on first use; undefined when PyTorch has no mkldnn ops, this CPU has
// no native bf16 product, or the table is full.
torch::Tensor packed_for(const torch::Tensor& w) {
  if (!op(0) || !op(1) || !onednn_bf16_native()) return {};
  std::lock_guard<std::mutex> lock(packed_mutex);
  const void* key = w.data_ptr();
  auto it = packed_weights.find(key);
  if (it != packed_weights.end()) {
    if (it->second.owner.lock() && same(it->second, w)) return it->second.packed;
    packed_weights.erase(it);  // its weight died (the address was reused) or changed
  }
  if (packed_weights.size() >= kMaxPacked) {
    for (auto i = packed_weights.begin(); i != packed_weights.end();)
      i = i->second.owner.expired() ? packed_weights.erase(i) : std::next(i);
    if (packed_weights.size() >= kMaxPacked) return {};
  }
  Packed p{c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(w.getIntrusivePtr()),
           {w.size(0), w.size(1)}, version_of(w), pack(w)};
  return packed_weights.emplace(key, std::move(p)).first->second.packed;
}

}  // namespace

torch::Tensor onednn_linear_bf16(const torch::Tensor& x, const torch::Tensor& w) {
  const auto packed = packed_for(w);
  if (!packed.defined()) return at::linear(x, w);
  torch::jit::Stack stack{x, packed, c10::IValue(), c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue()};
  op(1)->callBoxed(&stack);
  return stack[0].toTensor();
}

bool onednn_bf16_native() {
  // PyTorch's own answer (mkldnn::_is_mkldnn_bf16_supported: AVX-512 BW/VL/DQ, AVX-NE-CONVERT or
  // AMX), asked once; a PyTorch without it, or without oneDNN, counts as no.
  static const bool native = [] {
    const auto ask = c10::Dispatcher::singleton().findSchema({"mkldnn::_is_mkldnn_bf16_supported", ""});
    if (!ask) return false;
    try {
      torch::jit::Stack stack;
      ask->callBoxed(&stack);
      return stack[0].toBool();
    } catch (const c10::Error&) {
      return false;
    }
  }();
  return native;
}

int64_t onednn_packed_count() {
  std::lock_guard<std::mutex> lock(packed_mutex);
  return static_cast<int64_t>(packed_weights.size());
}
