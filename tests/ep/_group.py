"""Run a function in N spawned rank processes around one rendezvous store (ep tests).

Every wait is bounded; a rank that raises or dies fails the call with its traceback and the other
ranks are killed, so a broken protocol fails a test instead of hanging it.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback

CTX = mp.get_context("spawn")


class _Packed:
    """A tensor as plain bytes: torch's queue pickling shares memory through file descriptors that
    die with the rank process."""

    def __init__(self, t) -> None:
        self.dtype, self.shape = str(t.dtype).removeprefix("torch."), tuple(t.shape)
        self.data = t.detach().cpu().contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()

    def unpack(self):
        import torch

        flat = torch.frombuffer(bytearray(self.data), dtype=torch.uint8) if self.data else torch.empty(0, dtype=torch.uint8)
        return flat.view(getattr(torch, self.dtype)).reshape(self.shape)


def _pack(value):
    import torch

    if isinstance(value, torch.Tensor):
        return _Packed(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_pack(v) for v in value)
    if isinstance(value, dict):
        return {k: _pack(v) for k, v in value.items()}
    return value


def _unpack(value):
    if isinstance(value, _Packed):
        return value.unpack()
    if isinstance(value, (list, tuple)):
        return type(value)(_unpack(v) for v in value)
    if isinstance(value, dict):
        return {k: _unpack(v) for k, v in value.items()}
    return value


def _rank_main(fn, rank: int, num_ranks: int, address: str, secret: str, prefix: str, kwargs: dict, results) -> None:
    try:
        import os

        import torch

        from warmlink.rendezvous import Store

        # a share of the cores each: ranks with a thread per core spin against each other on CI
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_ranks))

        with Store.connect(address, prefix=prefix, timeout_s=30, secret=secret) as store:
            value = fn(rank=rank, num_ranks=num_ranks, store=store, **kwargs)
        results.put((rank, "ok", _pack(value)))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit, to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, num_ranks: int, timeout_s: float = 90.0, prefix: str = "ep-test", **kwargs) -> list:
    """``[fn(rank=r, num_ranks=R, store=Store, **kwargs) for r]``, each in its own process."""
    from warmlink.rendezvous import Store

    server = Store(is_server=True, prefix=prefix, timeout_s=30)
    results = CTX.Queue()
    procs = [CTX.Process(target=_rank_main, args=(fn, r, num_ranks, server.address, server.secret, prefix, kwargs, results), daemon=True)
             for r in range(num_ranks)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) + len(errors) < num_ranks:
            try:
                rank, status, value = results.get(timeout=0.25)
            except queue.Empty:
                gone = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out]
                if gone and results.empty():
                    time.sleep(0.5)  # a result put just before exiting may still be in the pipe
                    if results.empty():
                        crashed = [r for r in gone if procs[r].exitcode != 0]
                        if crashed:
                            errors.append(f"ranks {crashed} died (exit codes {[procs[r].exitcode for r in crashed]})")
                            break
                        for r in gone:  # left on purpose (os._exit(0)) without a result
                            out[r] = "exited"
                if time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout_s} s; finished ranks {sorted(out)}")
                    break
                continue
            if status == "ok":
                out[rank] = _unpack(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        server.close()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [out[r] for r in range(num_ranks)]
