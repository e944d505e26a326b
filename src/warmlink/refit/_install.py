"""How a version reaches a receiver's targets: one strategy per install mode, chosen once per receiver.

``install_mode(name)`` makes the strategy for ``Receiver(install=name)``. Each says what receive
buffers a cycle pulls into (``buffers``), how the pulled tensors reach the targets (``install``),
what happens to the buffers after an install (``installed``), what a failure after the copies
started means (``failure``), which tensor of a module it installs into (``target``), and whether a
closed receiver's state may serve the next receiver (``parks``, Note [Parked receive state] in
``refit._parked``).

# Note [Install modes]
A version is installed only once every byte of it arrived, so that the engine holds the old
version or the new one (DESIGN invariant 3). "copy" and "swap" pull into receive memory the
engine never reads and install after the pull: generation may run during the pull
(start_refit). Colocated engines (trainer and engine alternating on one GPU) have no memory for a
second copy of the weights and generate nothing during a refit, so "direct" pulls straight into
the targets: no receive memory, no install pass. The pull then *is* the install: the engine must
not read the targets while a cycle is in flight, and a cycle that fails after its copies started
leaves them holding a mix, which it says by raising PartialLoadError (installed_version becomes
None until a cycle completes). On one host the copies read memory the publisher keeps mapped and
does not write while this receiver reads (Note [Version protocol]), so a publisher dying
mid-pull still leaves a complete version; what remains is a local failure. Tensors a pull cannot
land in directly (a cast, a staged re-slice) still go through receive memory and a copy.
"""

from __future__ import annotations

from typing import ClassVar, Mapping

from warmlink.errors import ConfigError
from warmlink.refit import translate
from warmlink.refit._addresses import TargetAddresses
from warmlink.refit._stream import PartialLoadError
from warmlink.refit.dtensor import is_dtensor, local_tensor

__all__ = ["InstallMode", "CopyInstall", "SwapInstall", "DirectInstall", "MODES", "install_mode"]


class InstallMode:
    """One receiver's install strategy (Note [Install modes]). Subclasses set the class traits."""

    name: ClassVar[str]
    parks: ClassVar[bool] = False  # a closed receiver's state may serve the next receiver
    double_buffered: ClassVar[bool] = False  # the state keeps two buffer sets, one per parity

    def target(self, name: str, tensor):
        """What ``Receiver.add_module`` installs module tensor ``name`` into: its local shard."""
        return local_tensor(tensor)

    def buffers(self, state, plan, targets: Mapping[str, object]) -> tuple:
        """``(bufs, token, twin)`` for a cycle of ``plan``: the ``ReceiveBuffers`` it pulls into
        from ``state`` (a ``ReceiveState``), their token, and buffers to prepare beside them so that
        the next cycle prepares nothing (or None). ``targets``: the receiver's, by name."""
        bufs, token = state.buffers(plan)
        return bufs, token, None

    def install(self, pairs: list) -> None:
        """Put each ``(target, tensor)`` pair's tensor into its target (on the current stream)."""
        translate.install_copy(pairs)

    def installed(self, state, token) -> None:
        """The cycle of ``token``'s buffers installed: what happens to the buffers now."""
        state.release_buffers(token)

    def failure(self, plan, bufs, version: int, exc: BaseException) -> BaseException | None:
        """The error a cycle that failed with ``exc`` after its pull was issued raises instead, when
        its targets no longer hold the old version; None: they do, ``exc`` stands."""
        return None


class CopyInstall(InstallMode):
    """Pull into receive memory, then copy into the targets, whose addresses stay (safe with CUDA
    graphs and with generation running during the pull)."""

    name = "copy"
    parks = True


class SwapInstall(InstallMode):
    """Point targets' ``.data`` at double-buffered received memory: no install pass, memory for
    two copies of the weights. Its state never parks: the targets point into its buffers."""

    name = "swap"
    double_buffered = True

    def __init__(self) -> None:
        # The half of the double buffer the next pull writes; the other half is installed. It
        # flips only when an install succeeds, never with a failed cycle.
        self._pull_parity = 1

    def target(self, name: str, tensor):
        if is_dtensor(tensor):
            raise ConfigError(f"Receiver.add_module: {name!r} is a DTensor; install='swap' cannot re-point its local "
                              "shard; expected install='copy' or 'direct'")
        return tensor

    def buffers(self, state, plan, targets: Mapping[str, object]) -> tuple:
        bufs, token = state.buffers(plan, self._pull_parity)
        return bufs, token, state.preload_buffers(plan, 1 - self._pull_parity)

    def install(self, pairs: list) -> None:
        translate.install_swap(pairs)

    def installed(self, state, token) -> None:
        state.keep_installed(token)
        self._pull_parity = 1 - self._pull_parity  # targets now point at what was just pulled


class DirectInstall(InstallMode):
    """Pull straight into the targets: no install pass and no receive memory, except for tensors
    that need a cast or a staged re-slice (copied in as with ``"copy"``). Its state never parks:
    its buffers are its targets."""

    name = "direct"

    def __init__(self) -> None:
        self._targets_of: tuple | None = None  # (plan, its targets in plan order, their addresses)

    def buffers(self, state, plan, targets: Mapping[str, object]) -> tuple:
        in_order, where = self._direct_targets(plan, targets)
        bufs, token = state.buffers(plan, 0, in_order, where)
        return bufs, token, None

    def _direct_targets(self, plan, targets: Mapping[str, object]) -> tuple[list, int]:
        """Per tensor of ``plan`` its target, in plan order (found once per plan), and a key for
        where the targets' memory is now (asked every cycle: a target whose ``.data`` was replaced
        must never be pulled into at its old address)."""
        cached = self._targets_of
        if cached is None or cached[0] is not plan:
            in_order = [targets.get(tp.dst) for tp in plan.tensors]
            cached = self._targets_of = (plan, in_order, TargetAddresses([t for t in in_order if t is not None]))
        return cached[1], cached[2].current_key()

    def failure(self, plan, bufs, version: int, exc: BaseException) -> BaseException | None:
        direct = [tp.dst for tp, d in zip(plan.tensors, bufs.direct) if d is not None]
        if not direct:  # nothing was pulled into a target: they hold the old version
            return None
        return PartialLoadError(
            f"Receiver.refit: version {version} failed after its copies into {len(direct)} target(s) started "
            f"(install='direct'); they hold a mix of versions until a refit completes ({exc})",
            version=version, bucket_idx=0, num_buckets=1, handed=direct)


MODES: dict[str, type[InstallMode]] = {mode.name: mode for mode in (CopyInstall, SwapInstall, DirectInstall)}


def install_mode(name: str) -> InstallMode:
    """A new strategy for ``Receiver(install=name)`` (each receiver its own: swap and direct keep
    per-receiver state). Raises ConfigError for an unknown name."""
    mode = MODES.get(name) if isinstance(name, str) else None
    if mode is None:
        raise ConfigError(f"Receiver: install={name!r} is unknown; expected one of {list(MODES)}")
    return mode()
