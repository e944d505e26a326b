"""The streamed dispatch (ep.kernels.stream, Note [Streamed dispatch]) between two GPU processes: rank r
on GPU r % count (on one GPU the two ranks share it, their kernels time-sliced), each rank's
stream space mapped by its peer over CUDA IPC (warmlink.transport's cuda_ipc link).

Rings of 8 rows, far fewer than a call's rows, so every ring wraps hundreds of times and every
row waits on the GPUs' own credits. Every wait in the kernel has its deadline, and every host
wait its timeout: nothing here sleeps or can hang.
"""

from __future__ import annotations

import pytest
import torch

from tests.ep._group import run_ranks
from tests.ep._stream_workers import stream_calls, stream_round_trips
from warmlink.ep.kernels.stream import row_words

pytestmark = [pytest.mark.multigpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
# each test runs the Triton kernels and the CUDA C++ ones (ep.kernels.stream_cuda, Note [Warp groups])
KERNELS = pytest.mark.parametrize("kernel", [None, "cuda"], ids=["triton", "cuda"])

# DeepSeek's shapes: 4096 tokens of 7168, top-8 of 256 experts; a space sized for BF16 rows
_DEEPSEEK = {"tokens": [4096, 4096], "hidden": 7168, "experts": 256, "topk": 8, "mask_prob": 0.05}
_SPACE = {"channels": 8, "ring_rows": 8, "row_words": row_words(7168 * 2 // 8, 8, 56)}


@KERNELS
def test_gpu_streamed_calls_through_rings_of_eight_rows_equal_the_torch_twin(kernel):
    """BF16, then FP8 with DeepEP's column-major scales, then BF16 of uneven batches: seq 1, 2, 3
    through one space; each rank's outputs equal the torch twin's bit for bit, every program
    finished."""
    calls = [dict(_DEEPSEEK, seed=1),
             dict(_DEEPSEEK, seed=2, dtype=torch.float8_e4m3fn, layout="column"),
             dict(_DEEPSEEK, seed=3, tokens=[4096, 1000], max_tokens=4096)]
    case = dict(_SPACE, calls=calls, timeout_s=60.0, kernel=kernel)  # a first launch compiles while its peer waits
    results = run_ranks(stream_calls, 2, case=case, timeout_s=600)
    for rank, per_call in enumerate(results):
        for seq, got in enumerate(per_call, start=1):
            assert not got["failures"], (rank, seq, got["failures"])
            assert all(got["same"].values()), (rank, seq, got["same"])
            assert got["rows"] > 0, (rank, seq)


@KERNELS
def test_gpu_rows_wider_than_a_warp_of_meta_equal_the_torch_twin(kernel):
    """Top-36 of 288 experts and FP8 rows of 12288 with 96 column-major scales: more ids than a
    warp's lanes and more scales than two per lane (the CUDA kernels move those past the first
    32 ids and 64 scales after the row's x, MetaRegs in stream.cu); BF16, then FP8."""
    wide = {"tokens": [512, 300], "hidden": 12288, "experts": 288, "topk": 36, "mask_prob": 0.05, "max_tokens": 512}
    space = dict(_SPACE, row_words=max(row_words(12288 * 2 // 8, 36, 0), row_words(12288 // 8, 36, 96)))
    calls = [dict(wide, seed=8), dict(wide, seed=9, dtype=torch.float8_e4m3fn, layout="column")]
    case = dict(space, calls=calls, timeout_s=60.0, kernel=kernel)
    for rank, per_call in enumerate(run_ranks(stream_calls, 2, case=case, timeout_s=600)):
        for seq, got in enumerate(per_call, start=1):
            assert not got["failures"] and all(got["same"].values()) and got["rows"] > 0, (rank, seq, got)


@KERNELS
def test_gpu_tiles_that_straddle_the_rings_wrap_equal_the_torch_twin(kernel):
    """Rings of 12 rows and tiles of 8 tokens (visits of 5 rows, tails every 3): a sender's tile
    finds room for part of itself, its rows wrap the ring part-way through a tile; BF16, then FP8."""
    calls = [dict(_DEEPSEEK, seed=6, tokens=[4096, 3001], max_tokens=4096),
             dict(_DEEPSEEK, seed=7, dtype=torch.float8_e4m3fn, layout="column")]
    case = dict(_SPACE, ring_rows=12, calls=calls, timeout_s=60.0, steps={"tokens": 8, "batch": 5, "publish": 3},
                kernel=kernel)
    for rank, per_call in enumerate(run_ranks(stream_calls, 2, case=case, timeout_s=600)):
        for seq, got in enumerate(per_call, start=1):
            assert not got["failures"] and all(got["same"].values()), (rank, seq, got)


@KERNELS
def test_gpu_a_peer_that_never_launches_ends_the_other_kernel_within_its_timeout_with_failure_words(kernel):
    """Call 1 runs on both ranks (and compiles the kernel); in call 2 rank 1 maps its space but never
    launches: rank 0's senders fill rank 1's rings and end at their deadline waiting for credits
    from rank 1, its receivers at theirs waiting for rows from rank 1, the source not heard from;
    the kernel ends within about two timeouts (a receiver's clock restarts at its last row)."""
    timeout_s = 2.0
    small = dict(_DEEPSEEK, tokens=[1024, 1024])
    case = dict(_SPACE, calls=[dict(small, seed=4, timeout_s=60.0), dict(small, seed=5)], timeout_s=timeout_s, dead=1,
                kernel=kernel)
    (warm, alone), (warm_1, dead) = run_ranks(stream_calls, 2, case=case, timeout_s=300)
    for got in (warm, warm_1):
        assert not got["failures"] and all(got["same"].values()), got
    assert dead == {"dead": True}
    channels = _SPACE["channels"]
    waits = sorted((f["role"], f["channel"], f["seq"], f["wait"], f["peer"], f["aborted"]) for f in alone["failures"])
    assert waits == [("recv", c, 2, "rows", 1, False) for c in range(channels)] + \
        [("send", c, 2, "credit", 1, False) for c in range(channels)], waits
    assert alone["seconds"] < 2 * timeout_s + 5, alone["seconds"]


@KERNELS
def test_gpu_dispatch_then_combine_twice_through_one_space_equal_the_twins(kernel):
    """Dispatch (seq 1), combine (2) of the rows received times 2 or -0.5 by rank, dispatch (3),
    combine (4), through one space of 8-row rings: 4096 x 7168 BF16 top-8 of 256 with weights, then
    uneven batches without weights, then FP16 (the combine sums and rounds FP16 too). Each rank's
    dispatch outputs, ``taken`` and combined sums (float32 in rank order, rounded to x's dtype) equal
    the torch twins' bit for bit; every program finished."""
    calls = [dict(_DEEPSEEK, seed=6),
             dict(_DEEPSEEK, seed=7, tokens=[4096, 1000], max_tokens=4096, weights=False),
             dict(_DEEPSEEK, seed=8, tokens=[1024, 777], max_tokens=1024, dtype=torch.float16)]
    case = dict(_SPACE, calls=calls, timeout_s=60.0, kernel=kernel)  # a first launch compiles while its peer waits
    results = run_ranks(stream_round_trips, 2, case=case, timeout_s=600)
    for rank, per_call in enumerate(results):
        for i, got in enumerate(per_call):
            assert not got["failures"], (rank, i, got["failures"])
            assert all(got["same"].values()), (rank, i, got["same"])
            assert got["rows"] > 0 and got["tokens"] > 0, (rank, i)
