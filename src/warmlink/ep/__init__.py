"""ep: MoE expert-parallel dispatch and combine over pre-registered regions.

``Buffer`` follows DeepEP's normal-mode API (``get_dispatch_layout``, ``dispatch``, ``combine``,
``return_recv_hook``, and the ``EventOverlap`` its calls return), and, built with
``low_latency_mode=True``, DeepEP's low-latency calls for decode (``ep.low_latency``, whose
dispatch returns a ``LowLatencyHandle``; kernels move those rows on GPUs, the host on shm).
``size_hint`` says how much memory a rank's buffer holds; ``ep.wire.fp8`` converts tokens to and
from the FP8 format dispatch accepts.

Who moves the bytes is chosen once per Buffer (``Buffer(send=...)``): on GPUs, by default, a
dispatch without a receive hook is sent by kernels that store the rows into the peers' memory
(``send="sm"``), or by the copy engines after the ranks meet on the host (``send="copy"``); a
dispatch with a hook, and every combine, by the copy engines, so no kernel stays resident while
the bytes move. A streamed Buffer (``send="stream"``) moves dispatches and combines alike through a
fixed space the GPUs pace, whatever the batch (``ep.protocol.streamed``, Note [Streamed calls]):
what ``deep_ep`` builds within a small budget. On CPU (the shm backend) the host copies them
(``send="host"``).

On GPUs a combine and a cached dispatch return at launch: the device, not the host, waits for the
peers' rows, on arrival flags in pinned memory (``ep.wire.flags``); a fresh dispatch waits for its
counts, as DeepEP's does, unless its outputs are padded (``num_worst_tokens``): then, as DeepEP's,
it returns at launch too, and the next call brings its counts to the host (``ep.protocol.normal``, Note
[Padded dispatch returns at launch]). With ``async_finish=True`` a call runs on the
Buffer's communication stream, so the caller's stream is not ordered after it
(``ep.paths.comm_stream``).

Where things are, from the call down (a folder imports only folders below it):

- ``api``: ``Buffer``, the facade: it checks a call, picks its stream, and hands it on;
- ``low_latency``: DeepEP's low-latency calls, a runtime of their own;
- ``protocol``: ``NormalMode`` (protocol/normal.py), which runs each normal-mode round's steps,
  the mailbox meetings (Note [Round protocol]) and the argument checks; ``StreamedMode``
  (protocol/streamed.py), a streamed Buffer's calls;
- ``paths``: where the bytes move: the data path chosen once (SMs, copy engines, host copies),
  the combine, the streams, and what a Buffer leases once;
- ``wire``: what the ranks share and read: region layout, mailboxes, arrival flags, call words,
  the handle's plan, the FP8 format;
- ``kernels``: the device steps (Triton on CUDA, torch elsewhere);
- ``deep_ep``: DeepEP's own API over ``Buffer``, so DeepEP code runs unchanged.

A dispatch's bytes: ``Buffer.dispatch`` -> ``NormalMode.dispatch`` -> the path's ``send_cached``
or, for a fresh one, ``NormalMode.send_fresh`` -> ``SmPath.launch`` / ``StagedPath.send_planned``;
on a streamed Buffer ``StreamedMode.dispatch`` -> ``StreamPath.dispatch`` (ep.paths.streamed).
"""

from warmlink.ep.api.buffer import Buffer
from warmlink.ep.kernels.layout import dispatch_layout
from warmlink.ep.low_latency import LowLatencyHandle
from warmlink.ep.paths.event import EventOverlap
from warmlink.ep.wire.handle import Handle
from warmlink.ep.wire.regions import size_hint
from warmlink.ep.wire.words import RefusedRound

__all__ = ["Buffer", "EventOverlap", "Handle", "LowLatencyHandle", "RefusedRound", "dispatch_layout", "size_hint"]
