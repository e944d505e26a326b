"""A full /dev/shm is a PoolError naming the bytes wanted and free, never a SIGBUS; see Note
[Reserved shm] in ``warmlink.pool.arenas``.

The end-to-end cases run a child in its own mount namespace with a 64 MiB tmpfs on /dev/shm
(Docker's default size). They need root (or a kernel that lets this user make mount
namespaces) and skip, saying why, where mounting is not permitted.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from warmlink.errors import PoolError
from warmlink.pool import arenas, lease_arena

MiB = 1 << 20

# A private mount namespace with its own small tmpfs on /dev/shm, then python.
_SMALL_SHM = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
              'mount -t tmpfs -o size=64m,mode=1777 wl-test /dev/shm && exec "$@"', "sh"]


@pytest.fixture(scope="module")
def small_shm():
    """Runs python code in a child that sees a 64 MiB /dev/shm; skips where that cannot be made."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) on this machine")
    probe = subprocess.run(_SMALL_SHM + ["true"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a 64 MiB tmpfs on /dev/shm in a private mount namespace: {probe.stderr.strip()}")

    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run(_SMALL_SHM + [sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                              text=True, timeout=300)

    return run


def _ok(done: subprocess.CompletedProcess) -> str:
    # A SIGBUS shows as returncode -7 (or 135 through a shell): the bug this file is about.
    assert done.returncode == 0, f"child exited {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done.stdout


def test_export_of_128_mib_into_64_mib_is_a_pool_error_and_publishes_nothing(small_shm) -> None:
    out = _ok(small_shm("""
        import os, torch
        from warmlink.errors import PoolError
        from warmlink.pool import arenas
        from warmlink.refit import Publisher, protocol
        from warmlink.rendezvous import Store

        with Store("127.0.0.1", 0, is_server=True, prefix="small-shm", timeout_s=60) as store:
            pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=60)
            pub.add("w", torch.ones(64 << 20, dtype=torch.int16))  # 128 MiB, staged into shared memory
            try:
                pub.export()
                print("EXPORTED")
            except PoolError as exc:
                print("POOLERROR", exc)
            print("STATE", store.try_get(protocol.state_key(0)))
            print("FILES", [n for n in os.listdir(arenas.SHM_DIR) if n.startswith(arenas.shm_prefix())])
    """))
    assert "EXPORTED" not in out
    # the tensor behind the publisher's version header (Note [Version header]), in 2 MiB arenas
    assert f"POOLERROR lease_arena: nbytes={130 * MiB} does not fit in /dev/shm (" in out
    assert "bytes free of 67108864" in out  # what is free, of the 64 MiB
    assert "STATE None" in out  # no version announced
    assert "FILES []" in out  # the half-made file is gone


def test_refit_whose_buffers_do_not_fit_is_a_pool_error_and_holds_no_reader(small_shm) -> None:
    out = _ok(small_shm("""
        import os, torch
        from warmlink.errors import PoolError
        from warmlink.pool import arenas
        from warmlink.refit import Publisher, Receiver, TensorLayout, protocol
        from warmlink.rendezvous import Store

        n = 10 << 20  # 40 MiB of float32: the publisher's staging fits, the receiver's buffers do not
        layout = TensorLayout.plain("w", "float32", (n,))
        with Store("127.0.0.1", 0, is_server=True, prefix="small-shm", timeout_s=60) as store:
            pub = Publisher(store, rank=0, world_size=1, backend="shm", timeout_s=60)
            pub.add("w", torch.arange(n, dtype=torch.float32), layout)
            pub.export()
            rec = Receiver(store, num_publishers=1, backend="shm", install="copy", timeout_s=60)
            target = torch.zeros(n, dtype=torch.float32)
            rec.add("w", layout, target)
            try:
                rec.refit()
                print("REFITTED")
            except PoolError as exc:
                print("POOLERROR", exc)
            print("READERS", protocol.reader_count(store, 0, 1))
            print("FILES", len([n for n in os.listdir(arenas.SHM_DIR) if n.startswith(arenas.shm_prefix())]))
            pub.begin_update(timeout_s=30)  # nobody is left counted in
            print("UPDATED", pub.publish())
            print("UNTOUCHED", bool((target == 0).all()))
            rec.close()
            pub.close()
    """))
    assert "REFITTED" not in out
    assert f"POOLERROR lease_arena: nbytes={40 * MiB} does not fit in /dev/shm (" in out
    assert "READERS 0" in out and "UPDATED 2" in out and "UNTOUCHED True" in out
    assert "FILES 2" in out  # the publisher's staging and its version board only


def test_no_space_is_a_pool_error_naming_bytes_and_leaves_no_file(monkeypatch) -> None:
    """The same path without mounting anything: posix_fallocate answers ENOSPC."""

    def full(fd: int, offset: int, nbytes: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    before = {n for n in os.listdir(arenas.SHM_DIR) if n.startswith(arenas.shm_prefix())}
    monkeypatch.setattr(os, "posix_fallocate", full)
    nbytes = 26 * MiB - 7  # a size class of its own: no idle arena answers
    with pytest.raises(PoolError, match=rf"lease_arena: nbytes={26 * MiB} does not fit in /dev/shm \(\d+ bytes free of \d+"):
        lease_arena("shm", nbytes)
    monkeypatch.undo()
    assert {n for n in os.listdir(arenas.SHM_DIR) if n.startswith(arenas.shm_prefix())} == before
    with lease_arena("shm", nbytes) as arena:  # and the next try, with space, works
        assert arena.nbytes == 26 * MiB
