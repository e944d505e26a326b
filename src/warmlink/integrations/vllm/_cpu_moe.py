"""vLLM 0.32's CPU MoE experts after a reload: packed again, as a fresh load leaves them.

# Note [CPU MoE after a reload]
vLLM's CPU MoE kernel (``CPUUnquantizedExperts``, ``torch.ops._C.cpu_fused_moe``) computes from
``w13_weight`` / ``w2_weight`` *pre-packed* by ``cpu_prepack_moe_weight`` (same shape, another
element order), which ``UnquantizedFusedMoEMethod._setup_kernel`` runs only at the first load
(while ``moe_kernel`` is None). A layerwise reload (warmlink's streamed install, and vLLM's own
``reload_weights``) re-runs the method's ``process_weights_after_loading``, which then skips the
pre-pack, and copies the *logical* tensors into the live, packed storage: the parameters equal the
trainer's, the kernel reads them as packed, and generation is wrong with no error. So after each
install the experts of every module the reload processed are packed again, in place (the storage
stays, as vLLM's own weight-update path keeps it). Only modules reloaded in this install: a second
pack of the same bytes would permute them again. An intermediate size vLLM pads (not a multiple of
its ISA's block) already fails inside vLLM's reload, before this runs.
"""

from __future__ import annotations

import torch

__all__ = ["repack_after_reload"]


def repack_after_reload(modules) -> int:
    """Pack the routed experts of the CPU-backed MoE modules among ``modules`` (the ones a layerwise
    reload just processed) into vLLM's kernel layout again. Returns how many were packed."""
    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM build without the CPU MoE kernel: nothing to pack
        return 0
    packed = 0
    for module in modules:
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or experts._use_zentorch:
            continue  # another backend, or zentorch, which computes from the experts as loaded
        with torch.no_grad():
            for name in ("w13_weight", "w2_weight"):
                param = getattr(module, name)
                param.copy_(cpu_prepack_moe_weight(param.detach(), experts.isa))
        packed += 1
    return packed
