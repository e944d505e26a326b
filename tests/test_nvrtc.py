"""warmlink._nvrtc on a machine without NVRTC: its disk cache and its errors, through a stand-in for
``cuda.bindings.nvrtc`` that records what it is asked and returns what the real one would (a
cubin, or a failed compile with its log). The real NVRTC compiles stream.cu on the GPU machine
(the streamed ep tests); here nvcc compiles it (tests/ep/test_stream_cuda.py)."""

from __future__ import annotations

import enum
import logging

import pytest

from warmlink import _env, _nvrtc
from warmlink.errors import BackendUnavailable, TransferError


class FakeNvrtc:
    """The calls of ``cuda.bindings.nvrtc`` that ``compile_cubin`` makes, in their shapes."""

    class nvrtcResult(enum.IntEnum):  # noqa: N801 - the bindings' name
        NVRTC_SUCCESS = 0
        NVRTC_ERROR_COMPILATION = 6

    def __init__(self, log: str = "") -> None:
        self.log, self.compiles, self.options = log, 0, []

    def nvrtcVersion(self):  # noqa: N802 - the bindings' names
        return self.nvrtcResult.NVRTC_SUCCESS, 13, 0

    def nvrtcCreateProgram(self, src, name, n, headers, names):  # noqa: N802
        return self.nvrtcResult.NVRTC_SUCCESS, (src, name)

    def nvrtcCompileProgram(self, prog, n, options):  # noqa: N802
        self.compiles += 1
        self.options.append(list(options))
        ok = not self.log
        return (self.nvrtcResult.NVRTC_SUCCESS if ok else self.nvrtcResult.NVRTC_ERROR_COMPILATION,)

    def nvrtcGetProgramLogSize(self, prog):  # noqa: N802
        return self.nvrtcResult.NVRTC_SUCCESS, len(self.log)

    def nvrtcGetProgramLog(self, prog, buf):  # noqa: N802
        buf[:] = self.log.encode()  # (a bytearray here: the real call writes into the bytes it is given)
        return (self.nvrtcResult.NVRTC_SUCCESS,)

    def nvrtcGetCUBINSize(self, prog):  # noqa: N802
        return self.nvrtcResult.NVRTC_SUCCESS, len(self._cubin(prog))

    def nvrtcGetCUBIN(self, prog, buf):  # noqa: N802
        buf[:] = self._cubin(prog)
        return (self.nvrtcResult.NVRTC_SUCCESS,)

    def nvrtcDestroyProgram(self, prog):  # noqa: N802
        return (self.nvrtcResult.NVRTC_SUCCESS,)

    @staticmethod
    def _cubin(prog) -> bytes:
        return b"CUBIN:" + prog[0][:16]


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setenv("WARMLINK_CACHE_DIR", str(tmp_path))
    _env.clear_cache()
    nvrtc = FakeNvrtc()
    monkeypatch.setattr(_nvrtc, "_nvrtc", lambda: nvrtc)
    # the real GetCUBIN and GetProgramLog fill the bytes object they are given; a bytearray stands in
    monkeypatch.setattr(_nvrtc, "_buffer", bytearray)
    yield nvrtc
    _env.clear_cache()


def test_a_compiled_cubin_is_kept_on_disk_by_source_options_and_architecture(fake, tmp_path):
    first = _nvrtc.compile_cubin("__global__ void k() {}", "k", "sm_90")
    assert bytes(first) == b"CUBIN:__global__ void " and fake.compiles == 1
    assert fake.options[0][:2] == [b"--gpu-architecture=sm_90", b"-std=c++17"]
    again = _nvrtc.compile_cubin("__global__ void k() {}", "k", "sm_90")  # another process would read the same file
    assert bytes(again) == bytes(first) and fake.compiles == 1
    assert len(list((tmp_path / "cubin").glob("k-sm_90-*.cubin"))) == 1
    for source, arch, options in (("__global__ void k() { }", "sm_90", ()), ("__global__ void k() {}", "sm_100", ()),
                                  ("__global__ void k() {}", "sm_90", ("-DUNROLL=2",))):
        _nvrtc.compile_cubin(source, "k", arch, options)
    assert fake.compiles == 4 and len(list((tmp_path / "cubin").glob("k-*.cubin"))) == 4


def test_a_source_that_does_not_compile_raises_with_the_compilers_log(fake, tmp_path):
    fake.log = "stream.cu(12): error: identifier \"__half\" is undefined"
    with pytest.raises(BackendUnavailable, match=r"compiling k\.cu for sm_90 failed .*__half.* is undefined"):
        _nvrtc.compile_cubin("__global__ void k() { __half h; }", "k", "sm_90")
    assert not list(tmp_path.rglob("*.cubin"))  # nothing cached: the next process tries again


@pytest.mark.parametrize("error", [
    BackendUnavailable("warmlink._nvrtc: compiling warmlink_stream.cu for sm_90 failed: no NVRTC here"),
    TransferError("cuModuleLoadData(warmlink_stream) on cuda:0 failed: no NVRTC here (CUDA_ERROR_NO_BINARY_FOR_GPU)")],
    ids=["compile", "module load"])
def test_a_buffer_falls_back_to_triton_when_the_cuda_kernels_do_not_load(monkeypatch, caplog, error):
    from warmlink.ep.kernels import stream_cuda

    def refuse(device, num_ranks):
        raise error

    monkeypatch.delenv("WARMLINK_EP_STREAM_KERNEL", raising=False)
    monkeypatch.setattr(stream_cuda, "_kernels", refuse)
    stream_cuda.choose.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="warmlink.ep"):
            assert stream_cuda.choose(0, 2) == "triton"
        assert "CUDA streamed kernels are unavailable on cuda:0" in caplog.text and "no NVRTC here" in caplog.text
    finally:
        stream_cuda.choose.cache_clear()
