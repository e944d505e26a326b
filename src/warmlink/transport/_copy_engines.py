"""``CopyEngines``: copies between mapped GPU addresses on a link's pooled streams, run by the
GPU's copy engines. The one place the ``cuda_ipc`` backend issues ``cudaMemcpy*Async``: a link's
prepared batches (refit, ``CudaIpcLink.read``/``write``) and ep's sends (ep.paths.cuda_mover), whose
rows and row counts change every call, go through the same streams, method and ordering.

Ordering is on the GPU only (no host sync): ``follow`` makes every copy stream wait for the work
queued so far on another stream, ``join`` makes the first copy stream wait for another copy stream.
"""

from __future__ import annotations

from warmlink import _cuda

__all__ = ["CopyEngines"]


class CopyEngines:
    """Copies on ``streams``, each call one ``cudaMemcpyBatchAsync`` (``batched``) or one
    ``cudaMemcpyAsync`` per copy.

    Args:
        streams: the pooled ``Stream`` resources (pool.streams) the copies run on; index 0 is the
            primary stream, which ``join`` orders after the others.
        order: an event handle ``follow`` records (reused: a wait takes the event's state when it
            is queued, so one event serves every call).
        joins: one event handle per stream after the first, for ``join``.
        batched: one batch call per stream and call (``cudaMemcpyBatchAsync``; a copy engine stays
            busy between copies, where one call per copy left it idle ~5 us between each two).
        cuda: the ``_cuda`` module (tests pass a fake).
    """

    def __init__(self, streams: list, order: int, joins: list[int], batched: bool, cuda=_cuda) -> None:
        self.streams = list(streams)
        self.handles = [s.handle for s in self.streams]
        self.batched = batched
        self._order = order
        self._joins = joins
        self._cuda = cuda

    def __len__(self) -> int:
        return len(self.handles)

    def follow(self, stream: int) -> None:
        """Every copy stream waits on the GPU for the work queued so far on ``stream`` (a handle)."""
        self._cuda.event_record(self._order, stream)
        for s in self.handles:
            self._cuda.stream_wait_event(s, self._order)

    def copy(self, dsts: list[int], srcs: list[int], sizes: list[int], index: int = 0) -> None:
        """``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` for each i, on stream ``index``, in no
        particular order (their destinations must not overlap). Returns at once."""
        if not sizes:
            return
        stream = self.handles[index]
        if self.batched:
            self._cuda.memcpy_batch_async(dsts, srcs, sizes, stream)
        else:
            for dst, src, nbytes in zip(dsts, srcs, sizes):
                self._cuda.memcpy_async(dst, src, nbytes, stream)

    def copy_2d(self, strided: list[tuple], index: int = 0) -> None:
        """Each ``(dst, dst_pitch, src, src_pitch, row_nbytes, rows)`` of ``strided`` on stream ``index``."""
        for args in strided:
            self._cuda.memcpy_2d_async(*args, self.handles[index])

    def join(self, index: int) -> None:
        """The primary stream waits on the GPU for the copies queued so far on stream ``index``."""
        self._cuda.event_record(self._joins[index - 1], self.handles[index])
        self._cuda.stream_wait_event(self.handles[0], self._joins[index - 1])
