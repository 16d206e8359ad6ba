"""Functions run in spawned rank processes by the delegated-transport tests (importable by name)."""
import os
import time
import traceback

import torch
import torch.distributed as dist

from ds_pipemorph.procs import free_port


def payload(kind: str, mb: int):
    """Message (kind, mb): a mix of dtypes, shapes and structures that both sides can rebuild."""
    g = torch.Generator().manual_seed(7919 * mb + (1 if kind == "F" else 2))
    choice = mb % 5
    if choice == 0:
        return torch.randn(4, 6, generator=g)
    if choice == 1:
        return (torch.randn(3, generator=g).to(torch.bfloat16), torch.randint(0, 2, (5, 2), generator=g).bool(),
                torch.tensor(mb, dtype=torch.int64))
    if choice == 2:
        return (torch.arange(mb * 10, dtype=torch.int64).reshape(-1, 2), torch.empty(0, 3))
    if choice == 3:
        return torch.randn(2, 3, 4, generator=g, dtype=torch.float64).transpose(0, 2)  # not contiguous
    return (torch.tensor(True), torch.randn(1, 1, 1, 1, generator=g).half(), torch.randn(2, generator=g) + 1j)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    return isinstance(b, tuple) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def run(rank: int, world: int, port: int, out, body, *args) -> None:
    """Join the gloo job (rank i = stage i), run ``body(rank, *args)``, put (rank, result or error) on ``out``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out.put((rank, body(rank, world, *args)))
    except BaseException:
        out.put((rank, "ERROR " + traceback.format_exc()))
    finally:
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:
            pass


def launch(world: int, body, *args, timeout: float = 150.0) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=run, args=(r, world, port, out, body, *args)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    try:
        for _ in range(world):
            r, res = out.get(timeout=max(1.0, deadline - time.monotonic()))
            results[r] = res
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    for r, res in results.items():
        assert not (isinstance(res, str) and res.startswith("ERROR")), f"rank {r}:\n{res}"
    return results
