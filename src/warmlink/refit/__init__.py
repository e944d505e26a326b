"""Refit: push trainer weights into inference ranks, any TP layout on either side.

``Publisher`` (trainer rank) and ``Receiver`` (inference rank) are the API; ``TensorLayout``,
``Part`` and ``Shard`` describe layouts (``refit.manifest``). Layouts come from their owner:
DTensor placements (``refit.dtensor``, read by ``add_module``) or, for ranks without them, a named
framework convention (``warmlink.refit.families``: ``hf``, ``vllm``, ``megatron``). ``FanOut``
makes engine replicas take each version from each other (``refit.fanout``).
"""

from warmlink.refit.fanout import FanOut
from warmlink.refit.manifest import Part, Shard, TensorLayout
from warmlink.refit.publisher import Publisher
from warmlink.refit.receiver import CycleReport, PartialLoadError, Receiver, RefitHandle, StreamReport

__all__ = ["Publisher", "Receiver", "FanOut", "RefitHandle", "CycleReport", "StreamReport", "PartialLoadError",
           "TensorLayout", "Shard", "Part"]
