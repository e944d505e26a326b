"""ep: MoE expert-parallel dispatch and combine over pre-registered regions.

``Buffer`` follows DeepEP's normal-mode API (``get_dispatch_layout``, ``dispatch``, ``combine``,
``return_recv_hook``, and the ``EventOverlap`` its calls return), and, built with
``low_latency_mode=True``, DeepEP's low-latency calls for decode (``ep.low_latency``, whose
dispatch returns a ``LowLatencyHandle``; kernels move those rows on GPUs, the host on shm).
``size_hint`` says how much memory a rank's buffer holds; ``fp8`` converts tokens to and from
the FP8 format dispatch accepts.

Who moves the bytes is chosen once per Buffer (``Buffer(send=...)``): on GPUs, by default, a
dispatch without a receive hook is sent by kernels that store the rows into the peers' memory
(``send="sm"``), or by the copy engines after the ranks meet on the host (``send="copy"``); a
dispatch with a hook, and every combine, by the copy engines, so no kernel stays resident while
the bytes move. On CPU (the shm backend) the host copies them (``send="host"``).

On GPUs a combine and a cached dispatch return at launch: the device, not the host, waits for the
peers' rows, on arrival flags in pinned memory (``ep._flags``); a fresh dispatch waits for its
counts, as DeepEP's does, unless its outputs are padded (``num_worst_tokens``): then, as DeepEP's,
it returns at launch too, and the next call brings its counts to the host (``ep._senders``, Note
[Padded dispatch returns at launch]). With ``async_finish=True`` a call runs on the
Buffer's communication stream, so the caller's stream is not ordered after it
(``ep._comm_stream``).
"""

from warmlink.ep._regions import size_hint
from warmlink.ep.buffer import Buffer
from warmlink.ep.event import EventOverlap
from warmlink.ep.handle import Handle
from warmlink.ep.layout import dispatch_layout
from warmlink.ep.low_latency import LowLatencyHandle

__all__ = ["Buffer", "EventOverlap", "Handle", "LowLatencyHandle", "dispatch_layout", "size_hint"]
