"""The Triton kernel of the combine's sum (ep.kernels.reduce holds its entry point and torch twin).

Imported only where Triton is (ep.kernels.reduce._build); its helpers are module globals, where the
interpreter resolves them.
"""

import triton
import triton.language as tl


@triton.jit
def add_copy(acc, area_ptr, local_ptr, row, d, local_rank, local_shift, hidden, cols, in_row):
    # token t's copy from rank d (row -1: none) added to acc; this rank's own is read where it lies
    # (a branch on the row, as gather_kernel's, not a mask: Triton 3.9's interpreter refuses a
    # scalar condition in a block mask)
    if row >= 0:
        at = row.to(tl.int64)
        if d == local_rank:
            acc += tl.load(local_ptr + (at + local_shift) * hidden + cols, mask=in_row, other=0.0).to(tl.float32)
        else:
            acc += tl.load(area_ptr + at * hidden + cols, mask=in_row, other=0.0).to(tl.float32)
    return acc


@triton.jit
def token_part(rows_ptr, counts_ptr, token, local_rank, slot_rows, num_ranks: tl.constexpr, parts: tl.constexpr):
    # the part of the combine whose arrival completes token's copies: the latest over its peers'
    # copies (the n rows rank d sent back come in parts, row p in part p * parts // n; ep.kernels.reduce,
    # Note [Pipelined combine]); this rank's own copy is always there
    last = tl.full([], 0, tl.int64)
    for d in tl.static_range(num_ranks):
        row = tl.load(rows_ptr + token * num_ranks + d)
        if (row >= 0) & (d != local_rank):
            n = tl.load(counts_ptr + d).to(tl.int64)
            last = tl.maximum(last, (row - d * slot_rows) * parts // n)
    return last


@triton.jit
def sum_token(area_ptr, rows_ptr, out_ptr, local_ptr, local_rank, local_shift, hidden, token,
              num_ranks: tl.constexpr, block: tl.constexpr):
    out_row = out_ptr + token.to(tl.int64) * hidden
    for c0 in range(0, hidden, block):
        cols = c0 + tl.arange(0, block)
        in_row = cols < hidden
        acc = tl.zeros([block], dtype=tl.float32)
        for d in tl.static_range(num_ranks):
            row = tl.load(rows_ptr + token * num_ranks + d)
            acc = add_copy(acc, area_ptr, local_ptr, row, d, local_rank, local_shift, hidden, cols, in_row)
        tl.store(out_row + cols, acc.to(out_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def sum_kernel(area_ptr, rows_ptr, out_ptr, local_ptr, local_rank, local_shift, hidden, counts_ptr, part, slot_rows,
               num_ranks: tl.constexpr, parts: tl.constexpr, block: tl.constexpr):
    # a program per token, walking its row in blocks of columns (as fast as a program per block
    # for the whole sum, benchmarks/history-2026-11-22.md). With parts > 1 a program whose token is not in ``part``
    # (token_part) exits after reading its rows: a part's launch costs about its own tokens.
    token = tl.program_id(0)
    if parts == 1:
        sum_token(area_ptr, rows_ptr, out_ptr, local_ptr, local_rank, local_shift, hidden, token, num_ranks, block)
    else:
        if token_part(rows_ptr, counts_ptr, token, local_rank, slot_rows, num_ranks, parts) == part:
            sum_token(area_ptr, rows_ptr, out_ptr, local_ptr, local_rank, local_shift, hidden, token, num_ranks, block)
