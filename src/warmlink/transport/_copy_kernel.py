"""Many copies within one GPU as one kernel: the colocated refit's pull at HBM speed.

# Note [Copy kernel]
Between two processes on one GPU (a colocated trainer and engine) a pull reads IPC-mapped memory
of the same device: the ceiling is HBM bandwidth, not a link. One ``cudaMemcpyAsync`` of all the
bytes reaches it; many separate copies do not (one ``cudaMemcpyBatchAsync`` of a 290-tensor model
took 7.2 ms on an H100 where one flat copy of the same bytes took 5.9). A refit cannot make the
copies one: the trainer's tensors are separate allocations, and a re-sharded layout adds strided
rows. So the copies become one kernel. Each copy (``rows`` rows of ``row_nbytes``, with pitches)
is cut into pieces of at most ``chunk_nbytes``, a table with one row per piece is built once when
the batch is prepared (setup; uploaded to the device once), and each program of the kernel copies
one piece with 16-byte accesses. A warm pull is then one launch whatever the number of tensors.
Copies whose addresses, sizes or pitches are not multiples of 16 bytes are left to the copy
engines (``CopyPlan.rest``). So is a batch of fewer than ``MIN_COPIES`` copies (a version header,
a fan-out chunk): a few large copies come near the ceiling on the copy engines, and the kernel's
first use costs a process 0.5-0.8 s (importing Triton, hashing its sources for its cache key,
loading the module), which would fall on the first cycle of a fan-out replica on its source's GPU.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["CopyPlan", "ALIGN_BYTES", "CHUNK_NBYTES", "MIN_COPIES", "available", "get_kernel"]

ALIGN_BYTES = 16
MIN_COPIES = 16  # a batch with fewer copies stays on the copy engines
#: Bytes per program, and the variant and warps: the best of both chips measured, as a fraction of
#: one flat copy of a 290-tensor model: 0.954 on an H100 and 0.959 on an H200. The fastest on each
#: differ (16 warps: 0.969 on the H100, 0.929 on the H200; 8 warps x 64 KiB: 0.943 and 0.964):
#: the colocated_copy_methods logs of 2026-11-25 (1 x H100) and 2026-11-26 (2 x H200, GPU 0), in git
#: history (git show 031ad9e:benchmarks/colocated_copy_methods_1xH100_2026-11-25_b.log).
CHUNK_NBYTES = 128 << 10
VARIANT = "v2"
NUM_WARPS = 8
_COLUMNS = 6  # src, dst, row words, rows, src pitch words, dst pitch words
_BLOCK = 1024  # int32 elements per step: 4 KiB


def available() -> bool:
    """Whether Triton and a CUDA device are present (the kernel's only requirements). Triton is
    found, not imported: importing it took 147 ms of a receiver's 224 ms connect on an H200 host,
    and a link whose peers sit on other GPUs never launches the kernel (it is imported at the
    first launch)."""
    import importlib.util

    import torch

    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


_kernels: dict = {}


def get_kernel(variant: str = "v1"):
    """The Triton kernel (compiled on first launch): one program per table row.

    Variants differ only in how they tell Triton the accesses are 16-byte vectors (``v1``: offsets
    hinted contiguous; ``v2``: and the row pointers 16-byte aligned; ``v3``: [words, 4] tiles);
    ``tools/colocated_copy.py`` times them. Full blocks are copied without a mask, the tail of a
    row with one.
    """
    kernel = _kernels.get(variant)
    if kernel is not None:
        return kernel
    import triton
    import triton.language as tl

    ALIGNED = variant in ("v2", "v3")
    TILES = variant == "v3"

    @triton.jit
    def multi_copy(table_ptr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr, TILES: tl.constexpr):
        row = table_ptr + tl.program_id(0).to(tl.int64) * 6
        src = tl.load(row).to(tl.pointer_type(tl.int32))
        dst = tl.load(row + 1).to(tl.pointer_type(tl.int32))
        n = tl.load(row + 2) * 4  # int32 elements per row: 16-byte words times 4
        rows = tl.load(row + 3)
        src_pitch = tl.load(row + 4) * 4
        dst_pitch = tl.load(row + 5) * 4
        full = n - n % BLOCK
        lanes = tl.arange(0, BLOCK)
        words = tl.arange(0, BLOCK // 4)[:, None] * 4 + tl.arange(0, 4)[None, :]
        for r in range(0, rows):
            s = src + r * src_pitch
            d = dst + r * dst_pitch
            if ALIGNED:
                s = tl.multiple_of(s, 16)
                d = tl.multiple_of(d, 16)
            for start in range(0, full, BLOCK):
                if TILES:
                    tl.store(d + start + words, tl.load(s + start + words))
                else:
                    offs = tl.max_contiguous(tl.multiple_of(start + lanes, BLOCK), BLOCK)
                    tl.store(d + offs, tl.load(s + offs))
            offs = full + lanes
            ok = offs < n
            tl.store(d + offs, tl.load(s + offs, mask=ok), mask=ok)

    _kernels[variant] = kernel = (multi_copy, ALIGNED, TILES)
    return kernel


class CopyPlan:
    """A prepared set of copies within one GPU, launched as one kernel.

    Args:
        copies: ``(dst, src, row_nbytes, rows, dst_pitch, src_pitch)`` per copy: byte addresses
            (device pointers as ints; a source may be IPC-mapped memory of another process on
            the same device), bytes per row, rows, and row pitches in bytes (ignored for 1 row).
        device: CUDA device index, or -1 to keep the table in host memory (Triton's interpreter).
        chunk_nbytes: about how many bytes one program copies (rows are never split).

    ``rest`` lists the copies the kernel does not take (not 16-byte aligned), in the same form,
    for the caller's copy engines.

    **Warm path?** Building the table is setup; ``launch`` is one kernel launch.
    """

    __slots__ = ("device", "table", "num_programs", "rest", "nbytes", "_streams")

    def __init__(self, copies: Sequence[tuple[int, int, int, int, int, int]], *, device: int,
                 chunk_nbytes: int = 1 << 20) -> None:
        import torch

        if chunk_nbytes < ALIGN_BYTES:
            raise ValueError(f"CopyPlan: chunk_nbytes={chunk_nbytes} must be >= {ALIGN_BYTES}")
        # A long row is cut with tensor ops: a 275 MB chunk of a fan-out pull is ~2,100 programs,
        # and 32 such tables built row by row in Python took 140 ms of a cycle on an H200 host.
        rest, nbytes, rows_of, short = [], 0, [], []
        for dst, src, row_nbytes, rows, dst_pitch, src_pitch in copies:
            if rows == 1:
                dst_pitch = src_pitch = row_nbytes
            if any(v % ALIGN_BYTES for v in (dst, src, row_nbytes, dst_pitch, src_pitch)):
                rest.append((dst, src, row_nbytes, rows, dst_pitch, src_pitch))
                continue
            nbytes += row_nbytes * rows
            if rows == 1 and row_nbytes > 8 * chunk_nbytes:  # one long row: cut into pieces
                if short:  # the table keeps the copies' order
                    rows_of.append(torch.tensor(short, dtype=torch.int64, device="cpu").reshape(-1, 6))
                    short = []
                offs = torch.arange(0, row_nbytes, chunk_nbytes, dtype=torch.int64, device="cpu")
                words = (row_nbytes - offs).clamp_(max=chunk_nbytes) // 16
                rows_of.append(torch.stack([src + offs, dst + offs, words, torch.ones_like(offs), words, words], 1))
            elif rows == 1 and row_nbytes > chunk_nbytes:
                for off in range(0, row_nbytes, chunk_nbytes):
                    n = min(chunk_nbytes, row_nbytes - off) // 16
                    short.append((src + off, dst + off, n, 1, n, n))
            else:
                per = max(1, chunk_nbytes // row_nbytes)  # whole rows per program
                short.extend((src + r * src_pitch, dst + r * dst_pitch, row_nbytes // 16, min(per, rows - r), src_pitch // 16,
                              dst_pitch // 16) for r in range(0, rows, per))
        if short:
            rows_of.append(torch.tensor(short, dtype=torch.int64, device="cpu").reshape(-1, 6))
        table = torch.cat(rows_of) if rows_of else None
        self.device = device
        self._streams: dict = {}  # cudaStream_t -> its torch ExternalStream, made once
        self.rest = rest
        self.nbytes = nbytes
        self.num_programs = 0 if table is None else len(table)
        self.table = None if table is None else table.reshape(-1).to(f"cuda:{device}" if device >= 0 else "cpu")

    def compile(self, *, variant: str = VARIANT, num_warps: int = NUM_WARPS) -> None:
        """Compile the kernel and load it into the device now (once per process), so that no
        launch pays for either: loading a module synchronizes the context, which inside a pull
        would hold the host until every queued kernel drained."""
        if self.table is None:
            return
        kernel, aligned, tiles = get_kernel(variant)
        compiled = kernel.warmup(self.table, BLOCK=_BLOCK, ALIGNED=aligned, TILES=tiles, num_warps=num_warps, grid=(1,))
        init = getattr(compiled, "_init_handles", None)  # Triton's module load; absent in the interpreter
        if init is not None:
            init()

    def launch(self, stream: int | None = None, *, variant: str = VARIANT, num_warps: int = NUM_WARPS) -> None:
        """Enqueue every kernel copy on ``stream`` (a ``cudaStream_t`` as an int; default: the
        current torch stream)."""
        if self.table is None:
            return
        kernel, aligned, tiles = get_kernel(variant)
        if stream is None:
            kernel[(self.num_programs,)](self.table, BLOCK=_BLOCK, ALIGNED=aligned, TILES=tiles, num_warps=num_warps)
            return
        import torch

        external = self._streams.get(stream)
        if external is None:  # Triton launches on torch's current stream: the link's, wrapped once
            external = self._streams[stream] = torch.cuda.ExternalStream(stream, device=torch.device("cuda", self.device))
        with torch.cuda.stream(external):
            kernel[(self.num_programs,)](self.table, BLOCK=_BLOCK, ALIGNED=aligned, TILES=tiles, num_warps=num_warps)
