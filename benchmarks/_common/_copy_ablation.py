"""What the delegated path's two staging copies cost: modes that skip one or both (benchmarks only).

A delegated message is copied into a send ring slot by the sending training process (the copy that
delegation is made of: the training process copies the tensor into a staging slot and goes on) and
out of a receive ring slot by the receiving one. The ablation modes run the same all-delegated
pipeline with one or both of those copies skipped (the message header still goes through, so sizes,
order and acknowledgements are real), which isolates their cost from everything else on the path (delegate processes, rings, extra Gloo
messages, hand-offs). The data that arrives is garbage: these modes measure time, never correctness,
and the library has no such switch; ``install`` patches the rank process it runs in.
"""
from __future__ import annotations

SKIPS = {"delegated-all": frozenset(), "delegated-no-send-copy": frozenset({"send"}),
         "delegated-no-recv-copy": frozenset({"recv"}), "delegated-no-copies": frozenset({"send", "recv"})}
MODES = [m for m in SKIPS if m != "delegated-all"]

_skip: frozenset = frozenset()


def install() -> None:
    """Wrap ``framing.copy_range`` of the delegated transport in this process so that ``select`` can skip copies."""
    from ds_pipemorph.runtime.transport.delegated import framing

    real = framing.copy_range

    def copy_range(segs, a, b, piece, into_piece, spans=None):
        if ("send" if into_piece else "recv") in _skip:
            segs = [s for s in segs if s[0] == 0]  # the header segment only (the send side has it at offset 0)
        real(segs, a, b, piece, into_piece, spans)

    framing.copy_range = copy_range


def select(mode: str) -> bool:
    """Skip the copies of ``mode`` from now on; False if the data of this mode arrives intact."""
    global _skip
    _skip = SKIPS.get(mode, frozenset())
    return not _skip
