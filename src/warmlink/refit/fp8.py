"""FP8 weights as vLLM's FP8 linear and MoE layers hold them, quantized on send.

A trainer in BF16 that feeds an FP8 engine publishes each quantized weight as FP8 values and their
float32 scales (``Publisher.add(..., fp8=Fp8(...))``); the engine's ranks take both
(``families.layouts(..., fp8=scheme)``) and install them in one version. One byte per weight
element crosses the link instead of two, so a sync bounded by the link halves (docs/scale.md).

# Note [FP8 formats]
Three schemes, each with vLLM's parameter names, shapes and dtypes (vLLM 0.32), the scales of a
weight ``W`` being ``W_scale_inv`` or ``W_scale`` (``refit._fp8_layout``):

* ``"block"``: 128 x 128 blocks, ``weight_scale_inv`` float32 ``[ceil(N/128), ceil(K/128)]``
  (``[E, ...]`` for stacked experts, ``w13_weight_scale_inv`` / ``w2_weight_scale_inv``). vLLM's
  ``Fp8LinearMethod`` / ``Fp8MoEMethod`` with ``weight_block_size: [128, 128]`` (DeepSeek-V3,
  Kimi-K2 and Qwen3 FP8 checkpoints; ``create_fp8_scale_parameter(BlockQuantScaleParameter)``) and
  its online ``fp8_per_block``.
* ``"channel"``: one scale per output row, ``weight_scale`` float32 ``[N, 1]``
  (``ChannelQuantScaleParameter``): compressed-tensors' channel strategy and vLLM's online PTPC.
* ``"tensor"``: one scale per logical weight, ``weight_scale`` float32 ``[num_partitions]`` of a
  fused module (``PerTensorScaleParameter``: one per q/k/v or gate/up), as per-tensor FP8
  checkpoints hold it and ``Fp8LinearMethod`` loads it (it then requantizes a fused module to
  the max of its partitions' scales and transposes ``weight``: that happens in the engine).

Values are float8_e4m3fn ``[N, K]`` in every scheme: the checkpoint layout that vLLM's loaders
take, and, for blocks, what its CUDA block kernels keep. Kernels that repack weights after loading
(vLLM CPU's AMX packing, per-tensor ``weight.t()``) take FP8 through ``load_weights``.

# Note [FP8 formulas]
The arithmetic is vLLM's, op for op, so the bytes are its bytes (``refit._fp8_math``):

* block (``vllm.utils.deep_gemm.per_block_cast_to_fp8``): per block ``amax = max|x|`` in
  float32, at least 1e-4; ``scale = amax / 448`` (a Python float: CUDA multiplies by its float32
  reciprocal, the CPU divides); values ``x * (1 / scale)`` cast to e4m3 (round to nearest even).
* channel (``Fp8PtpcOnlineLinearMethod``): per row ``scale = max(amax / 448, 1 / (448 * 512))``
  dividing by a float32 tensor; values ``x / scale`` clamped to +-448, cast.
* tensor (``Fp8PerTensorOnlineLinearMethod``): ``scale = amax / 448`` over the whole logical weight;
  values as the static ``scaled_fp8_quant`` kernel makes them: ``x * (1.0f / scale)`` in float32,
  clamped to +-448, cast.

vLLM's block formula rounds its scale differently on CPU and CUDA (one float32 ulp at most), so
"bit-exact" means: equal to vLLM's formula run on the same device.

# Note [Where FP8 is quantized]
On the trainer's side, at every publish, into the staging memory receivers read: the link then
carries one byte per element, and the trainer's GPU, which holds the weights anyway, does the
work once for every engine that reads the version (a receiver-side quantizer would move BF16 and
repeat the work on every engine rank). The catch is that a scale depends on every element of its
cell. A trainer rank computes its cells alone when its shard holds them whole
(``_fp8_layout.holds_cells``): blocks when TP cuts at multiples of 128 (vLLM refuses the other
cuts for its own shards), rows when the shard holds whole rows (column-parallel), a tensor when
the rank holds all of it. Where a cut splits cells (row-parallel ``channel``, any sharded
``tensor``, FSDP's uneven chunks in ``block``), the ranks must agree on the amax: ``Fp8(group=...)``
names the trainer's process group over which every cell's amax is max-reduced (one
``all_reduce`` of all cells per publish, making ``publish`` collective over that group), after
which every rank holding part of a cell derives the same scale, publishes it, and quantizes its
elements with it: exactly its part of the whole tensor's quantization. Without a group such a
layout is refused when declared, naming the tensor and the cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from warmlink.errors import ConfigError
from warmlink.refit._fp8_layout import (
    BLOCK,
    FP8_MAX,
    SCHEMES,
    check_scheme,
    holds_cells,
    scale_global_shape,
    scale_layout,
    scale_name,
    values_layout,
)

__all__ = ["Fp8", "SCHEMES", "BLOCK", "FP8_MAX", "scale_name", "scale_global_shape", "scale_layout",
           "values_layout", "holds_cells", "quantize", "block_fp8", "dequantize", "dequantize_block_fp8"]


@dataclass(frozen=True)
class Fp8:
    """How a publisher quantizes the weights it sends (Note [FP8 formats]).

    Args:
        scheme: ``"block"`` (128 x 128, ``weight_scale_inv``), ``"channel"`` or ``"tensor"``
            (``weight_scale``).
        logical: for ``Publisher.add_module``, the logical tensors to quantize (e.g.
            ``families.fp8_weights(config)``: what vLLM's FP8 layers hold); ``Publisher.add``
            quantizes the tensor it is given and ignores this.
        group: a ``torch.distributed`` process group of the trainer ranks whose shards split scale
            cells (its tensor-parallel group), over which amaxes are max-reduced at every publish
            (Note [Where FP8 is quantized]); its backend must reach the publisher's device (NCCL
            for CUDA tensors, gloo for CPU ones). None: every rank must hold its cells whole.

    Raises:
        ConfigError: an unknown scheme, or ``logical`` not a collection of names.
    """

    scheme: str = "block"
    logical: frozenset[str] | None = None
    group: Any = None

    def __post_init__(self) -> None:
        check_scheme(self.scheme, "Fp8")
        if self.logical is not None:
            if isinstance(self.logical, str) or not all(isinstance(n, str) for n in self.logical):
                raise ConfigError(f"Fp8: logical={self.logical!r}; expected a collection of logical tensor names")
            object.__setattr__(self, "logical", frozenset(self.logical))


def quantize(weight, scheme: str = "block"):
    """``(values, scales)`` of a whole ``weight`` ``[..., N, K]`` (BF16, FP16 or float32) in
    ``scheme``: float8_e4m3fn values of its shape and float32 scales of
    ``scale_global_shape(weight.shape, scheme)``, on ``weight``'s device (Note [FP8 formulas]).

    Raises:
        ConfigError: not a floating-point tensor of 2 or more dims (3-D and more: block and channel
            only), or an unknown scheme.
    """
    import torch

    from warmlink.refit import _fp8_math

    check_scheme(scheme, "fp8.quantize")
    if not isinstance(weight, torch.Tensor) or weight.dim() < 2 or (scheme == "tensor" and weight.dim() != 2):
        raise ConfigError(f"fp8.quantize: weight must be a tensor of {'2' if scheme == 'tensor' else '2 or more'} dims for "
                          f"scheme={scheme!r}; got {type(weight).__name__} {tuple(getattr(weight, 'shape', ()))}")
    if not weight.is_floating_point() or weight.element_size() < 2:
        raise ConfigError(f"fp8.quantize: weight.dtype={weight.dtype}; expected a BF16, FP16 or float32 weight")
    scales = _fp8_math.scales_(_fp8_math.amax(weight, scheme), scheme)
    values = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
    _fp8_math.quantize(weight, scales, scheme, values)
    return values, scales


def block_fp8(weight, block: tuple[int, int] = BLOCK):
    """``(values, weight_scale_inv)`` of ``weight`` ``[..., N, K]`` in 128 x 128 blocks: ``quantize``
    with ``scheme="block"``.

    Raises:
        ConfigError: as ``quantize``, or a block other than ``(128, 128)``.
    """
    if tuple(block) != BLOCK:
        raise ConfigError(f"block_fp8: block={block!r}; expected {BLOCK} (vLLM's block FP8 formats use 128 x 128)")
    return quantize(weight, "block")


def dequantize(values, scales, scheme: str = "block", dtype=None):
    """The weight an engine computes with: each element of ``values`` times its cell's scale
    (float32 unless ``dtype`` says otherwise)."""
    import torch

    from warmlink.refit import _fp8_math

    return _fp8_math.dequantize(values, scales, check_scheme(scheme, "fp8.dequantize"), dtype or torch.float32)


def dequantize_block_fp8(values, scale_inv, dtype=None):
    """``dequantize`` of 128 x 128 block values."""
    return dequantize(values, scale_inv, "block", dtype)
