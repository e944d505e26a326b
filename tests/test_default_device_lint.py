"""Every tensor the library makes names its device, so that a caller's ``torch.set_default_device``
(DeepEP's harness and many trainers set "cuda") never moves the library's host memory: pinned host
words cannot be pinned on a GPU, and a CPU generator cannot fill a GPU tensor.

``warmlink.bench`` is left out: its commands run in processes of their own, which set no default
device. Factories that copy another tensor's device (``*_like``) need no device.
"""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "warmlink"
FACTORIES = {"empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "linspace", "eye", "rand", "randn",
             "randint", "randperm", "empty_strided"}


def test_every_tensor_factory_call_names_its_device():
    unnamed = []
    for path in sorted(SRC.rglob("*.py")):
        if path.relative_to(SRC).parts[0] == "bench":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                    and not any(k.arg == "device" for k in node.keywords)):
                unnamed.append(f"{path.relative_to(SRC.parent)}:{node.lineno}: {ast.unparse(node)[:100]}")
    assert not unnamed, "tensor factories without device= (pass device=\"cpu\" for host memory):\n" + "\n".join(unnamed)
