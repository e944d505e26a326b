"""ep.EventOverlap and previous_event on the host: DeepEP's event API, with nothing to wait for."""

from __future__ import annotations

import pytest
import torch

from warmlink.ep.paths.event import EventOverlap, wait_for
from warmlink.errors import ConfigError


def test_a_host_event_waits_for_nothing_and_a_cuda_event_that_was_not_asked_for_is_refused():
    host = EventOverlap(None, -1)
    host.current_stream_wait()
    with host as same:
        assert same is host
    assert repr(host) == "ep.EventOverlap(host, event=None)"
    with pytest.raises(ConfigError, match="without async_finish=True"):
        EventOverlap(None, 0).current_stream_wait()
    with EventOverlap(None, 0):  # DeepEP's context manager waits only when there is an event
        pass


def test_previous_event_takes_ours_or_none_and_names_anything_else():
    wait_for(None, "dispatch")
    wait_for(EventOverlap(None, 0), "dispatch")  # a call made without async_finish: nothing to wait for
    for bad in ("event", 3, torch.zeros(1)):
        with pytest.raises(ConfigError, match=f"ep.Buffer.combine: previous_event is a {type(bad).__name__}"):
            wait_for(bad, "combine")
