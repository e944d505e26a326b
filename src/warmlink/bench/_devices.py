"""Which device a bench process uses: the refit benches' choice of devices and each child's device."""

from __future__ import annotations

__all__ = ["device_of", "pick_devices"]


def device_of(index: int):
    """``torch.device`` of a bench process: the CPU for -1, else that GPU (made current)."""
    import torch

    if index < 0:
        return torch.device("cpu")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def pick_devices(arg: tuple[int, int] | None) -> tuple[int, int]:
    """The (trainer, engine) devices of a refit bench: ``--devices`` when given, else two GPUs,
    one GPU for both, or the CPU (-1, -1)."""
    import torch

    if arg is not None:  # parsed by bench.args.devices, checked against the machine by bench.args.check_devices
        return arg
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        return 0, 1
    return (0, 0) if torch.cuda.is_available() else (-1, -1)
