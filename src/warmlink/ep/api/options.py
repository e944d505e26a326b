"""How a Buffer moves its bytes, chosen once per Buffer: each from its constructor argument, else
a default (the environment's, through ``warmlink._env``, where the backend uses it).

Every value is checked before anything is leased; a bad one raises ``ConfigError`` naming the
argument and the valid choices.
"""

from __future__ import annotations

from typing import NamedTuple

from warmlink import _env
from warmlink.ep.kernels.reduce import PARTS
from warmlink.errors import ConfigError

__all__ = ["COPY_STREAMS", "SENDS", "Options", "resolve_device", "resolve_options", "resolve_stream", "stream_defaults"]

SENDS = ("sm", "copy", "host", "stream")  # ep.paths.senders.PATHS's keys, and ep.paths.streamed's
COPY_STREAMS = ("one", "per-peer")


class Options(NamedTuple):
    send: str  # ep.paths.senders: "sm", "copy", "stream" (cuda_ipc) or "host" (shm)
    graphs: bool  # replay send launches as CUDA graphs (ep.paths.sm_pushes, Note [Fresh send graph])
    copy_streams: str  # "one" copy stream for every destination, or "per-peer"
    combine_parts: int  # ep.kernels.reduce, Note [Pipelined combine]


def resolve_device(device, backend: str | None) -> int:
    """The Buffer's CUDA device index, or -1 for host memory (``backend="shm"`` or no CUDA)."""
    import torch

    if device is not None:
        return device.index if isinstance(device, torch.device) else int(device)
    if backend == "shm" or not torch.cuda.is_available():
        return -1
    return torch.cuda.current_device()


def resolve_options(num_ranks: int, backend: str, send: str | None = None, graphs: bool | None = None,
                    copy_streams: str | None = None, combine_parts: int | None = None) -> Options:
    """The Buffer's ``Options``: each argument that is not None, else its default. On cuda_ipc the
    defaults are ``WARMLINK_EP_SEND``, ``WARMLINK_EP_GRAPH`` and ``WARMLINK_EP_COPY_STREAMS``;
    elsewhere host copies, which use none of them (the variables are not read)."""
    cuda = backend == "cuda_ipc"
    if send is not None and send not in SENDS:
        raise ConfigError(f"ep.Buffer: send={send!r} is unknown; expected one of {list(SENDS)} (or None: "
                          "'host' on shm, WARMLINK_EP_SEND on cuda_ipc)")
    if send is not None and (send == "host") == cuda:
        fits = ["sm", "copy", "stream"] if cuda else ["host"]
        raise ConfigError(f"ep.Buffer: send={send!r} does not fit backend={backend!r}; expected one of {fits}")
    if graphs is not None and not isinstance(graphs, bool):
        raise ConfigError(f"ep.Buffer: graphs={graphs!r}; expected True, False or None (None: WARMLINK_EP_GRAPH)")
    if copy_streams is not None and copy_streams not in COPY_STREAMS:
        raise ConfigError(f"ep.Buffer: copy_streams={copy_streams!r} is unknown; expected one of {list(COPY_STREAMS)} "
                          "(or None: WARMLINK_EP_COPY_STREAMS)")
    if combine_parts is not None and (type(combine_parts) is not int or not 1 <= combine_parts <= PARTS):
        raise ConfigError(f"ep.Buffer: combine_parts={combine_parts!r}; expected an int in [1, {PARTS}] (or None: "
                          f"{PARTS} for three ranks and more, else 1)")
    return Options(
        send=send if send is not None else (_env.ep_send() if cuda else "host"),
        graphs=graphs if graphs is not None else (cuda and _env.ep_graph()),
        copy_streams=copy_streams if copy_streams is not None else (_env.ep_copy_streams() if cuda else "one"),
        # two ranks sum in one part: their copies are too short to hide the parts' host work
        combine_parts=combine_parts if combine_parts is not None else (PARTS if num_ranks > 2 else 1),
    )


def stream_defaults(num_ranks: int) -> tuple[int, int]:
    """A streamed Buffer's default ``(stream_channels, ring_rows)`` for ``num_ranks``: 2560 rows a
    source either way (71 MiB a rank at 2 ranks x 7168 BF16). On 2 x H200 20 channels (40 programs,
    as DeepEP's 20 SMs of 2 blocks) of 128 rows ran fastest. On 4 x H200, beside DeepEP in
    ``bench ep --deep-ep`` (BENCHMARKS.md), 20 channels suited the dispatches (fresh FP8 ~1.0x DeepEP
    against 0.82x) and 10 of 256 the combine (0.81x against 0.67-0.70x); a layer's fresh dispatch
    and combine together took about as long on 10 with FP8 tokens and less with BF16, so 10 x 256
    is the default from three ranks on."""
    return (20, 128) if num_ranks <= 2 else (10, 256)


def resolve_stream(send: str, num_ranks: int, channels: int | None, ring_rows: int | None) -> tuple[int, int]:
    """``(stream_channels, ring_rows)`` of a Buffer of ``num_ranks``: ``(0, 0)`` unless
    ``send == "stream"``, else each argument, or its default (``stream_defaults``)."""
    if send != "stream":
        if channels is not None or ring_rows is not None:
            raise ConfigError(f"ep.Buffer: stream_channels={channels!r}, ring_rows={ring_rows!r} with send={send!r}; "
                              "they size a streamed Buffer's space (send='stream')")
        return 0, 0
    for name, value in (("stream_channels", channels), ("ring_rows", ring_rows)):
        if value is not None and (type(value) is not int or value < 1):
            raise ConfigError(f"ep.Buffer: {name}={value!r}; expected an int >= 1 (or None: the default)")
    default_channels, default_rows = stream_defaults(num_ranks)
    return (channels if channels is not None else default_channels), (ring_rows if ring_rows is not None else default_rows)
