"""Refit: push trainer weights into inference ranks, any TP layout on either side.

``Publisher`` (trainer rank) and ``Receiver`` (inference rank) are the API; ``TensorLayout`` and
``Shard`` describe layouts; ``warmlink.refit.hf`` has the rules for Hugging Face Llama/Qwen2.
"""

from warmlink.refit.manifest import Part, Shard, TensorLayout
from warmlink.refit.publisher import Publisher
from warmlink.refit.receiver import CycleReport, Receiver, RefitHandle

__all__ = ["Publisher", "Receiver", "RefitHandle", "CycleReport", "TensorLayout", "Shard", "Part"]
