"""ep: MoE expert-parallel dispatch and combine over pre-registered regions moved by copy engines.

``Buffer`` follows DeepEP's normal-mode API (``get_dispatch_layout``, ``dispatch``, ``combine``,
``return_recv_hook``); ``size_hint`` says how much memory a rank's buffer holds; ``fp8`` converts
tokens to and from the FP8 format dispatch accepts.
"""

from warmlink.ep._regions import size_hint
from warmlink.ep.buffer import Buffer, Handle
from warmlink.ep.layout import dispatch_layout

__all__ = ["Buffer", "Handle", "dispatch_layout", "size_hint"]
