"""Building an ep ``Buffer`` ends within its timeout while the store's server is stopped (SIGSTOP):
its rendezvous calls carry the Buffer's timeout (Note [Store deadlines] in
warmlink.rendezvous.store). A build that blocks past it plus ``MARGIN_S`` fails at once
(tests/_stalled.py)."""

from __future__ import annotations

import sys

import pytest
import torch.distributed  # noqa: F401 - its first import takes seconds: before any timed call

from tests._stalled import stoppable_server, times_out
from warmlink.rendezvous import Store

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="SIGSTOP and /proc: Linux")

LIMIT_S = 1.0


def test_buffer_creation_raises_within_its_timeout() -> None:
    from warmlink.ep import Buffer

    with stoppable_server("stall-ep") as server, \
            Store.connect(server.address, prefix=server.prefix, timeout_s=60, secret=server.secret) as store:
        Buffer(store, 0, 1, max_tokens_per_rank=8, hidden=128, num_topk=2, timeout_s=30).close()  # warm
        with server.stopped():
            times_out(lambda: Buffer(store, 0, 2, max_tokens_per_rank=8, hidden=128, num_topk=2, timeout_s=LIMIT_S),
                      LIMIT_S)
