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
        and 1 and sums of one term are exact in float32). Its MoE experts are held packed
        (Note [CPU MoE after a reload]); they are unpacked with the packing's own permutation."""
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
                out[name] = _unpacked(model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2], p)
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

    def warmlink_misread_only(self, tp: int, rank: int | None, only: str) -> str | None:
        """``warmlink_misread`` for the layouts whose names contain ``only``; ``rank`` None: this worker's."""
        from vllm.distributed import get_tensor_model_parallel_rank

        from warmlink.errors import LayoutError
        from warmlink.integrations.vllm._live import read_engine
        from warmlink.refit.families import layouts

        rank = get_tensor_model_parallel_rank() if rank is None else rank
        lays = layouts(self.model_runner.model_config.hf_config, convention="vllm", tp=tp, rank=rank, dtype="float32")
        try:
            read_engine(self.model_runner.model, {n: lay for n, lay in lays.items() if only in n})
        except LayoutError as exc:
            return str(exc)
        return None

    def warmlink_engine_state(self) -> dict:
        """The warmlink engine's counts, what it installs in place / streams, and its last report."""
        from warmlink.integrations.vllm._update import is_torn

        eng = self.weight_transfer_engine
        lay = eng.layouts
        return {"version": eng.version, "served": eng.served, "session_open": eng.session_open,
                "torn": is_torn(self.model_runner.model), "in_place": sorted(lay.in_place) if lay else [],
                "streamed": sorted(lay.streamed) if lay else [], "why": dict(lay.why) if lay else {},
                "report": eng.last_report}

    def warmlink_arm(self, point: str, pid: int = 0, after: int = 1) -> None:
        """Fault injection, once: SIGKILL trainer process ``pid`` at ``point`` of the next update
        ("after_start": once start_weight_update returned; "bucket": once ``after`` buckets were
        staged; "after_stage": once update_weights staged the version), or ("load_fails") make
        the next ``after`` installs raise inside ``load_weights``."""
        import os
        import signal

        eng = self.weight_transfer_engine
        model = self.model_runner.model

        def kill() -> None:
            if self.rank == 0:
                os.kill(pid, signal.SIGKILL)

        if point == "after_start":
            start = type(eng).start_weight_update

            def start_then_kill(this):
                start(this)
                del eng.start_weight_update
                kill()

            eng.start_weight_update = start_then_kill.__get__(eng)
        elif point == "bucket":
            updates, seen = eng._updates, [0]
            copy = type(updates)._copy_to_staging

            def copy_then_kill(this, weights):
                copy(this, weights)
                seen[0] += 1
                if seen[0] == after:
                    del updates._copy_to_staging
                    kill()

            updates._copy_to_staging = copy_then_kill.__get__(updates)
        elif point == "after_stage":
            receive = type(eng).receive_weights

            def receive_then_kill(this, info):
                receive(this, info)
                del eng.receive_weights
                kill()

            eng.receive_weights = receive_then_kill.__get__(eng)
        elif point == "load_fails":
            left = [after]
            load = type(model).load_weights

            def failing(this, weights):
                if left[0] <= 0:
                    return load(this, weights)
                left[0] -= 1
                for i, item in enumerate(weights):
                    if i == 3:  # some modules took new bytes, then the loader fails
                        raise RuntimeError("injected: load_weights failed mid-way")
                    load(this, iter([item]))
                return None

            model.load_weights = failing.__get__(model)
        else:
            raise ValueError(point)

    def warmlink_forward_refused(self) -> str | None:
        """The error a forward of the model raises before running (a torn model's refusal), or None."""
        import torch

        from warmlink.refit import PartialLoadError

        model = self.model_runner.model
        try:
            for hook in model._forward_pre_hooks.values():
                hook(model, (torch.zeros(1, dtype=torch.long),))
        except PartialLoadError as exc:
            return str(exc)
        return None


def tensors(raw: dict) -> dict:
    """``ReadBack.warmlink_params``' answer as tensors."""
    import torch

    return {n: torch.frombuffer(bytearray(b), dtype=getattr(torch, d)).reshape(shape) if b else
            torch.empty(shape, dtype=getattr(torch, d)) for n, (shape, d, b) in raw.items()}


def _unpacked(module, leaf: str, p):
    """``p`` as loaded: CPU MoE experts are stored in the kernel's packed order, a permutation of
    the elements (``cpu_prepack_moe_weight`` of an index tensor gives it; exact under 2**24)."""
    import torch

    experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
    t = p.detach().cpu().clone()
    if leaf not in ("w13_weight", "w2_weight") or type(experts).__name__ != "CPUUnquantizedExperts" or experts._use_zentorch:
        return t
    from vllm._custom_ops import cpu_prepack_moe_weight

    index = cpu_prepack_moe_weight(torch.arange(t.numel(), dtype=torch.float32).view(t.shape), experts.isa)
    out = torch.empty_like(t).flatten()
    out[index.flatten().long()] = t.flatten()
    return out.view(t.shape)
