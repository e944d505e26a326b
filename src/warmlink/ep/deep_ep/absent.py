"""DeepEP's ``Buffer`` methods that ``deep_ep.Buffer`` does not offer: each raises ``ConfigError``
saying why, where an ``AttributeError`` would read like a typo in the caller's code."""

from __future__ import annotations

from warmlink.errors import ConfigError

__all__ = ["INTERNODE", "NO_RING", "not_here"]

INTERNODE = "warmlink.ep runs the ranks of one node"
NO_RING = ("warmlink has no ring buffer to expose: rows land in per-source slots of the receive area, and outputs "
           "are fresh tensors")


def not_here(name: str, why: str) -> staticmethod:
    """A static method ``name`` that raises ``ConfigError("deep_ep.Buffer.{name}: not supported; {why}")``."""

    def refuse(*args, **kwargs):
        raise ConfigError(f"deep_ep.Buffer.{name}: not supported; {why}")

    refuse.__name__ = name
    refuse.__doc__ = f"Not supported: {why}. Raises ConfigError."
    return staticmethod(refuse)
