"""``LaunchStatus``: the status words of a streamed Buffer's launches, and the failures they tell.

Every streamed launch (a dispatch, cached or fresh, or a combine) has ``2C`` status words, one per
program, which the program sets when it ends (``seq << 32``, with the reason of a failure in the
low bits: ep.kernels.stream). An eager launch's words reach pinned host memory: the CUDA kernels
write them there themselves (a launch has ended when its row is all set), Triton's into device
memory, copied back behind them with an event. ``failures`` reads the finished ones without
waiting, so a call returns at launch and its failure (a peer's deadline, an abort) is raised by a
later call. Eager launches rotate over ``SLOTS`` rows: a caller more than that many launches ahead
of its stream waits for the oldest. A launch captured in a graph writes its words into a row of its
own (Triton's: every eager call copies those back too).
"""

from __future__ import annotations

from collections import deque

import torch

from warmlink.ep.kernels import host, stream
from warmlink.ep.kernels.launch import capturing
from warmlink.errors import ConfigError, TransferTimeout

__all__ = ["MAX_CAPTURED", "SLOTS", "LaunchStatus"]

SLOTS = 8  # status rows of eager launches in flight
MAX_CAPTURED = 256  # streamed calls a Buffer's CUDA graphs may hold: each has status words of its own


class LaunchStatus:
    """The status rows of one rank's streamed launches.

    Args:
        kernel: ``"cuda"`` or ``"triton"`` (where the words are written). channels: the space's.
        device: the CUDA device. mover: the rank's mover (its stream and host polls).
        timeout_s: the launches' deadline (a wait for a launch to end waits twice that).
    """

    def __init__(self, kernel: str, channels: int, device: int, mover, timeout_s: float) -> None:
        from warmlink import _cuda
        from warmlink.pool.events import lease_event

        self._cuda, self.kernel, self.channels, self.device = _cuda, kernel, channels, device
        self._mover, self._timeout_s = mover, timeout_s
        rows, width = SLOTS + MAX_CAPTURED, 2 * channels
        self._device_words = torch.zeros(rows, width, dtype=torch.int64, device=torch.device("cuda", device))
        self._host = torch.zeros(rows, width, dtype=torch.int64, device="cpu", pin_memory=True)
        self._words = self._host.numpy()
        self._rows = list(self._host)  # (one view per row, made once)
        self._addresses = [row.data_ptr() for row in self._rows]
        self._leases = [lease_event(device) for _ in range(SLOTS)]
        self._events = [lease.resource.handle for lease in self._leases]
        self._launched = 0  # eager launches: their slots rotate by it
        self._captured = 0  # launches captured in graphs: their rows follow the eager slots
        self._queued: deque[tuple[int, int, str]] = deque()  # (slot, captured rows then, what), not yet read
        compiled = host.module() if kernel == "cuda" else None
        self._scan = compiled.status_clean if compiled is not None else None

    def slot(self, in_graph: bool | None = None) -> int:
        """The status row of the next launch: an eager slot (waiting, with the timeout, for its
        last reader), or a captured launch's row of its own (``in_graph``: whether it is captured,
        where the caller knows)."""
        if capturing() if in_graph is None else in_graph:
            if self._captured >= MAX_CAPTURED:
                raise ConfigError(f"ep.Buffer: {MAX_CAPTURED} streamed calls are captured in this Buffer's graphs "
                                  "already, the most it holds status words for")
            self._captured += 1
            return SLOTS + self._captured - 1
        if len(self._queued) >= SLOTS:
            failed = self._read(block=True)
            if failed:
                raise failed
        return self._launched % SLOTS

    def row(self, slot: int) -> torch.Tensor:
        """Where the launch of ``slot`` writes its status words: pinned host memory for the CUDA
        kernels (zeroed now: the row's last launch was read), device memory for Triton's."""
        if self.kernel != "cuda":
            return self._device_words[slot]
        if slot < SLOTS:
            self._words[slot] = 0
        return self._rows[slot]

    def address(self, slot: int) -> int:
        """``row(slot)``'s address, for the CUDA kernels (a planned launch: ep.paths.planned)."""
        if slot < SLOTS:
            self._words[slot] = 0
        return self._addresses[slot]

    def launched(self, slot: int, what: str) -> None:
        """Queue an eager launch for ``failures``: Triton's get their status words copied back behind
        them (and every captured launch's: their graphs may have run since), then an event."""
        if slot >= SLOTS:
            return
        if self.kernel == "cuda":  # the words come on their own (row)
            self._launched += 1
            self._queued.append((slot, self._captured, what))
            return
        cuda, current, nbytes = self._cuda, self._mover.current_stream(), self._device_words.shape[1] * 8
        cuda.memcpy_async(self._host[slot].data_ptr(), self._device_words[slot].data_ptr(), nbytes, current)
        if self._captured:
            cuda.memcpy_async(self._host[SLOTS].data_ptr(), self._device_words[SLOTS].data_ptr(),
                              self._captured * nbytes, current)
        cuda.event_record(self._events[slot], current)
        self._launched += 1
        self._queued.append((slot, self._captured, what))

    def failures(self) -> TransferTimeout | None:
        """The first finished call whose programs did not all finish, as the error to raise (None:
        none). Reads only what finished; never waits."""
        return self._read(block=False)

    def _read(self, block: bool) -> TransferTimeout | None:
        if self._scan is not None and not self._captured and self._queued:
            # (the common case in one compiled call: the eager launches that ended clean, read in
            # order, off a fresh dispatch's way to its return; the rest as below)
            clean = self._scan(self._addresses[0], self._words.shape[1], 2 * self.channels,
                               [slot for slot, _, _ in self._queued])
            for _ in range(clean):
                self._queued.popleft()
        while self._queued:
            slot, captured, what = self._queued[0]
            ended = self._ended(slot)
            if not ended():
                if not block:
                    return None
                self._mover.poll(ended, 2 * self._timeout_s + 1, lambda: (
                    f"ep: a streamed {what} did not end on cuda:{self.device} within its deadline"))
            self._queued.popleft()
            width = 2 * self.channels
            if not (self._words[slot, :width] & 0xFFFFFFFF).any() and not (
                    captured and (self._words[SLOTS:SLOTS + captured, :width] & 0xFFFFFFFF).any()):
                continue  # (the common case, read as one array: every program of those launches finished)
            rows = [(slot, what)] + [(SLOTS + i, "call of a CUDA graph") for i in range(captured)]
            for row, name in rows:
                failed = _failed(self._host[row], name, self.channels)
                if failed is not None:
                    return failed
        return None

    def _ended(self, slot: int):
        """Whether the launch of eager ``slot`` ended: every status word set (CUDA), or its event."""
        if self.kernel == "cuda":
            words, width = self._words[slot], 2 * self.channels
            return lambda: bool(words[:width].all())
        event = self._events[slot]
        return lambda: self._cuda.event_query(event)

    def clear(self) -> None:
        """Zero every status word, once every launch ended (after ``abort_all``); the next eager
        launch takes the first slot."""
        self._device_words.zero_()
        torch.cuda.synchronize(self.device)
        self._host.zero_()
        self._queued.clear()
        self._launched = 0

    def close(self) -> None:
        for lease in self._leases:
            lease.release()
        self._leases = []


def _failed(words: torch.Tensor, what: str, channels: int) -> TransferTimeout | None:
    """The error of a call whose status words hold a failure, else None (all zero: never ran)."""
    bad = [w for w in words.tolist()[:2 * channels] if w & 0xFFFFFFFF]
    if not bad:
        return None
    failed = stream.failures(words, bad[0] >> 32, channels)
    first = failed[0]
    how = "aborted" if first.aborted else "timed out"
    return TransferTimeout(
        f"ep: a streamed {what} (seq {first.seq}) failed: {len(failed)} program(s) did not finish; the first, "
        f"{first.role} channel {first.channel}, {how} waiting for {first.wait} from rank {first.peer}. Its outputs "
        "and those of the calls after it are void; the Buffer's next call clears the stream space with every peer")
