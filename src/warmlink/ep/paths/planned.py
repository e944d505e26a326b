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
records the board's event, patches a copy of the template and launches the stream behind the
exchange in one C++ call; then, once the board is in, one more makes the outputs and posts them
to the stream (Note [Posted outputs]). A padded call (``num_worst_tokens``, a plan per kind and
value) waits for no board: one C++ call does all of it, the board's copy and the outputs
included, and launches the stream, which takes its offsets from the copy on the device. What the host keeps (the status slots, the
failures, the handle) stays in Python, after the launch where it can.

A plan holds the exchange's graph handle, which the mover keeps until it closes, and is dropped
with the path; the template's constant fields (the space's bases, the seq and valid words, the
deadline, the abort word) are the path's for its life.

# Note [Posted outputs]
Why: an unpadded fresh dispatch's outputs are sized by the board (the rows this rank receives), so
the host reads it before it can make them; launched after that, the stream started 40-80 us after
the exchange ended on 2 x H200 (the host waking, reading, allocating and launching; the slower
rank's host most), and every GPU idled through it. DeepEP's dispatch waits the same way. Here the
stream is launched with the exchange (``planned_front``) and its senders start as the board
lands on the device: the rings hold 128 rows a channel and source, over half of a 4096-token
call at 2 ranks, so most of what the host takes is hidden behind bytes already moving. Its
receivers wait (thread 0 of each program, with the deadline and abort word of any wait) for the
host to post the outputs into a block of pinned memory the path owns: the outputs' addresses and
where each source's rows start, a tag stored last (``host.cpp``'s ``post_outputs``; stream.cu's
``take_posted``). A tag per launch (the block's second word counts them) keeps a launch from
taking a post meant for another: one whose host failed before posting waits out its deadline or
the clear's abort. A board the host will not size outputs from (a late source, a count out of
range: the call raises) is posted void, as is a call that fails on the host in between: the
receivers then take the rows and store none, so the peers' senders end. The post comes only once
the board landed, after every earlier launch on the stream ended, so no launch still reads the
block. The outputs are allocated on the caller's stream after the kernel that writes them was
queued there; nothing is queued on it in between, so memory the allocator hands back was last used
by work queued before that kernel, which the stream runs first.
"""

from __future__ import annotations

import ctypes

import torch

from warmlink.ep.kernels import host
from warmlink.ep.kernels.stream import StreamOutputs
from warmlink.ep.kernels.stream_cuda import THREADS, PreparedDispatch
from warmlink.ep.paths.senders import FreshSend
from warmlink.ep.wire.regions import board_words

__all__ = ["POSTED_WORDS", "FreshPlan", "PreparedLaunch"]

POSTED_WORDS = 16  # the posted outputs block: tag, launched tag, 4 addresses, starts[0..R] (stream.cu's Posted)


class PreparedLaunch:
    """A streamed dispatch's launch made ready but for its outputs (``StreamPath.prepare_dispatch``):
    ``launch(out, starts)`` launches it and returns its ``recv_offset``. A planned call's, launched
    already, takes its outputs posted instead (``from_board``; Note [Posted outputs])."""

    __slots__ = ("_launch", "_from_board", "_abandon", "prepared")

    def __init__(self, launch, from_board=None, prepared: PreparedDispatch | None = None, abandon=None) -> None:
        self._launch, self._from_board, self._abandon = launch, from_board, abandon
        self.prepared = prepared  # the CUDA kernel's packed launch (ep.paths.planned keeps it), or None

    def __call__(self, out: StreamOutputs, starts: list[int] | None) -> torch.Tensor:
        return self._launch(out, starts)

    def from_board(self) -> tuple[StreamOutputs, torch.Tensor, tuple | None] | None:
        """``(outputs, recv_offset, plan)`` of the launch made (or posted) by the compiled host steps
        (ep.kernels.host) from the last exchange's board where it landed (the caller saw that
        exchange end; ``plan``: ``FreshPlan.post_outputs``' where it read it, else None); None
        where they do not run (then nothing was allocated or launched, or a void post went out;
        ``recv_starts`` on the board raises what a late source or a count out of range means)."""
        return self._from_board() if self._from_board is not None else None

    def abandon(self) -> None:
        """A call that fails on the host before ``from_board``: a launch already waiting for its
        outputs gets a void post (its receivers take their rows and store none)."""
        if self._abandon is not None:
            self._abandon()


class FreshPlan:
    """One kind of fresh dispatch, planned (Note [Planned fresh dispatch]): unpadded (``front``, then
    ``post_outputs``: Note [Posted outputs]) or padded with ``call.num_worst_tokens`` rows
    (``padded``: the whole call).

    Args:
        compiled: ep.kernels.host's module.
        call: the kind's first planned call; prepared: its ``PreparedDispatch`` (the template).
        front: the mover's ``front_graph`` of the kind's shape.
        num_ranks, channels, device, rank, max_tokens: the path's.
        board_address: where the count board lands in pinned memory (an unpadded call reads it there).
        posted_address: the path's posted outputs block (pinned memory; Note [Posted outputs]).
    """

    __slots__ = ("_compiled", "_template", "_args", "_front_args", "_copy_args", "_launch_args", "_post_args",
                 "_padded_args", "posted_address", "host_words")

    def __init__(self, compiled, call: FreshSend, prepared: PreparedDispatch, front, num_ranks: int, channels: int,
                 device: int, rank: int, max_tokens: int, board_address: int, posted_address: int) -> None:
        nbytes = len(prepared.args)
        src = call.src
        num_k = src.topk.shape[1] if src.topk is not None else -1
        num_scales = src.scales.shape[1] if src.scales is not None else 0
        self._compiled, self.posted_address = compiled, posted_address
        self._template = ctypes.create_string_buffer(bytes(prepared.args), nbytes)
        self._args = ctypes.create_string_buffer(nbytes)  # every call's struct (each launched before the next)
        graph, call_address, abort_address, landing_address, event, self.host_words = front
        graph_launch, event_record = host.front_addresses()
        self._front_args = (call.config, num_ranks, channels, device, call_address, abort_address, landing_address,
                            graph, event)
        self._copy_args = (graph_launch, event_record, ctypes.addressof(self._template), ctypes.addressof(self._args),
                           nbytes)
        self._launch_args = (host.launch_address(), prepared.kernel_address, prepared.grid, THREADS)
        self._post_args = (board_address, num_ranks, board_words(num_ranks), rank, max_tokens, src.x.shape[1], num_k,
                           src.weights is not None, num_scales, device, posted_address, call.num_experts // num_ranks)
        self._padded_args = (board_words(num_ranks), call.num_worst_tokens, src.x.shape[1], num_k,
                             src.weights is not None, num_scales, *self._launch_args)

    def front(self, x, scales, topk, weights, in_rank, per_rank, per_expert, status_address: int, stream: int):
        """An unpadded call's count exchange and its stream launched on ``stream``, from its checked
        tensors (``x`` of any dtype: its rows and address are what count), the stream's receivers
        waiting for ``post_outputs``: ``(rows, taken, recv_offset)``. Raises the driver's error of a
        failed launch (TransferError)."""
        rows, taken, recv_offset, error, step = self._compiled.planned_front(
            x, scales, topk, weights, in_rank, per_rank, per_expert, *self._front_args, stream, *self._copy_args,
            status_address, self.posted_address, *self._launch_args)
        if error:
            _raise(error, step, stream)
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

    def post_outputs(self) -> tuple[tuple, list[int], tuple | None] | None:
        """The last ``front``'s outputs made from its board where it landed and posted to its
        stream: ``((x, idx, weights, scales), starts, plan)``, ``plan`` the handle's (``(round,
        count matrix, received rows per local expert, the matrix summed over the sources on the
        device)``, None for a refused round); None where the board has a late source or a count
        out of range (posted void: ``recv_starts`` on the board raises what is wrong)."""
        status, starts, *outputs, plan = self._compiled.post_outputs(*self._post_args)
        return (outputs, starts, plan) if status == host.LAUNCHED else None

    def post_void(self) -> None:
        """A void post for the last ``front``'s stream: its receivers take their rows and store
        none (a call that fails on the host between its launch and its post)."""
        self._compiled.post_void(self.posted_address, self._post_args[1])


def _raise(error: int, step: int, stream: int) -> None:
    from warmlink import _cuda

    what = ("cuGraphLaunch of the count exchange", "cuEventRecord", "cuLaunchKernel of the streamed dispatch")[step - 1]
    _cuda.check(error, f"{what} on stream {stream:#x}")
