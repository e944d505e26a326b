"""DeepEP's Python API (normal and low-latency mode) on warmlink.ep, so that DeepEP-based code runs unchanged::

    import warmlink.ep.deep_ep as deep_ep

    buffer = deep_ep.Buffer(group, num_nvl_bytes)      # sized from Config.get_nvl_buffer_size_hint
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(topk_idx, 256)
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = buffer.dispatch(
        x, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights)
    combined_x, combined_topk_weights, event = buffer.combine(y, handle, topk_weights=recv_topk_weights)

``Buffer``, ``Config``, ``EventHandle``, ``EventOverlap`` and ``topk_idx_t`` are DeepEP's names;
``utils`` holds the event classes where Megatron imports them (``deep_ep.utils``). What differs
from DeepEP, and which arguments are accepted but unused, each docstring says; the memory model
is in ``deep_ep.sizing`` (``needed_bytes`` sizes a budget that holds a batch in one round; a
batch larger than the budget holds goes in several, ``deep_ep.rounds``). With
``low_latency_mode=True`` the low-latency calls run within ``num_rdma_bytes``
(``deep_ep.low_latency``; on the host over shm, or on a GPU), the mask buffer's calls too with
``enable_shrink=True``. Not here, each raising ``ConfigError`` saying why (``deep_ep.absent``):
internode (RDMA) mode and ``get_local_buffer_tensor`` (warmlink has no ring buffer to expose). Calls made with ``async_finish=True`` run on the communication stream
``get_comm_stream()`` returns, as DeepEP's do.
"""

from __future__ import annotations

import torch

from warmlink.ep.deep_ep import sizing, utils
from warmlink.ep.deep_ep.buffer import Buffer
from warmlink.ep.deep_ep.config import Config
from warmlink.ep.deep_ep.events import EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "sizing", "topk_idx_t", "utils"]

topk_idx_t = torch.int64  # DeepEP's expert-id dtype (its default build)
