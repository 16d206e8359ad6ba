"""Functions run in spawned processes by the two-process staging tests (importable by name)."""
import torch

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8, torch.float64]


def message(i: int, max_bytes: int) -> torch.Tensor:
    """Message i of the stream: dtype, shape and bytes all derived from i, so both sides can rebuild it."""
    g = torch.Generator().manual_seed(1000 + i)
    dtype = DTYPES[i % len(DTYPES)]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if i % 50 == 7:
        numel = max_bytes // itemsize  # exactly (or just under) a full slot
    elif i % 50 == 8:
        numel = 0
    else:
        numel = int(torch.randint(1, max_bytes // itemsize + 1, (1,), generator=g))
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2  # only 0/1 are valid bools
    t = raw.view(dtype)
    if numel % 6 == 0 and numel > 0:
        t = t.view(2, 3, numel // 6)
    return t


def produce(name: str, count: int, max_bytes: int) -> None:
    from ds_pipemorph.staging import StagingRing
    from ds_pipemorph.staging.builder import StagingRingBuilder

    op = StagingRingBuilder().load()
    with StagingRing.attach(name, timeout_s=60.0, op=op) as ring:
        for i in range(count):
            ring.push(message(i, max_bytes), tag=10_000 + i, timeout_s=60.0)
