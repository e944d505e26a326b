"""How a dispatch's rows reach their destinations: one ``Sender`` per Buffer, chosen once.

- ``HostSender`` (``send="host"``, the shm backend): the CPU stages the rows, the ranks meet in
  the mailboxes, then the CPU copies them into the peers' shared memory;
- ``CopyEngineSender`` (``send="copy"``, cuda_ipc): the same steps, the rows gathered by one
  kernel and moved by the copy engines (ep._cuda_mover, Note [Copy-engine sends]);
- ``SmSender`` (``send="sm"``, cuda_ipc, the default there): kernels trade the counts and store
  the rows into the peers (ep._kernels, Note [SM sends]). A call with a receive hook still goes
  through the copy engines: a push kernel would hold SMs between the send and the hook.

Each sends a fresh dispatch (``send_fresh``: plan, meet, move) and a cached one (``send_cached``:
the handle's plan, no meeting), and says whether a fresh call's rows move by SMs, which is part
of the config word every rank checks (``by_sm``). The round protocol around them is ep._rounds'.

# Note [Padded dispatch returns at launch]
A fresh SM dispatch used to wait on the host for its count board (Note [SM sends] in ep._kernels)
before returning: its outputs' row count, the unpack and the handle's plan come from the peers'
counts. With ``num_worst_tokens`` the outputs' shape is known at the call, so, as DeepEP's, it
returns at launch:

- its handle is pending (ep.handle, ``Handle.resolve``): the board is copied on the device, right
  after the exchange, into a tensor the handle keeps, and the counts reach the host when the
  Buffer's next call (or a reader of the counts) resolves it. That waits for this rank's exchange
  on the device, not for its push, and it comes before the next fresh send rewrites the call
  block, the board's and words' landing places and the event;
- the unpack reads the received row count from that copy on the device, and gives every row past
  it expert id -1 and weight 0 (ep._kernels.unpack, ``Padded``). A round any rank refused (a bad
  input, a late peer, a rank receiving more than ``num_worst_tokens`` rows) received nothing:
  every row is padding, so no expert sees a row of a refused round;
- the refusal itself is raised by the next call on every rank alike (each reads the same board),
  and by every use of the handle after it.

The copy-engine and host senders still meet the peers on the host first: they issue their copies
from the counts.

# Note [Refused dispatch]
A rank whose fresh dispatch fails its own checks (a bad shape, too many tokens, an expert id out
of range) must not just raise: its peers would wait for its counts until their timeout, and their
rounds would then no longer line up with its. So it takes part in the round without tokens,
marked refused (``FreshSend.refused``), and raises its reason after. Its config word is
``REFUSED`` (ep._call_config), so every peer that meets it raises ``ConfigError`` naming it; with
SM sends it also launches the count exchange with a count per rank that no row matches, so the
device refuses the round on every rank (the plan's valid flag, Note [SM sends] in ep._kernels):
no rank pushes a row, and a padded peer that returned at launch gets padding and raises at its
next call. The round is spent on every rank, and the next call works. A cached dispatch has no
meeting to refuse in: its bad arguments raise on that rank alone.
"""

from __future__ import annotations

import functools
import itertools
import time
from typing import NamedTuple, Protocol

import numpy as np
import torch

from warmlink.ep import _mailbox as mb
from warmlink.ep._call_block import FreshShape, Sources, call_words
from warmlink.ep._call_config import REFUSED
from warmlink.ep._checks import Checks
from warmlink.ep._kernels import plan
from warmlink.ep._regions import PARITIES, RegionLayout
from warmlink.ep._rounds import Rounds
from warmlink.ep.handle import Handle, plan_from_board
from warmlink.errors import ConfigError

__all__ = ["SENDERS", "CopyEngineSender", "FreshSend", "HostSender", "Sender", "SmSender", "StagedSender"]

_SERIALS = itertools.count()  # one per sender: keys what a handle caches about a Buffer's mappings


class FreshSend(NamedTuple):
    """A fresh dispatch, checked: its rows, routing and config word, and its round's names."""

    src: Sources
    in_rank: torch.Tensor
    per_rank: torch.Tensor
    per_expert: torch.Tensor
    num_experts: int
    config: int  # ep._call_config.encode_call
    num_worst_tokens: int
    round: int
    phase: str  # the round's event phase: "dispatch.<parity>"
    parts: tuple[str, str]  # the receive areas of the round's parity: x, meta
    refused: str | None = None  # why this rank refused its arguments: it sends no tokens (Note [Refused dispatch])


class Sender(Protocol):
    """What a Buffer's dispatch asks of its send path (module docstring)."""

    name: str

    def by_sm(self, hook: bool) -> bool:
        """Whether a fresh dispatch with (or without) a receive hook moves its rows by SMs."""

    def send_fresh(self, call: FreshSend, marks: dict, hook: bool) -> Handle:
        """Plan, trade the counts and issue the rows of ``call``; its handle. Adds host marks to ``marks``."""

    def send_cached(self, handle: Handle, src: Sources, round_: int, phase: str, parts: tuple[str, str],
                    hook: bool) -> None:
        """Issue every row where ``handle`` says, with no wait for the peers."""

    def resolve(self) -> None:
        """Resolve the last fresh dispatch's handle if it is still pending (Note [Padded dispatch returns at launch])."""

    def abandon(self) -> None:
        """At close: end a pending dispatch's count exchange on the device without waiting for it."""


class StagedSender:
    """Staged copies: gather, meet in the mailboxes, copy (Note [Copy-engine sends] in ep._cuda_mover),
    through ``mover``: a ``HostMover`` or a ``CudaMover``."""

    name = "staged"

    def __init__(self, mover, rounds: Rounds, checks: Checks, layout: RegionLayout, graphs: bool) -> None:
        self.mover, self.rounds, self.checks, self.layout = mover, rounds, checks, layout
        self.graphs = graphs  # replay the cached gather's push (ep._kernels, Note [Fresh send graph])
        self.serial = next(_SERIALS)

    def by_sm(self, hook: bool) -> bool:
        return False

    def resolve(self) -> None:
        """Nothing is pending: a staged fresh dispatch meets the peers before it returns."""

    def abandon(self) -> None:
        pass

    def send_fresh(self, call: FreshSend, marks: dict, hook: bool) -> Handle:
        """The counts go to the host, the ranks meet in the mailboxes, then the copies."""
        mover, rounds, src = self.mover, self.rounds, call.src
        if call.refused is not None:
            self._refuse(call, call.refused)
        rows, words = plan(call.in_rank, src.topk, call.per_rank, call.per_expert, self.layout.max_tokens)
        mover.start_to_host(words)
        marks["planned"] = time.perf_counter()
        # The peers' rows are gathered into staging while the counts travel to the host and the
        # ranks meet: that needs only this rank's own plan. See Note [Copy-engine sends].
        mover.begin()
        mover.gather(rows, src, range(rounds.num_ranks), rounds.rank)
        marks["launched"] = time.perf_counter()
        try:
            handle, send_counts, expert_counts = self._handle(mover.wait_host(rounds.timeout_s), call, rows, marks)
        except ConfigError as exc:  # expert ids or counts this rank's plan refused
            self._refuse(call, str(exc))
        rounds.wait_readers(call.round)  # before the counts of round n - 2 are replaced: Note [Mailbox rounds]
        rounds.mailbox.publish_dispatch(call.round, call.config, send_counts, expert_counts)
        try:
            rounds.meet(mb.DISPATCH, call.round)
            marks["met"] = time.perf_counter()
            rounds.complete_plan(handle, call.round)
        except ConfigError:  # every rank read the same words and counts and refused: the round is spent everywhere
            rounds.end("dispatch", call.round)
            raise
        marks["ready"] = time.perf_counter()
        mover.flush_all(call.phase, src, call.parts,
                        [(d, handle.dst_rows[d], handle.send_counts[d]) for d in rounds.order()])
        me = rounds.rank
        mover.place_local(handle.combine_rows, src, call.parts, handle.dst_rows[me] - me * self.layout.max_tokens)
        mover.flush(me, call.phase, src, 0, 0, call.parts)
        return handle

    def _refuse(self, call: FreshSend, reason: str):
        """Publish ``call``'s round as refused, spend it, and raise ``reason`` (Note [Refused dispatch])."""
        rounds, num_ranks = self.rounds, self.rounds.num_ranks
        rounds.wait_readers(call.round)
        rounds.mailbox.publish_dispatch(call.round, REFUSED, np.zeros(num_ranks, np.int64),
                                        np.zeros(call.num_experts, np.int64))
        rounds.end("dispatch", call.round)
        raise ConfigError(reason)

    def send_cached(self, handle: Handle, src: Sources, round_: int, phase: str, parts: tuple[str, str],
                    hook: bool) -> None:
        """One gather for every destination, this rank's own rows included, then the copies: a
        launch per peer cost a slow rank's host up to 0.15 ms more before its last copy, and
        every peer waits for that copy."""
        mover, me = self.mover, self.rounds.rank
        mover.begin(copies=False)  # the copies wait for the gather, which follows the start
        mover.gather_all(handle.combine_rows, src, parts, handle.dst_rows[me] - me * self.layout.max_tokens,
                         round_ % PARITIES, self.rounds.timeout_s, self.graphs)
        mover.gate("dispatch", round_, sm=False)  # no peer meets a cached dispatch: Note [Arrival flags] in ep._flags
        mover.flush_all(phase, src, parts, [(d, handle.dst_rows[d], handle.send_counts[d])
                                            for d in (*self.rounds.order(), me)])

    def _handle(self, words: np.ndarray, call: FreshSend, rows: torch.Tensor, marks: dict):
        """``(handle, send counts, per-expert counts)`` of a fresh dispatch from its plan's words,
        checked first (ep._checks: ``ConfigError`` before any byte moved)."""
        num_tokens = call.src.x.shape[0]
        send_counts, expert_counts = self.checks.counts(words, num_tokens, call.num_experts)
        handle = Handle(call.num_experts, num_tokens, call.in_rank, rows, send_counts.tolist(),
                        num_topk=call.src.topk.shape[1], round=call.round, num_worst_tokens=call.num_worst_tokens)
        marks["counts"] = time.perf_counter()
        return handle, send_counts, expert_counts


class HostSender(StagedSender):
    """``StagedSender``'s steps by the CPU, over shared memory (``mover`` is a ``HostMover``)."""

    name = "host"


class CopyEngineSender(StagedSender):
    """``StagedSender``'s steps on CUDA: one gather kernel, then the copy engines move the bytes
    (``mover`` is a ``CudaMover``)."""

    name = "copy"


class SmSender(CopyEngineSender):
    """Kernels trade the counts and store every row (ep._kernels, Note [SM sends]); with a receive
    hook, ``CopyEngineSender``'s steps."""

    name = "sm"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.unresolved: Handle | None = None  # the last padded dispatch's, until resolved

    def by_sm(self, hook: bool) -> bool:
        return not hook

    def resolve(self) -> None:
        handle, self.unresolved = self.unresolved, None
        if handle is not None:
            handle.resolve()

    def abandon(self) -> None:
        handle, self.unresolved = self.unresolved, None
        if handle is not None and handle.pending is not None:
            self.mover.abort_exchange(handle.round)

    def send_fresh(self, call: FreshSend, marks: dict, hook: bool) -> Handle:
        """The plan, count exchange and push on the caller's stream; then the handle from the board,
        or, with ``num_worst_tokens``, a pending handle (Note [Padded dispatch returns at launch])."""
        if hook:
            return super().send_fresh(call, marks, hook)
        if call.refused is not None:
            self._send_refused(call, marks)
        mover, rounds, src, round_ = self.mover, self.rounds, call.src, call.round
        rows = torch.empty(src.x.shape[0], rounds.num_ranks, dtype=torch.int64, device=src.x.device)  # the handle's
        in_rank, per_rank, per_expert = (t.contiguous() for t in (call.in_rank, call.per_rank, call.per_expert))
        call = call._replace(in_rank=in_rank, per_rank=per_rank, per_expert=per_expert)
        padded = bool(call.num_worst_tokens)
        board = mover.board_like() if padded else None
        # before the launch: a first call compiles its kernels there (seconds), and a peer that
        # called the other kind must see this call's kind before its wait for it ends
        rounds.wait_readers(round_)  # Note [Mailbox rounds]
        rounds.mailbox.publish_dispatch(round_, call.config)
        mover.send_sm(self._shape(call), call_words(in_rank, src.topk, per_rank, per_expert, rows, src, round_, call.config), round_,
                      call.phase, rounds.timeout_s, self.graphs, board_copy=board)
        marks["planned"] = marks["launched"] = time.perf_counter()
        handle = Handle(call.num_experts, src.x.shape[0], call.in_rank, rows, None, num_topk=src.topk.shape[1],
                        round=round_, num_worst_tokens=call.num_worst_tokens, board=board)
        if padded:
            handle.pending = functools.partial(self._complete, handle, call)
            self.unresolved = handle
            marks["counts"] = marks["met"] = marks["ready"] = time.perf_counter()
        else:
            self._complete(handle, call, marks)
        return handle

    def _send_refused(self, call: FreshSend, marks: dict):
        """Launch ``call`` (no tokens, counts no row matches: the device refuses the round on every
        rank), wait for its exchange, and raise its reason (Note [Refused dispatch])."""
        try:  # unpadded: waited for here, so nothing stays pending
            self.send_fresh(call._replace(refused=None, num_worst_tokens=0), marks, False)
        except ConfigError:  # the device's refusal of this very round, which _complete spent
            pass
        raise ConfigError(call.refused)

    def _complete(self, handle: Handle, call: FreshSend, marks: dict | None = None) -> None:
        """Fill ``handle``'s plan in from the board of its round, waited for on the host; a refusal
        spends the round on every rank (each read the same board)."""
        mover, rounds, round_ = self.mover, self.rounds, call.round
        marks = {} if marks is None else marks
        try:
            words, board = mover.wait_board(round_, rounds.timeout_s, lambda: rounds.check_peer_configs(
                round_, call.config, rounds.mailbox.published(mb.DISPATCH, round_)))
            handle.send_counts = self.checks.counts(words, handle.num_tokens, call.num_experts)[0].tolist()
            marks["counts"] = time.perf_counter()
            rounds.meet(mb.DISPATCH, round_)
            marks["met"] = time.perf_counter()
            plan_from_board(handle, board, round_, rounds.rank, self.layout.max_tokens)
        except ConfigError:  # every rank's board showed the same refusal: the round is spent everywhere
            rounds.end("dispatch", round_)  # (a padded round was ended when it was sent)
            raise
        marks["ready"] = time.perf_counter()

    def send_cached(self, handle: Handle, src: Sources, round_: int, phase: str, parts: tuple[str, str],
                    hook: bool) -> None:
        """One push kernel at bases made once per handle, parity and row size."""
        if hook:
            super().send_cached(handle, src, round_, phase, parts, hook)
            return
        mover = self.mover
        mover.begin(copies=False)  # the SMs push
        mover.gate("dispatch", round_, sm=True)
        key = (self.serial, round_ % PARITIES, src.x.shape[1])  # addresses of this Buffer's mappings
        bases = handle.sm_bases.get(key)
        if bases is None:
            bases = handle.sm_bases[key] = mover.sm_bases(handle.dst_rows, key[1], src.x.shape[1] * src.x.element_size())
        mover.send_sm_cached(handle.combine_rows, src, bases, key[1], phase, self.rounds.timeout_s, self.graphs)

    def _shape(self, call: FreshSend) -> FreshShape:
        """What a fresh SM send's kernels are specialized for (its graphs' key, with the parity)."""
        lay, src = self.layout, call.src
        return FreshShape(self.rounds.num_ranks, call.num_experts, src.topk.shape[1], src.x.shape[1],
                          src.scales.shape[1] if src.scales is not None else 0, lay.max_tokens, lay.num_topk,
                          lay.meta_bytes, src.topk.dtype, call.per_rank.dtype, call.per_expert.dtype,
                          src.weights.dtype if src.weights is not None else None)


SENDERS = {"sm": SmSender, "copy": CopyEngineSender, "host": HostSender}  # by ep._options.SENDS
