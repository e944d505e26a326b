"""warmlink as a vLLM weight-transfer backend: ``--weight-transfer-config '{"backend": "warmlink"}'``.

``pip install warmlink[vllm]`` installs the plugin: vLLM loads ``register`` through its
``vllm.general_plugins`` entry point in every process it starts, and ``register`` adds backend
``"warmlink"`` to both factories (``WeightTransferEngineFactory`` for the workers,
``WeightTransferTrainerFactory`` for the trainer). Importing a trainer-side name from here
(``WarmlinkTrainerInitInfo``) registers too, so a trainer process that never starts vLLM finds the
backend. Importing ``warmlink`` or this package imports no vLLM; the names below load it lazily.

* ``worker``: ``WarmlinkWeightTransferEngine`` pulls each version into the live model, in place
  where the module allows and streamed through ``load_weights`` elsewhere (Note [vLLM update]);
  layouts are read from the live modules (Note [Live vLLM layouts] in ``_live``).
* ``trainer``: ``WarmlinkTrainerWeightTransferEngine`` publishes local shards and drives the
  workers (Note [vLLM send]); ``WarmlinkTrainerInitInfo``, ``WarmlinkSource``.
* ``clients``: ``ConnectionClient`` / ``serve_client``: the client protocol over a
  ``multiprocessing`` connection, for trainer processes beside an ``LLM`` in the driver.
"""

from __future__ import annotations

import importlib

__all__ = ["BACKEND", "register", "WarmlinkTrainerInitInfo", "WarmlinkTrainerWeightTransferEngine", "WarmlinkSource",
           "WarmlinkWeightTransferEngine", "WarmlinkInitInfo", "ConnectionClient", "serve_client"]

#: The backend name in ``--weight-transfer-config``.
BACKEND = "warmlink"

_LAZY = {"WarmlinkTrainerInitInfo": "trainer", "WarmlinkTrainerWeightTransferEngine": "trainer",
         "WarmlinkSource": "trainer", "WarmlinkWeightTransferEngine": "worker", "WarmlinkInitInfo": "worker",
         "ConnectionClient": "clients", "serve_client": "clients"}


def register() -> None:
    """Add backend ``"warmlink"`` to vLLM's worker and trainer factories (the plugin entry point).

    Idempotent: vLLM may load plugins more than once per process. Imports only vLLM's factory
    module; the engines load when vLLM first creates one.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, f"{__name__}.worker", "WarmlinkWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, f"{__name__}.trainer", "WarmlinkTrainerWeightTransferEngine")


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    if module == "trainer":
        register()
    return value
