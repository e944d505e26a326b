"""What every engine (refit publisher and receiver, ep buffer) does at the end of its life: an
idempotent ``close()``, a context manager, and a ``__del__`` that warns and closes."""

from __future__ import annotations

import sys
import warnings

__all__ = ["Closing"]


class Closing:
    """Context manager calling ``close()``; ``__del__`` warns (ResourceWarning) and closes.

    Subclasses define ``close()`` (idempotent) and keep ``_closed`` and ``_link`` attributes: an
    engine that never leased a link holds nothing and is collected silently.
    """

    def close(self) -> None:  # pragma: no cover - always overridden
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self, _finalizing=sys.is_finalizing) -> None:  # bound now: module globals are gone at exit
        if getattr(self, "_closed", True) or getattr(self, "_link", None) is None or _finalizing():
            return
        warnings.warn(f"{self!r} was not closed; call close() or use it as a context manager", ResourceWarning, stacklevel=2)
        try:
            self.close()
        except Exception:
            pass
