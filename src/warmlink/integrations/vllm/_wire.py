"""What the trainer ranks and the vLLM workers tell each other through the store, as JSON.

# Note [Update records]
vLLM carries the client's calls to the workers but not their answers: a worker that raises reaches
the trainer as a string three wrappers deep, and a raise on one TP worker leaves the others'
answers queued in vLLM's executor (Note [One error per update] in ``worker``). So no worker raises
for a failure it can record. Each writes, under the trainer's session, one record per call:

* ``init/{w}``: the worker's state after ``init_weight_transfer_engine``: the update count it
  serves, whether a session of an earlier trainer is still open on it, or the error;
* ``update/{v}/{w}``: after ``update_weights({"version": v})``: staged whole, or the error;
* ``finish/{v}/{w}``: after ``finish_weight_update``: installed (and the count it now serves), or
  the error.

``w`` is the worker's index in the session, taken with ``add(workers, 1)`` at init (TP workers
of every data-parallel replica the client reaches). The trainer reads every record after the
client's call returned, and raises the first error as the warmlink error the worker raised
(``decode_error``: the class is looked up by name among warmlink's errors, nothing is unpickled),
once. Trainer ranks other than 0 get rank 0's outcome the same way, under ``done/{r}/{g}/{v}``.
"""

from __future__ import annotations

import json

from warmlink import errors
from warmlink.errors import MetadataError, TransferError, WarmlinkError

__all__ = ["encode_error", "decode_error", "dumps", "loads", "session_key", "done_key"]

_MAX_MESSAGE = 4000


def _error_classes() -> dict[str, type]:
    from warmlink.refit import PartialLoadError

    classes = {name: getattr(errors, name) for name in errors.__all__}
    classes["PartialLoadError"] = PartialLoadError
    return {n: c for n, c in classes.items() if isinstance(c, type) and issubclass(c, WarmlinkError)}


def encode_error(exc: BaseException) -> dict:
    """``exc`` as JSON: its warmlink class name (else ``TransferError``) and its message."""
    name = type(exc).__name__
    if not isinstance(exc, WarmlinkError) or name not in _error_classes():
        return {"type": "TransferError", "message": f"{name}: {exc}"[:_MAX_MESSAGE]}
    return {"type": name, "message": str(exc)[:_MAX_MESSAGE]}


def decode_error(obj, where: str) -> WarmlinkError:
    """The warmlink error an ``encode_error`` record names, its message prefixed with ``where``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str) or not isinstance(obj.get("message"), str):
        return MetadataError(f"{where}: an error record {obj!r} is malformed; expected {{'type': str, 'message': str}}")
    cls = _error_classes().get(obj["type"], TransferError)
    message = f"{where}: {obj['message'][:_MAX_MESSAGE]}"
    if cls.__name__ == "PartialLoadError":
        return cls(message, version=0, bucket_idx=0, num_buckets=0, handed=[])
    return cls(message)


def dumps(record: dict) -> str:
    return json.dumps(record, separators=(",", ":"), allow_nan=False)


def loads(raw: bytes, key: str, fields: dict[str, type]) -> dict:
    """A record read from ``key``: a JSON object whose listed ``fields`` have their types (None
    allowed); anything else is a MetadataError naming the key (the store is not trusted)."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise MetadataError(f"store key {key!r}: not JSON; expected a warmlink vLLM record") from None
    if not isinstance(obj, dict):
        raise MetadataError(f"store key {key!r}: {type(obj).__name__}; expected a JSON object")
    for name, kind in fields.items():
        value = obj.get(name)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
            raise MetadataError(f"store key {key!r}: field {name!r}={value!r}; expected {kind.__name__} or null")
    return obj


def session_key(session: str, *parts) -> str:
    return "/".join(["vllm", "session", session, *map(str, parts)])


def done_key(rank: int, generation: int, version: int) -> str:
    return f"vllm/done/{rank}/{generation}/{version}"
