"""A streamed dispatch's launch made ready before its count board: ``PreparedLaunch`` for one call,
and ``FreshPlan``, an unpadded fresh dispatch's steps up to the board for a kind of call
``StreamPath`` has run before, in one compiled call (ep.kernels.host's ``planned_front``).

# Note [Planned fresh dispatch]
Why: from its checks to the streamed kernel's launch, a fresh dispatch is host time the GPUs wait
through (Note [Streamed calls] in ep.protocol.streamed), and on the GPU machines' hosts each torch
call on the way (an allocation, a tensor's address, shape or stride) costs microseconds, tens once
the host's caches went cold between calls, as they do between a training step's layers. Calls of
one kind (the compiled argument check's, ep.protocol.checks: the experts, top-k, dtypes and
whether weights come) launch the same count exchange graph and pack the same streamed kernel
struct but for their tensors' addresses, the token count and the scales' strides. So the first
call of a kind whose exchange ran as a graph (the shape's second, which captures it: Note [Fresh
send graph] in ep.paths.sm_pushes) keeps its struct as the kind's template, and every later call of the kind
makes its rows, ``taken`` and ``recv_offset`` tensors, writes the call block, launches the graph,
records the board's event and patches a copy of the template in one C++ call; then, once the
board is in, one more makes the outputs and launches the stream (``fresh_launch``, as for any
compiled call). A padded call (``num_worst_tokens``, a plan per kind and value) waits for no board:
one C++ call does all of it, the board's copy and the outputs included, and launches the stream,
which takes its offsets from the copy on the device. What the host keeps (the status slots, the
failures, the handle) stays in Python, after the launch where it can.

A plan holds the exchange's graph handle, which the mover keeps until it closes, and is dropped
with the path; the template's constant fields (the space's bases, the seq and valid words, the
deadline, the abort word) are the path's for its life.
"""

from __future__ import annotations

import ctypes

import torch

from warmlink.ep.kernels import host
from warmlink.ep.kernels.stream import StreamOutputs
from warmlink.ep.kernels.stream_cuda import THREADS, PreparedDispatch
from warmlink.ep.paths.senders import FreshSend
from warmlink.ep.wire.regions import board_words

__all__ = ["FreshPlan", "PreparedLaunch"]


class PreparedLaunch:
    """A streamed dispatch's launch made ready but for its outputs (``StreamPath.prepare_dispatch``):
    ``launch(out, starts)`` launches it and returns its ``recv_offset``."""

    __slots__ = ("_launch", "_from_board", "prepared")

    def __init__(self, launch, from_board=None, prepared: PreparedDispatch | None = None) -> None:
        self._launch, self._from_board = launch, from_board
        self.prepared = prepared  # the CUDA kernel's packed launch (ep.paths.planned keeps it), or None

    def __call__(self, out: StreamOutputs, starts: list[int] | None) -> torch.Tensor:
        return self._launch(out, starts)

    def from_board(self) -> tuple[StreamOutputs, torch.Tensor] | None:
        """``(outputs, recv_offset)`` of the launch made by the compiled host steps (ep.kernels.host)
        from the last exchange's board where it landed (the caller saw that exchange end); None
        where they do not run (then nothing was allocated or launched; ``recv_starts`` on the board
        raises what a late source or a count out of range means)."""
        return self._from_board() if self._from_board is not None else None


class FreshPlan:
    """One kind of fresh dispatch, planned (Note [Planned fresh dispatch]): unpadded (``front``, then
    ``launch_from_board``) or padded with ``call.num_worst_tokens`` rows (``padded``: the whole call).

    Args:
        compiled: ep.kernels.host's module.
        call: the kind's first planned call; prepared: its ``PreparedDispatch`` (the template).
        front: the mover's ``front_graph`` of the kind's shape.
        num_ranks, channels, device, rank, max_tokens: the path's.
        board_address: where the count board lands in pinned memory (an unpadded call reads it there).
    """

    __slots__ = ("_compiled", "_template", "_args", "_prepared", "_front_args", "_copy_args", "_board_args",
                 "_padded_args", "host_words")

    def __init__(self, compiled, call: FreshSend, prepared: PreparedDispatch, front, num_ranks: int, channels: int,
                 device: int, rank: int, max_tokens: int, board_address: int) -> None:
        nbytes = len(prepared.args)
        row_words = board_words(num_ranks)
        self._compiled = compiled
        self._template = ctypes.create_string_buffer(bytes(prepared.args), nbytes)
        self._args = ctypes.create_string_buffer(nbytes)  # every call's struct (each launched before the next)
        self._prepared = prepared.with_args(self._args, device)
        graph, call_address, abort_address, landing_address, event, self.host_words = front
        graph_launch, event_record = host.front_addresses()
        self._front_args = (call.config, num_ranks, channels, device, call_address, abort_address, landing_address,
                            graph, event)
        self._copy_args = (graph_launch, event_record, ctypes.addressof(self._template), ctypes.addressof(self._args),
                           nbytes)
        self._board_args = self._prepared.board_args(board_address, num_ranks, row_words, rank, max_tokens, call.src)
        src = call.src
        self._padded_args = (row_words, call.num_worst_tokens, src.x.shape[1],
                             src.topk.shape[1] if src.topk is not None else -1, src.weights is not None,
                             src.scales.shape[1] if src.scales is not None else 0, host.launch_address(),
                             prepared.kernel_address, prepared.grid, THREADS)

    def front(self, x, scales, topk, weights, in_rank, per_rank, per_expert, status_address: int, stream: int):
        """An unpadded call's count exchange launched on ``stream`` and its stream's launch packed,
        from its checked tensors (``x`` of any dtype: its rows and address are what count):
        ``(rows, taken, recv_offset)``; ``launch_from_board`` then launches it. Raises the
        driver's error of a failed launch (TransferError)."""
        rows, taken, recv_offset, error, step = self._compiled.planned_front(
            x, scales, topk, weights, in_rank, per_rank, per_expert, *self._front_args, stream, *self._copy_args,
            status_address)
        if error:
            _raise(error, step, stream)
        self._prepared.on(stream)
        return rows, taken, recv_offset

    def padded(self, call: FreshSend, status_address: int, stream: int):
        """A padded call whole, on ``stream``: its count exchange, the board's copy and its stream
        launched: ``(rows, taken, recv_offset, board copy, StreamOutputs)``. Raises the driver's
        error of a failed launch (TransferError)."""
        src = call.src
        rows, taken, recv_offset, board, *out, error, step = self._compiled.planned_padded(
            src.x, src.scales, src.topk, src.weights, call.in_rank, call.per_rank, call.per_expert, *self._front_args,
            stream, *self._copy_args, status_address, *self._padded_args)
        if error:
            _raise(error, step, stream)
        return rows, taken, recv_offset, board, StreamOutputs(*out)

    @property
    def prepared(self) -> PreparedDispatch:
        """The last ``front``'s launch (its ``launch`` is the Python way from the board)."""
        return self._prepared

    def launch_from_board(self):
        """``PreparedDispatch.launch_from_board``'s value for the last ``front``'s call (its
        arguments made once)."""
        return self._prepared.launch_planned(self._compiled, self._board_args)


def _raise(error: int, step: int, stream: int) -> None:
    from warmlink import _cuda

    what = ("cuGraphLaunch of the count exchange", "cuEventRecord", "cuLaunchKernel of the streamed dispatch")[step - 1]
    _cuda.check(error, f"{what} on stream {stream:#x}")
