"""DeepEP's ``Config`` and its buffer size hints, so that code which sizes a DeepEP buffer gets the
same byte budget here.

DeepEP's normal mode moves tokens through per-channel ring buffers; a ``Config`` names how many
SMs (two per channel) and how many tokens per chunk and per ring. warmlink has no rings (every
source rank owns a fixed slot in every peer: ep.wire.regions), so dispatch and combine accept a
``Config`` and do not use it. What callers do use is its size hint: Megatron, SGLang and DeepEP's
own tests size ``num_nvl_bytes`` as the largest hint of the dispatch and combine configs, and
``deep_ep.Buffer`` then keeps within that budget (``warmlink.ep.deep_ep.sizing``).

The hints are DeepEP's formulas for its normal-mode buffers, with its assumptions written out:
at most ``_MAX_TOPK`` experts per token, ``_MAX_SCALES`` FP8 scales per token, an 8-byte source
record per token, and up to ``NVL_PEERS`` ranks per NVLink domain (more ranks are DeepEP's
internode mode, whose RDMA buffer has a hint of its own).
"""

from __future__ import annotations

from warmlink.errors import ConfigError

__all__ = ["NVL_PEERS", "Config", "combine_config", "dispatch_config"]

NVL_PEERS = 8  # ranks of one NVLink domain in DeepEP's normal mode; more ranks span nodes
_MAX_TOPK = 128
_MAX_SCALES = 128
_SOURCE_META_BYTES = 8  # DeepEP's per-token source record: two int32
_INT_BYTES, _TOPK_IDX_BYTES, _FLOAT_BYTES, _INT4_BYTES = 4, 8, 4, 16


def _int(func: str, name: str, value, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{func}: {name}={value!r}; expected an int >= {low}")
    return value


def _align_up(value: int, to: int) -> int:
    return -(-value // to) * to


class Config:
    """DeepEP's performance config: accepted everywhere DeepEP takes one, used here for its size hints.

    Args:
        num_sms: SMs of DeepEP's kernels (two per channel; even where the hint spans nodes).
        num_max_nvl_chunked_send_tokens: tokens per NVLink chunk, < ``num_max_nvl_chunked_recv_tokens``.
        num_max_nvl_chunked_recv_tokens: tokens of one NVLink ring per channel and peer.
        num_max_rdma_chunked_send_tokens: tokens per RDMA chunk, at most half the RDMA ring.
        num_max_rdma_chunked_recv_tokens: tokens of one RDMA ring (rounded up to a multiple of the
            RDMA chunk, as DeepEP does).

    Raises:
        ConfigError: a field that DeepEP would refuse, naming it.
    """

    __slots__ = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                 "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens")

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        func = "deep_ep.Config"
        self.num_sms = _int(func, "num_sms", num_sms, 0)
        self.num_max_nvl_chunked_send_tokens = _int(func, "num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens, 1)
        self.num_max_nvl_chunked_recv_tokens = _int(func, "num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens, 1)
        if self.num_max_nvl_chunked_send_tokens >= self.num_max_nvl_chunked_recv_tokens:
            raise ConfigError(f"{func}: num_max_nvl_chunked_send_tokens={num_max_nvl_chunked_send_tokens}; expected fewer "
                              f"than num_max_nvl_chunked_recv_tokens={num_max_nvl_chunked_recv_tokens}")
        send = _int(func, "num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens, 1)
        recv = _align_up(_int(func, "num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens, 1), send)
        if send > recv // 2:  # a sender must always find room for a chunk in the ring
            raise ConfigError(f"{func}: num_max_rdma_chunked_send_tokens={send}; expected at most half of "
                              f"num_max_rdma_chunked_recv_tokens={recv} (after rounding up to a multiple of it)")
        self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens = send, recv

    def _check_hint(self, func: str, hidden_bytes: int, num_ranks: int) -> None:
        _int(func, "hidden_bytes", hidden_bytes, 1)
        _int(func, "num_ranks", num_ranks, 1)
        if num_ranks > NVL_PEERS and (num_ranks % NVL_PEERS or self.num_sms % 2):
            raise ConfigError(f"{func}: num_ranks={num_ranks} with num_sms={self.num_sms}; expected num_ranks <= "
                              f"{NVL_PEERS}, or a multiple of {NVL_PEERS} with an even num_sms")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of DeepEP's NVLink buffer for tokens of ``hidden_bytes`` bytes among ``num_ranks``
        ranks: the ``num_nvl_bytes`` to pass ``deep_ep.Buffer``. A multiple of 128."""
        self._check_hint("Config.get_nvl_buffer_size_hint", hidden_bytes, num_ranks)
        rdma_ranks, nvl_ranks = max(num_ranks // NVL_PEERS, 1), min(num_ranks, NVL_PEERS)
        rings = self.num_sms // 2 * nvl_ranks  # one ring per channel and peer
        token = (hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK * (_TOPK_IDX_BYTES + _FLOAT_BYTES)
                 + _MAX_SCALES * _FLOAT_BYTES)
        nbytes = rings * (2 * rdma_ranks + 3) * _INT_BYTES + rings * self.num_max_nvl_chunked_recv_tokens * token
        return _align_up(nbytes, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of DeepEP's RDMA buffer: 0 within one NVLink domain (``num_ranks <= 8``), which is
        all warmlink.ep runs (a ``deep_ep.Buffer`` given RDMA bytes across nodes refuses them)."""
        self._check_hint("Config.get_rdma_buffer_size_hint", hidden_bytes, num_ranks)
        if num_ranks <= NVL_PEERS:
            return 0
        rings = self.num_sms // 2 * (num_ranks // NVL_PEERS)
        token = (hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK * (_TOPK_IDX_BYTES + _FLOAT_BYTES)
                 + _MAX_SCALES * _FLOAT_BYTES + _INT4_BYTES)
        nbytes = (rings * (NVL_PEERS * 2 + 2) * 2 * _INT_BYTES
                  + rings * self.num_max_rdma_chunked_recv_tokens * token * 2)
        return _align_up(nbytes, 128)

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)}" for name in self.__slots__)
        return f"deep_ep.Config({fields})"


# DeepEP's recommended configs per group size (its tables, so that budgets sized from them match):
# (NVLink chunk, NVLink ring, RDMA chunk, RDMA ring) tokens, the SM count coming from the caller.
_DISPATCH = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
             24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
             96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
_COMBINE = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
            24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
            96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


def _recommended(table: dict, func: str, num_ranks: int, num_sms: int) -> Config:
    if num_ranks not in table:
        raise ConfigError(f"{func}: num_ranks={num_ranks!r}; expected one of {sorted(table)} (DeepEP's tuned sizes)")
    return Config(num_sms, *table[num_ranks])


def dispatch_config(num_ranks: int, num_sms: int) -> Config:
    """DeepEP's recommended dispatch config for ``num_ranks`` ranks and ``num_sms`` SMs."""
    return _recommended(_DISPATCH, "Buffer.get_dispatch_config", num_ranks, num_sms)


def combine_config(num_ranks: int, num_sms: int) -> Config:
    """DeepEP's recommended combine config for ``num_ranks`` ranks and ``num_sms`` SMs."""
    return _recommended(_COMBINE, "Buffer.get_combine_config", num_ranks, num_sms)
