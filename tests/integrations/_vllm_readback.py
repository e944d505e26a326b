"""A vLLM worker extension for the tests: what a worker's model holds, read back by the test.

Named in ``LLM(worker_extension_cls="integrations._vllm_readback.ReadBack")``; its methods run in
each worker through ``LLM.collective_rpc("warmlink_params")`` without insecure serialization.
"""

from __future__ import annotations


class ReadBack:
    def warmlink_params(self) -> dict:
        """Every parameter by vLLM's name as ``(shape, dtype name, raw bytes)`` (exact through
        vLLM's RPC serialization; ``tensors()`` below rebuilds them). vLLM's CPU backend re-packs linear weights
        after loading and drops the parameter (shape [0]); for those the layer's own GEMM of an
        identity matrix gives the weight back exactly (``x @ W.T`` with ``x = I``; products by 0
        and 1 and sums of one term are exact in float32)."""
        import torch

        out = {}
        model = self.model_runner.model
        for name, p in model.named_parameters():
            if p.numel() == 0:
                mod = model.get_submodule(name.rpartition(".")[0])
                if not hasattr(mod, "cpu_linear"):
                    continue
                eye = torch.eye(getattr(mod, "input_size_per_partition", mod.input_size), dtype=p.dtype)
                out[name] = mod.cpu_linear(eye, None, None).t().contiguous()
            else:
                out[name] = p.detach().cpu().clone()
        return {n: (list(t.shape), str(t.dtype).removeprefix("torch."), t.contiguous().view(torch.uint8).numpy().tobytes())
                for n, t in out.items()}

    def warmlink_misread(self, tp: int, rank: int) -> str | None:
        """Check this worker's live modules against the vllm layouts of another rank (``tp``,
        ``rank``): the LayoutError's message, or None if they were accepted."""
        from warmlink.errors import LayoutError
        from warmlink.integrations.vllm._live import read_engine
        from warmlink.refit.families import layouts

        config = self.model_runner.model_config.hf_config
        try:
            read_engine(self.model_runner.model, layouts(config, convention="vllm", tp=tp, rank=rank, dtype="float32"))
        except LayoutError as exc:
            return str(exc)
        return None

    def warmlink_engine_state(self) -> dict:
        """The warmlink engine's version, what it installs in place / streams, and its last report."""
        eng = self.weight_transfer_engine
        lay = eng.layouts
        return {"version": eng.version, "in_place": sorted(lay.in_place) if lay else [],
                "streamed": sorted(lay.streamed) if lay else [], "why": dict(lay.why) if lay else {},
                "report": eng.last_report}


def tensors(raw: dict) -> dict:
    """``ReadBack.warmlink_params``' answer as tensors."""
    import torch

    return {n: torch.frombuffer(bytearray(b), dtype=getattr(torch, d)).reshape(shape) if b else
            torch.empty(shape, dtype=getattr(torch, d)) for n, (shape, d, b) in raw.items()}
