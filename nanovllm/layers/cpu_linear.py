"""bf16 projections on the CPU through oneDNN, with each weight packed once at start-up.

`F.linear` on bf16 CPU tensors goes to oneDNN, which reorders the weight into its blocked layout on
every call; at decode sizes that reorder costs as much as the product itself (SmolLM2-135M's gate_up
at one row: 117 us plain, 61 us packed; its LM head 2.4 ms against 1.4). Packing once
(`_reorder_linear_weight`) and calling the same oneDNN product (`_linear_pointwise`) gives the same
bits as `F.linear` (tests/layers/test_cpu_linear.py; start-up checks it on the machine at hand, and keeps the
plain path where it does not hold), so this is a pure saving. fp32 stays on
`F.linear`: oneDNN's packed fp32 product is not bit-identical to it (~1e-5), and fp32 is the dtype
our outputs are checked against transformers in.
"""
import torch
import torch.nn.functional as F
from torch import nn


def packing_available(dtype: torch.dtype) -> bool:
    """Whether bf16 weights can be packed here (a CPU build with oneDNN and bf16 support)."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    try:
        return (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")
                and bool(ops._is_mkldnn_bf16_supported()))
    except (AttributeError, RuntimeError):
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weight -> oneDNN's opaque packed tensor for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T (+ bias), as `F.linear(x, W, bias)` computes it."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packing_agrees(weight: torch.Tensor) -> bool:
    """Whether this machine's packed product gives F.linear's bits (checked once, on a real weight):
    a oneDNN build that packs but computes differently, or fails, keeps the plain path."""
    try:
        x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        return torch.equal(packed_linear(x, pack_weight(weight), None), F.linear(x, weight))
    except RuntimeError:
        return False


def pack_linear_weights(model: nn.Module) -> int:
    """Give every module with a `packed_weight` slot (the linear layers and the LM head) its packed
    weight, and free the plain one unless another module shares it (a tied LM head keeps the
    embedding's). Returns how many were packed; none where packing is not available."""
    modules = [m for m in model.modules() if hasattr(m, "packed_weight") and isinstance(m.weight, torch.Tensor)]
    if not modules or not all(m.weight.device.type == "cpu" and packing_available(m.weight.dtype) for m in modules):
        return 0
    if not _packing_agrees(modules[0].weight):
        return 0
    users: dict[int, int] = {}
    for m in model.modules():
        weight = getattr(m, "weight", None)
        if isinstance(weight, torch.Tensor):
            users[id(weight)] = users.get(id(weight), 0) + 1
    for m in modules:
        m.packed_weight = pack_weight(m.weight)
        if users[id(m.weight)] == 1:
            # The plain copy is never read again: the packed one replaces it (no double memory).
            m.weight.data = torch.empty(0, dtype=m.weight.dtype)
    return len(modules)
