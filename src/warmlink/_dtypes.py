"""Dtype names as they travel on the wire, and their sizes. No torch import at module load."""

from __future__ import annotations

from warmlink.errors import MetadataError

__all__ = ["DTYPE_SIZES", "dtype_size", "dtype_name", "torch_dtype"]

# Wire name -> bytes per element. Names are torch's attribute names.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def dtype_size(name: str) -> int:
    """Bytes per element of the wire dtype ``name``; MetadataError for unknown names."""
    try:
        return DTYPE_SIZES[name]
    except (KeyError, TypeError):
        raise MetadataError(f"dtype={name!r} is unknown; expected one of {sorted(DTYPE_SIZES)}") from None


def dtype_name(dtype) -> str:
    """Wire name of a ``torch.dtype`` (``torch.bfloat16`` -> ``"bfloat16"``)."""
    name = str(dtype).removeprefix("torch.")
    dtype_size(name)
    return name


def torch_dtype(name: str):
    """``torch.dtype`` for a wire name; MetadataError for unknown names."""
    import torch

    dtype_size(name)
    return getattr(torch, name)
