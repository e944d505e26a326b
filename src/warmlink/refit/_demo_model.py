"""A tiny Llama for ``warmlink demo`` and the refit tests: config, build, one train step, a probe.

Kept out of the CLI so that tests use exactly what the demo runs. Needs ``transformers``
(``pip install warmlink[demo]``), imported only when a function here is called.

# Note [Demo determinism]
Two processes that call ``configure_determinism`` with the same ``num_threads``, then
``build_model(config, seed)`` and the same sequence of ``train_step(model, opt, step, seed)`` on
CPU end with bit-identical parameters, so a receiver can check a refit against a model it trained
itself. What makes that hold:

- every random draw comes from an explicit source: ``build_model`` seeds the global generator
  inside ``torch.random.fork_rng`` (the caller's RNG state is restored afterwards); batches come
  from a private ``torch.Generator`` seeded from ``(seed, step)``;
- float32 weights and eager attention (no SDPA / flash backend choice that depends on the
  machine), no dropout (the Llama config has none and the model stays in eval mode);
- ``torch.use_deterministic_algorithms(True)`` and the same intra-op thread count: CPU kernels
  (matmul, reductions) are reproducible for a fixed thread count, not across thread counts;
- ``make_optimizer`` builds AdamW with ``foreach=False`` so that the update does not depend on
  which multi-tensor path is available.

On CUDA the same holds only when the launcher also sets ``CUBLAS_WORKSPACE_CONFIG=:4096:8``
before CUDA starts; library code never writes the environment, so on a CUDA host
``configure_determinism`` only warns about nondeterministic kernels unless ``cuda=True``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "tiny_llama_config",
    "build_model",
    "make_optimizer",
    "train_step",
    "probe_logits",
    "configure_determinism",
]

_BATCH = 4
_SEQ_LEN = 32
_PROBE_SEED_OFFSET = 0x5EED


def tiny_llama_config(**overrides: Any) -> Any:
    """A small ``transformers.LlamaConfig`` (about 3.6 M parameters) that trains fast on CPU.

    Defaults: hidden 256, 4 layers, 8 attention heads, 4 KV heads (GQA), head_dim 32,
    intermediate 688, vocab 1000, untied embeddings, float32, eager attention.

    Args:
        **overrides: any ``LlamaConfig`` field, replacing the default.

    Returns:
        A new ``LlamaConfig`` the caller owns.

    **Collective?** No. **Blocking?** No. **Warm path?** Not for the warm path (setup only).
    """
    from transformers import LlamaConfig

    kwargs: dict[str, Any] = dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=688,
        vocab_size=1000,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        dtype="float32",
    )
    kwargs.update(overrides)
    config = LlamaConfig(**kwargs)
    config._attn_implementation = "eager"
    return config


def configure_determinism(num_threads: int | None = 1, *, cuda: bool = False) -> None:
    """Make this process's torch reproducible for the demo. See Note [Demo determinism].

    Changes process-wide torch state: call it once at the top of each demo process, not from a
    library path.

    Args:
        num_threads: intra-op thread count to set (every process that must agree uses the same
            value); ``None`` leaves it unchanged.
        cuda: also demand deterministic CUDA kernels (needs ``CUBLAS_WORKSPACE_CONFIG`` set by the
            launcher before CUDA starts).

    **Collective?** No, but every comparing process must call it alike. **Blocking?** No.
    **Warm path?** Not for the warm path (setup only).
    """
    import torch

    if num_threads is not None:
        torch.set_num_threads(num_threads)
    # Strict on CPU-only hosts; on a CUDA host strict only when asked (cuBLAS raises without the env).
    torch.use_deterministic_algorithms(True, warn_only=torch.cuda.is_available() and not cuda)


def build_model(config: Any, seed: int, device: Any = "cpu") -> Any:
    """A ``LlamaForCausalLM`` with random float32 weights drawn from ``seed``, in eval mode.

    Args:
        config: a ``LlamaConfig`` (e.g. from ``tiny_llama_config``); not modified.
        seed: weight-initialisation seed; the same seed gives bit-identical weights.
        device: where the weights live after initialisation (which always runs on CPU).

    Returns:
        The model; the caller owns it. The caller's global RNG state is left untouched.

    **Collective?** No. **Blocking?** Yes (initialises on the host).
    **Warm path?** Not for the warm path (setup only).
    """
    import copy

    import torch
    from transformers import LlamaForCausalLM

    config = copy.deepcopy(config)
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model = model.to(device=device, dtype=torch.float32)
    model.eval()
    return model


def make_optimizer(model: Any, lr: float = 1e-3) -> Any:
    """AdamW over ``model``'s parameters, single-tensor path (``foreach=False``) for determinism.

    Args:
        model: the model from ``build_model``.
        lr: learning rate.

    Returns:
        A new ``torch.optim.AdamW`` the caller owns.
    """
    import torch

    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, foreach=False)


def _batch(vocab_size: int, seed: int, device: Any) -> Any:
    import torch

    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return torch.randint(0, vocab_size, (_BATCH, _SEQ_LEN), generator=gen, device="cpu").to(device)


def train_step(model: Any, optimizer: Any, step: int, seed: int) -> float:
    """One optimizer step on a synthetic next-token batch derived from ``(seed, step)``.

    Args:
        model: the model from ``build_model``.
        optimizer: e.g. from ``make_optimizer``; stepped once.
        step: step index; with ``seed``, selects the batch (``4 x 32`` token ids).
        seed: run seed.

    Returns:
        The loss before the update, as a Python float (one host sync).

    **Collective?** No. **Blocking?** Yes (reads the loss). **Warm path?** Not applicable.
    """
    tokens = _batch(model.config.vocab_size, seed * 1_000_003 + step, next(model.parameters()).device)
    optimizer.zero_grad(set_to_none=True)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def probe_logits(model: Any, seed: int) -> Any:
    """Logits of a fixed probe batch (derived from ``seed`` only), computed without grad.

    Args:
        model: any model with the demo config (trainer or refitted receiver).
        seed: run seed; the probe batch does not depend on the step.

    Returns:
        A new float32 tensor ``[4, 32, vocab_size]`` on the model's device, owned by the caller.
    """
    import torch

    tokens = _batch(model.config.vocab_size, seed + _PROBE_SEED_OFFSET, next(model.parameters()).device)
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()
