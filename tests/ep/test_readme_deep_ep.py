"""The README's ep sections: the ``ep.Buffer`` snippet of "MoE dispatch and combine" and that of
"DeepEP code, unchanged" run as written on two ranks (CPU, shared memory), and the latter's memory
figures are what ``deep_ep.sizing`` computes."""

from __future__ import annotations

import re
from pathlib import Path

import warmlink.ep.deep_ep as deep_ep
from tests.ep._deep_ep_workers import free_port, run_snippet
from tests.ep._group import run_ranks

README = Path(__file__).resolve().parents[2] / "README.md"


def snippet(marker: str) -> str:
    """The README's python block containing ``marker``, as written."""
    found = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S) if marker in b]
    assert len(found) == 1, f"expected one README python block with {marker!r}, found {len(found)}"
    return found[0]


def test_the_ep_buffer_snippet_runs_as_written():
    # its shapes are the snippet's own: 7168 wide, top-8 of 256 experts
    case = {"tokens": 24, "hidden": 7168, "experts": 256, "topk": 8, "mask_prob": 0.1, "seed": 11,
            "dist_port": free_port(), "code": snippet("from warmlink.ep import Buffer\n"), "combined_w": "combined_w"}
    for got in run_ranks(run_snippet, 2, case=case, timeout_s=180):
        assert got["ok"] and got["received"] > 0, got


def test_the_deep_ep_snippet_runs_as_written():
    case = {"tokens": 20, "hidden": 256, "experts": 8, "topk": 2, "mask_prob": 0.1, "seed": 13,
            "dist_port": free_port(), "code": snippet("import warmlink.ep.deep_ep as deep_ep"),
            "combined_w": "combined_topk_weights"}
    for got in run_ranks(run_snippet, 2, case=case, timeout_s=120):
        assert got["ok"] and got["received"] > 0, got


def test_the_memory_figures_are_what_sizing_computes():
    from warmlink.ep.api.options import stream_defaults
    from warmlink.ep.wire.regions import RegionLayout

    text = " ".join(README.read_text().split())
    figures, streamed = [], []
    for num_ranks in (2, 4, 8):
        hint = max(c.get_nvl_buffer_size_hint(7168 * 2, num_ranks)
                   for c in (deep_ep.Buffer.get_dispatch_config(num_ranks), deep_ep.Buffer.get_combine_config(num_ranks)))
        need = deep_ep.sizing.needed_bytes(4096, num_ranks, 7168, 8)
        figures.append(f"{need / 2**30:.2f}")
        assert f"{need / hint:.1f} times DeepEP's hint" in text, (num_ranks, need / hint)
        assert deep_ep.sizing.tokens_within(hint, num_ranks, 7168, 8) < 4096  # so the hint streams
        channels, ring_rows = deep_ep.sizing.stream_within(hint, num_ranks, 7168, 8, max_channels=66)
        assert (channels, ring_rows) == stream_defaults(num_ranks) == ((20, 128) if num_ranks == 2 else (10, 256))
        nbytes = RegionLayout(num_ranks, deep_ep.sizing.MAX_TOKENS, 7168, 8, channels, ring_rows).nbytes
        assert nbytes <= hint, (num_ranks, nbytes, hint)
        streamed.append(f"{nbytes / 2**20:.3g}")
    assert f"one slot round needs {' / '.join(figures)} GiB per rank" in text, figures
    assert (f"20 channels of up to 128 rows a ring at 2 ranks, 10 of up to 256 at more, {' / '.join(streamed)} MiB "
            "at 2 / 4 / 8 ranks") in text, streamed
    in_2e9 = [-(-4096 // deep_ep.sizing.tokens_within(int(2e9), num_ranks, 7168, 8)) for num_ranks in (2, 4, 8)]
    assert in_2e9 == [1, 1, 2] and "2e9 bytes: slots, one round at 2 and 4 ranks, two at 8" in text
