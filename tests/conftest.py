"""Suite-wide settings.

Hypothesis keeps no example database: a failure found on one machine is reported with its
reproducing blob, but never replayed on the next run, so a run's outcome depends only on the code.
"""

import pytest
from hypothesis import settings

settings.register_profile("warmlink", database=None, print_blob=True)
settings.load_profile("warmlink")


@pytest.fixture
def store_sync(monkeypatch):
    """Receivers of this process cannot open publishers' version boards, as receivers on another
    host cannot: they count themselves in through the store's reader counts (Note [Version board]
    in warmlink.refit._board, Note [Version protocol] in warmlink.refit.protocol)."""
    from warmlink.refit import _board

    monkeypatch.setattr(_board.ReaderBoard, "open", classmethod(lambda cls, *args: None))
