"""Note [Loud fallbacks]: which batches are judged, and the causes named. No NIXL needed."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from warmlink.transport._nixl_speed import DEFAULT_MIN_GBPS, floor_gbps, slow_causes, slow_message


def test_floor_is_the_users_else_only_for_gpu_memory() -> None:
    assert floor_gbps(None, vram=True) == DEFAULT_MIN_GBPS
    assert floor_gbps(None, vram=False) == 0.0  # host-only batches are not judged by default
    assert floor_gbps(12, vram=False) == 12.0 and floor_gbps(0, vram=True) == 0.0


def test_causes_name_what_applies() -> None:
    one_host_gpu = slow_causes(vram=True, remote_host=False, num_not_ipc=0, ucx_tls="tcp,cuda_copy")
    assert one_host_gpu == ["UCX_TLS='tcp,cuda_copy' leaves out cuda_ipc"]
    across = slow_causes(vram=True, remote_host=True, num_not_ipc=2, ucx_tls="tcp")
    assert "leaves out RDMA transports" in across[0] and "2 local GPU allocation(s)" in across[1]
    assert "another host" in across[2]
    host = slow_causes(vram=False, remote_host=False, num_not_ipc=0, ucx_tls="tcp,self")
    assert host == ["UCX_TLS='tcp,self' leaves out shared-memory transports (sm, cma)"]
    for tls in ("", "all", "^tcp", "rc,cuda_ipc,cuda_copy"):  # nothing excluded: no UCX_TLS cause
        causes = slow_causes(vram=True, remote_host=False, num_not_ipc=0, ucx_tls=tls)
        assert len(causes) == 1 and "no direct path" in causes[0], (tls, causes)


@given(st.booleans(), st.booleans(), st.integers(0, 5), st.text(max_size=40))
def test_there_is_always_a_cause_and_a_message(vram, remote, not_ipc, tls) -> None:
    causes = slow_causes(vram=vram, remote_host=remote, num_not_ipc=not_ipc, ucx_tls=tls)
    assert causes and all(isinstance(c, str) and c for c in causes)
    msg = slow_message(268435456, 0.42, 5.0, causes)
    assert msg.startswith("NixlLink: 268.4 MB moved at 0.42 GB/s, below min_gbps=5") and causes[0] in msg
