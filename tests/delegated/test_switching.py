"""A link switches direct -> delegated -> direct at iteration boundaries, and grows its delegate queues,
with nothing lost or reordered."""
import bodies
import pytest
from workers import launch

N = 6
MODES = ["direct", "delegated", "direct", "delegated", "delegated:3", "direct", "delegated"]


@pytest.mark.timeout(150)
def test_switch_at_boundaries_keeps_every_message_once_and_in_content():
    res = launch(2, bodies.switching, MODES, N)
    f_got = [g for g in res[1] if g[1] == "F"]
    b_got = [g for g in res[0] if g[1] == "B"]
    assert [(it, m) for it, _, m, *_ in f_got] == [(it, m) for it in range(len(MODES)) for m in range(N)]
    for it, _, m, a, c in f_got:
        assert a == [it, m] and c == [float(m)] * 3
    for it, _, m, b in b_got:
        assert b == [it, m, 100]
    assert len(b_got) == len(MODES) * N
    # Each iteration used the path it was switched to (counted on the sending side of each direction).
    for r in (0, 1):
        used = [g[2] for g in res[r] if g[1] == "delegated_sends"]
        assert used == [N if m.startswith("delegated") else 0 for m in MODES]
        # queue=1 in use at first; growing to 3 uses three per direction, kept after
        queues = [(g[2], g[3]) for g in res[r] if g[1] == "queues"]
        assert queues == [(1, 0), (1, 2), (1, 2), (1, 2), (3, 6), (3, 6), (3, 6)]
        # ... whose delegates (max(queues, 4) per direction) started with the link: nothing starts
        # or restarts to grow
        pids = [g[2] for g in res[r] if g[1] == "pids"]
        for key, first in pids[1].items():
            assert len(first) == 4 and all(p[key] == first for p in pids[1:]), f"rank {r}: delegates of {key} changed"

