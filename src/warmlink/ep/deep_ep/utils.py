"""``deep_ep.utils``: the event classes where DeepEP-based code imports them
(``from deep_ep.utils import EventHandle, EventOverlap``)."""

from __future__ import annotations

from warmlink.ep.deep_ep.events import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
