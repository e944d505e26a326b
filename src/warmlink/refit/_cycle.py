"""One refit cycle: its report, its record while bytes move, and the handle that finishes it.

``Receiver.start_refit`` makes a ``Cycle`` and hands out a ``RefitHandle``; the handle finishes
the cycle only through ``Receiver._finish``, which owns every change to the receiver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from warmlink.errors import VersionError
from warmlink.pool.core import counters

__all__ = ["CycleReport", "Cycle", "RefitHandle", "COUNTED"]

# What CycleReport.created counts: the kinds a warm cycle must not create.
COUNTED = ("arena", "registration", "peer_mapping", "plan")


@dataclass
class CycleReport:
    """Phase timings of one refit cycle, in seconds, what it created, and the bytes it pulled
    (``nbytes``, by source in ``pulled_from``)."""

    cycle: int
    version: int
    connect_s: float = 0.0
    sync_s: float = 0.0
    plan_s: float = 0.0
    alloc_s: float = 0.0
    register_s: float = 0.0
    pull_s: float = 0.0
    translate_s: float = 0.0
    install_s: float = 0.0
    total_s: float = 0.0
    nbytes: int = 0
    num_copies: int = 0
    created: dict = field(default_factory=dict)
    # bytes by where they came from: "publishers", or "replica <m>" with fan-out (Note [Fan-out])
    pulled_from: dict = field(default_factory=dict)
    replica: int = 0  # this receiver's member number in its fan-out group; 0 without fan-out

    @property
    def publisher_nbytes(self) -> int:
        """Bytes this cycle pulled from the publishers (what left the trainer for this receiver)."""
        return self.pulled_from.get("publishers", 0)

    @property
    def setup_s(self) -> float:
        """Seconds spent on anything but moving and installing bytes: zero on a warm cycle."""
        return self.connect_s + self.plan_s + self.alloc_s + self.register_s

    def as_dict(self) -> dict:
        return dict(self.__dict__, setup_s=self.setup_s)


def created_counts() -> dict[str, int]:
    """``created`` of each counted kind now: a cycle's ``created`` is the difference."""
    return {k: counters(k).created for k in COUNTED}


class Cycle:
    """A started cycle: its plan, the buffers it pulls into (and their cache token), the version it
    is inside (a ``refit._version_sync.VersionSync``, which checks and leaves it), the transfer, its
    report, and the counts and times (``time.perf_counter`` seconds) it started from."""

    __slots__ = ("plan", "bufs", "token", "sync", "transfer", "report", "before", "t0", "t_issue", "timeout_s")

    def __init__(self, plan, bufs, token, sync, transfer, report: CycleReport, before: dict, t0: float, t_issue: float,
                 timeout_s: float) -> None:
        self.plan = plan
        self.bufs = bufs
        self.token = token
        self.sync = sync
        self.transfer = transfer
        self.report = report
        self.before = before
        self.t0 = t0
        self.t_issue = t_issue
        self.timeout_s = timeout_s

    def created(self) -> dict[str, int]:
        now = created_counts()
        return {k: now[k] - self.before[k] for k in COUNTED}


class RefitHandle:
    """A cycle whose bytes are moving. ``wait()`` (or calling the handle) finishes it."""

    __slots__ = ("report", "_receiver", "_cycle", "_error", "_finished")

    def __init__(self, receiver, cycle: Cycle) -> None:
        self.report = cycle.report
        self._receiver = receiver
        self._cycle = cycle
        self._error: BaseException | None = None
        self._finished = False

    def done(self) -> bool:
        """True once every byte has arrived (installation still needs ``wait``)."""
        return self._cycle.transfer.done()

    def __call__(self, load_weights: Callable | None = None) -> CycleReport:
        return self.wait(load_weights=load_weights)

    def wait(self, *, load_weights: Callable | None = None) -> CycleReport:
        """Wait for the bytes, translate, install; returns the cycle's report.

        Raises:
            PeerLostError / TransferTimeout: a publisher or the store was lost or stalled.
            VersionError: this cycle already failed (the first ``wait`` raised why), or its
                receiver was closed before the cycle finished.

        On any failure the targets keep the previous version, the error propagates and the
        receiver can start another cycle. After a success, ``wait`` returns the same report again.
        """
        if self._error is not None:
            raise VersionError(f"RefitHandle.wait: cycle {self.report.cycle} failed ({self._error!r}); "
                               "targets keep the previous version; start another refit") from self._error
        if self._finished:
            return self.report
        try:
            self._receiver._finish(self._cycle, load_weights)
        except BaseException as exc:
            self._error = exc
            raise
        self._finished = True
        return self.report

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "installed" if self._finished else "in flight"
        return f"RefitHandle(cycle={self.report.cycle}, version={self.report.version}, {state})"
