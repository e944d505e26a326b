"""The mask buffer of low-latency mode (DeepEP's ``enable_shrink``): which ranks this rank has given up on.

Without ``shrink`` a peer that stalls or dies breaks the group: every later call raises. With it,
a wait past the Buffer's timeout (or a peer found dead) masks that rank instead, here, and the
calls go on among the others: nothing is sent to a masked rank or awaited from it, its rows are
absent from a dispatch's outputs, and a combine sums each token without its experts on masked
ranks. The mask is per rank (each rank masks whom it found late), sticky until
``update_mask(rank, False)`` or ``clean_mask``; a rank unmasked so must have made the same calls
as the others meanwhile (each rank counts its rounds).

On a GPU the mask is a device word per rank that the kernels read and write
(ep.low_latency._device, Note [Low-latency device path]); on the host path it is this object's
int32 tensor, and ``wait`` applies the same rule to the mailbox rounds.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from warmlink.errors import ConfigError, PeerLostError, TransferTimeout

__all__ = ["HostMask"]


class HostMask:
    """The host path's mask and its waits.

    Args:
        num_ranks: R. rank: this rank (never masked).
        shrink: mask late ranks; else a wait raises as the mailbox does.
    """

    def __init__(self, num_ranks: int, rank: int, shrink: bool) -> None:
        self.num_ranks, self.rank, self.shrink = num_ranks, rank, shrink
        self.words = torch.zeros(num_ranks, dtype=torch.int32, device="cpu")

    def live(self) -> list[int]:
        """The ranks not masked, this one included, in rank order."""
        return [r for r in range(self.num_ranks) if not self.words[r]]

    def masked(self) -> set[int]:
        return {r for r in range(self.num_ranks) if self.words[r]}

    def live_array(self) -> np.ndarray:
        """bool ``[R]``: True where a rank is not masked."""
        return self.words.numpy() == 0

    def wait(self, mailbox, field: int, round_: int, timeout_s: float, costs: torch.Tensor | None = None) -> None:
        """Wait for every live peer's ``field`` to reach ``round_``; with ``costs`` (int64 ``[R]``)
        add to ``costs[s]`` the nanoseconds until source ``s``'s round was seen (sources in rank
        order). With ``shrink`` a peer that misses the deadline or died is masked; else raises.

        Raises:
            TransferTimeout / PeerLostError: without ``shrink``, as ``Mailbox.wait``.
        """
        if costs is None and not self.shrink:
            mailbox.wait(field, round_, timeout_s)
            return
        start = time.perf_counter_ns()
        deadline = time.monotonic() + timeout_s
        seen = np.zeros(self.num_ranks, dtype=np.int64)
        for s in self.live():
            try:
                mailbox.wait(field, round_, max(deadline - time.monotonic(), 1e-3), ranks=[s])
            except (TransferTimeout, PeerLostError):
                if not self.shrink:
                    raise
                self.words[s] = 1
            seen[s] = time.perf_counter_ns() - start
        if costs is not None:
            costs.add_(torch.from_numpy(seen).to(costs.device))

    # -- DeepEP's calls ----------------------------------------------------------------------------
    def query_mask(self, out: torch.Tensor) -> None:
        out.copy_(self.words.to(out.device))

    def update_mask(self, rank: int, masked: bool) -> None:
        self.words[rank] = int(masked)

    def clean_mask(self) -> None:
        self.words.zero_()


def check_mask_call(func: str, shrink: bool, num_ranks: int, rank=None, out=None, device: int = -1) -> None:
    """Refuse a mask buffer call this Buffer cannot take, naming the argument."""
    if not shrink:
        raise ConfigError(f"ep.Buffer.{func}: this Buffer was built without enable_shrink=True, so it has no mask "
                          "buffer (a late rank breaks the group instead)")
    if rank is not None and (type(rank) is not int or not 0 <= rank < num_ranks):
        raise ConfigError(f"ep.Buffer.{func}: rank={rank!r}; expected an int in [0, {num_ranks})")
    if out is not None:
        want = torch.device("cuda", device) if device >= 0 else torch.device("cpu")
        if (not isinstance(out, torch.Tensor) or out.dtype != torch.int32 or tuple(out.shape) != (num_ranks,)
                or out.device != want):
            raise ConfigError(f"ep.Buffer.{func}: mask_status must be an int32 tensor of shape [{num_ranks}] on "
                              f"{want}; got {getattr(out, 'dtype', type(out).__name__)} "
                              f"{tuple(getattr(out, 'shape', ()))} on {getattr(out, 'device', None)}")
