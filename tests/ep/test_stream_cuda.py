"""The CUDA C++ streamed kernels (ep.kernels.stream_cuda, Note [Warp groups]) on a machine without a GPU:
``stream.cu`` compiles for Hopper with the machine's nvcc, and the argument structs the launcher
packs lie as the compiler lays them out (a host program built from the same file prints every
field's offset). On GPUs they run in test_stream_gpu.py, beside the Triton kernels, against the
torch twins.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from importlib import resources

import pytest

from warmlink.ep.kernels import stream_cuda

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA compiler; no GPU)")
SOURCE = resources.files("warmlink.ep.kernels").joinpath("stream.cu")

# the fields of stream.cu's argument structs, in order, as stream_cuda packs them
DISPATCH_FIELDS = ("rows x topk w s bases offsets out_x out_idx out_w out_s status abort valid seq done taken board "
                   "num_tokens "
                   "max_tokens x_words num_k num_scales s_token_stride s_col_stride meta_words row_words ring_rows "
                   "out_rows experts_per_rank timeout_ns starts board_row worst me num_ranks channels topk_bytes w_kind has_s "
                   "publish batch warps_per_peer starts_given padded pad posted_tag posted").split()
COMBINE_FIELDS = ("rows x w taken offsets bases out out_w status abort seq done num_tokens x_rows x_words num_k row_words "
                  "ring_rows timeout_ns me num_ranks channels half publish batch warps_per_peer merge").split()


def _offsets(fmt, fields: list[str]) -> list[int]:
    """Each field's offset in a ``struct.Struct`` of little-endian, unpadded codes (``starts`` spans
    ``MAX_RANKS`` words)."""
    sizes = {"Q": 8, "q": 8, "i": 4}
    at, words = 0, []
    for count, code in re.findall(r"(\d*)([Qqi])", fmt.format[1:]):
        for _ in range(int(count or 1)):
            words.append(at)
            at += sizes[code]
    out, i = [], 0
    for f in fields:
        out.append(words[i])
        i += stream_cuda.MAX_RANKS if f == "starts" else 1
    assert i == len(words), (i, len(words))
    return out


@needs_nvcc
@pytest.mark.parametrize("ranks", sorted({stream_cuda.sum_ranks(r) for r in range(1, stream_cuda.MAX_RANKS + 1)}))
def test_stream_cu_compiles_for_hopper_with_both_kernels(tmp_path, ranks):
    """Each rank bound's module (``sum_ranks``: the combine's sum is compiled for it)."""
    done = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-Xptxas", "-v", f"-DSUM_RANKS={ranks}",
                           "-o", str(tmp_path / "stream.cubin"), str(SOURCE)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    for kernel in ("warmlink_stream_dispatch", "warmlink_stream_combine"):
        assert f"Compiling entry function '{kernel}' for 'sm_90'" in done.stderr, done.stderr[-4000:]


@needs_nvcc
def test_the_packed_arguments_lie_where_the_compiler_puts_each_field(tmp_path):
    """A host program including stream.cu prints sizeof and every offsetof of both structs; the
    launcher's ``struct`` formats give the same bytes (a field added to one side only fails here)."""
    lines = ['#include <cstdio>', '#include <cstddef>', f'#include "{SOURCE}"', "int main() {"]
    for struct_name, fields in (("DispatchArgs", DISPATCH_FIELDS), ("CombineArgs", COMBINE_FIELDS)):
        lines.append(f'  printf("{struct_name} %zu\\n", sizeof({struct_name}));')
        lines += [f'  printf("{struct_name}.{f} %zu\\n", offsetof({struct_name}, {f}));' for f in fields]
    lines.append("  return 0;\n}")
    program = tmp_path / "layout.cu"
    program.write_text("\n".join(lines))
    built = subprocess.run([NVCC, "-arch=sm_90", "-o", str(tmp_path / "layout"), str(program)], capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stderr[-4000:]
    printed = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, timeout=60, check=True).stdout
    got = dict(line.split() for line in printed.splitlines())
    for struct_name, fields, fmt in (("DispatchArgs", DISPATCH_FIELDS, stream_cuda._DISPATCH),
                                     ("CombineArgs", COMBINE_FIELDS, stream_cuda._COMBINE)):
        assert int(got[struct_name]) == fmt.size, (struct_name, got[struct_name], fmt.size)
        want = dict(zip(fields, _offsets(fmt, fields), strict=True))
        assert {f: int(got[f"{struct_name}.{f}"]) for f in fields} == want, struct_name


def test_the_switch_and_a_group_past_eight_ranks_choose_triton_without_compiling(monkeypatch):
    """``WARMLINK_EP_STREAM_KERNEL=triton``, or more ranks than the CUDA kernels hold, send a Buffer
    to the Triton kernels before NVRTC is asked for anything (this machine has none)."""
    from warmlink import _env

    monkeypatch.setenv("WARMLINK_EP_STREAM_KERNEL", "triton")
    _env.clear_cache()
    stream_cuda.choose.cache_clear()
    try:
        assert stream_cuda.choose(0, 2) == "triton"
        monkeypatch.setenv("WARMLINK_EP_STREAM_KERNEL", "cuda")
        assert stream_cuda.choose(0, stream_cuda.MAX_RANKS + 1) == "triton"
    finally:
        monkeypatch.delenv("WARMLINK_EP_STREAM_KERNEL")
        _env.clear_cache()
        stream_cuda.choose.cache_clear()


def test_the_dispatch_kernel_reads_any_float_weights_the_protocol_takes():
    """The protocol takes any floating topk_weights; the kernel reads float32, BF16 and FP16 as they
    are (w_kind 1-3) and gets any other float as float32, values kept."""
    import torch

    assert stream_cuda.weight_kind(None) == (None, 0)
    for dtype, kind in ((torch.float32, 1), (torch.bfloat16, 2), (torch.float16, 3)):
        w = torch.rand(4, 2).to(dtype)
        got, k = stream_cuda.weight_kind(w)
        assert got is w and k == kind
    for dtype in (torch.float64, torch.float8_e4m3fn):
        w = torch.tensor([[0.5, 0.25], [1.0, 2.0]]).to(dtype)
        got, k = stream_cuda.weight_kind(w)
        assert k == 1 and got.dtype == torch.float32 and torch.equal(got, w.float())


def _unpacked(packed: bytes) -> dict:
    """``DispatchArgs`` bytes by field (``starts`` as a list)."""
    words, fields, i = stream_cuda._DISPATCH.unpack(packed), {}, 0
    for f in DISPATCH_FIELDS:
        n = stream_cuda.MAX_RANKS if f == "starts" else 1
        fields[f] = list(words[i:i + n]) if f == "starts" else words[i]
        i += n
    return fields


def test_a_launch_prepared_before_its_outputs_gets_their_addresses_rows_and_starts(monkeypatch):
    """A fresh dispatch packs its launch while the GPUs trade the counts (``prepare_dispatch``) and
    gives the outputs and the starts after (``PreparedDispatch.launch``): the kernel gets the bytes
    a launch packed at once would give it."""
    import torch

    from warmlink.ep.kernels.stream import StreamOutputs, StreamSpace

    launched = []
    monkeypatch.setattr(stream_cuda, "_kernels", lambda device, num_ranks: {
        "warmlink_stream_dispatch": lambda grid, block, args, stream: launched.append((grid, block, bytes(args)))})
    monkeypatch.setattr(stream_cuda, "current_stream", lambda device: 0)
    space = StreamSpace(2, 3, 16, 32)
    t = {name: torch.zeros(4, 2, dtype=torch.int64) for name in ("rows", "x", "topk", "taken", "bases", "offsets",
                                                                    "status", "valid", "seq")}
    weights, scales = torch.zeros(4, 2), torch.zeros(4, 3)
    call = (t["bases"], t["offsets"])
    prepared = stream_cuda.prepare_dispatch(space, t["rows"], t["x"], t["topk"], weights, scales, *call, t["status"],
                                            1234, t["valid"], 1, t["seq"], 4, 3, 5, 10**9, t["taken"], starts_given=True)
    assert not launched  # nothing is launched before the outputs exist
    out = StreamOutputs(torch.zeros(7, 2, dtype=torch.int64), torch.zeros(7, 2, dtype=torch.int64), torch.zeros(7, 2),
                        torch.zeros(7, 3))
    prepared.launch(out, [0, 5])
    grid, block, packed = launched[0]
    assert (grid, block) == (2 * space.channels, stream_cuda.THREADS)
    got = _unpacked(packed)
    assert [got[f] for f in ("out_x", "out_idx", "out_w", "out_s")] == [p.data_ptr() for p in out]
    assert got["out_rows"] == 7 and got["starts"] == [0, 5] + [0] * (stream_cuda.MAX_RANKS - 2)
    assert got["starts_given"] == 1 and got["abort"] == 1234 and got["me"] == 1 and got["x"] == t["x"].data_ptr()
    stream_cuda.dispatch(space, t["rows"], t["x"], t["topk"], weights, scales, *call, out, t["status"], 1234, t["valid"],
                         1, t["seq"], 4, 3, 5, 10**9, t["taken"], starts=[0, 5])
    assert launched[1][2] == packed  # the launch packed at once: the same bytes
    with pytest.raises(ValueError, match="starts_given"):
        prepared.launch(out, None)


def test_the_combine_merges_channels_only_past_its_program_cap_from_three_ranks_on():
    """``combine_merge``: two ranks never merge; from three on, a program takes enough adjacent
    dispatch channels for at most ``COMBINE_PROGRAMS`` a side (the last may take fewer)."""
    cap = stream_cuda.COMBINE_PROGRAMS
    assert [stream_cuda.combine_merge(2, c) for c in (1, cap, 2 * cap, 64)] == [1, 1, 1, 1]
    for ranks in (3, 4, 8):
        for channels in (1, cap - 1, cap, cap + 1, 2 * cap, 2 * cap + 1, 64):
            merge = stream_cuda.combine_merge(ranks, channels)
            programs = -(-channels // merge)
            assert programs <= cap and (merge == 1 or -(-channels // (merge - 1)) > cap), (ranks, channels, merge)
