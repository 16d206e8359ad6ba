"""Random layer profiles for the partition tests (shared by test_partition and test_partition_slowdown)."""
from __future__ import annotations

import random


def random_layer_data(rng: random.Random, capacity_p: float) -> dict:
    """Up to 10 layers, 4 stages, 10 micro-batches: integer-ish times (ties happen), boundary sizes
    from free to slow, and memory from unlimited to tight enough that some cuts do not fit (a
    per-stage capacity with probability ``capacity_p``, a cap on in-flight activations with 0.3)."""
    L = rng.randint(2, 10)
    S = rng.randint(1, min(L, 4))
    N = rng.randint(1, 10)
    pick = lambda xs: [rng.choice(xs) for _ in range(L)]  # noqa: E731
    d = {
        "stages": S, "microbatches": N,
        "layers": {"forward_ms": pick([0, 1, 2, 3, 5, 2.5]), "backward_input_ms": pick([0, 1, 2, 4, 3.3]),
                   "backward_weight_ms": pick([0, 1, 2, 0.7]), "activation_mb": pick([0, 1, 4, 16, 50]),
                   "memory_mb": pick([0, 10, 30]), "stash_mb": pick([0, 2, 5])},
        "links": {"bandwidth_gbs": [rng.choice([0.5, 1, 4]) for _ in range(S - 1)],
                  "latency_ms": [rng.choice([0, 0, 3, 10]) for _ in range(S - 1)]},
    }
    if rng.random() < capacity_p:
        d["memory"] = {"capacity_mb": [rng.choice([40, 60, 100, 200]) for _ in range(S)]}
    if rng.random() < 0.3:
        d.setdefault("memory", {})["max_inflight"] = [rng.randint(1, N) for _ in range(S)]
    return d
