"""Suite-wide settings.

Hypothesis keeps no example database and draws from a fixed seed, so a run's outcome depends
only on the code: CI never fails on one unlucky draw that the next run does not repeat. To search
further, run with ``--hypothesis-profile=explore`` (fresh random draws each run); a failure is
reported with its reproducing blob.
"""

import pytest
from hypothesis import settings

settings.register_profile("warmlink", database=None, print_blob=True, derandomize=True)
settings.register_profile("explore", database=None, print_blob=True)
settings.load_profile("warmlink")


@pytest.fixture
def store_sync(monkeypatch):
    """Receivers of this process cannot open publishers' version boards, as receivers on another
    host cannot: they count themselves in through the store's reader counts (Note [Version board]
    in warmlink.refit._board, Note [Version protocol] in warmlink.refit.protocol)."""
    from warmlink.refit import _board

    monkeypatch.setattr(_board.ReaderBoard, "open", classmethod(lambda cls, *args: None))
