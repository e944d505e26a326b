"""``import deep_ep`` as ``warmlink.ep.deep_ep``: put this folder first on ``PYTHONPATH`` to run
DeepEP's own tests, unchanged, against warmlink (``tools/device_run.sh deepep-tests``).

``WARMLINK_DEEP_EP_BUDGET=hint`` replaces every ``num_nvl_bytes`` a caller passes with DeepEP's
size hint for the group (its recommended configs' largest ``get_nvl_buffer_size_hint`` at the
widest hidden size DeepEP's tests use), so that the same unchanged tests run within the budget
Megatron and SGLang pass."""

import os
import sys

import warmlink.ep.deep_ep as _drop_in

if os.environ.get("WARMLINK_DEEP_EP_BUDGET") == "hint":
    _Buffer = _drop_in.Buffer

    class _HintBudget(_Buffer):
        def __init__(self, group, num_nvl_bytes=0, *args, **kwargs):
            if num_nvl_bytes:
                n = group.size()
                num_nvl_bytes = max(c.get_nvl_buffer_size_hint(7168 * 2, n)
                                    for c in (_Buffer.get_dispatch_config(n), _Buffer.get_combine_config(n)))
            super().__init__(group, num_nvl_bytes, *args, **kwargs)

    _HintBudget.__name__ = _HintBudget.__qualname__ = "Buffer"
    _drop_in.Buffer = _HintBudget

sys.modules[__name__] = _drop_in
