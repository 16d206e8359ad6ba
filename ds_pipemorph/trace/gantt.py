"""Gantt picture of an op timeline: one row per stage, F/B/W coloured, bubbles left blank.

The picture's format follows the output file's suffix (``.png``, ``.pdf``, ``.svg``, ... whatever
matplotlib can save); ``image_format`` refuses any other suffix before work starts.
"""
from __future__ import annotations

import io
from pathlib import Path

from ..fileio import BadInput
from ..plan.ir.ops import KINDS, Kind
from ..plan.sim.timeline import Timeline

COLORS = {Kind.F: "#4C72B0", Kind.B: "#DD8452", Kind.W: "#55A868"}
LABELS = {Kind.F: "F (forward)", Kind.B: "B (backward-input)", Kind.W: "W (backward-weight)"}


def _matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        return matplotlib
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("--gantt needs matplotlib: pip install 'ds_pipemorph[plot]'") from e


def image_format(path: str | Path, what: str = "--gantt") -> str:
    """The picture format matplotlib writes for ``path``'s suffix; BadInput naming the choices if none."""
    _matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    fmt = Path(path).suffix.lower().lstrip(".")
    if fmt not in kinds:
        shown = f"'.{fmt}'" if fmt else "no suffix"
        raise BadInput(f"{what}: {path} has {shown}; name a picture file ending in "
                       f"{', '.join('.' + k for k in sorted(kinds))}")
    return fmt


def gantt_image(tl: Timeline, title: str = "", links_ms: list[float] | None = None, fmt: str = "png") -> bytes:
    """The picture's bytes in format ``fmt`` (``image_format``'s answer; write them atomically where
    they should go). Needs matplotlib (``plot`` extra).

    ``links_ms``: delays to mark between the rows of the stages a slow link joins.
    """
    _matplotlib()
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = min((s.start for s in tl.slots), default=0.0)
    width = max(8.0, min(16.0, tl.iteration_ms / 60.0))
    fig, ax = plt.subplots(figsize=(width, 0.75 * tl.stages + 1.6))
    show_text = len(tl.slots) <= 400
    for slot in tl.slots:
        y = tl.stages - 1 - slot.stage
        ax.broken_barh([(slot.start - t0, slot.end - slot.start)], (y - 0.4, 0.8),
                       facecolors=COLORS[slot.op.kind], edgecolor="white", linewidth=0.5)
        if show_text and slot.end - slot.start >= tl.iteration_ms / 90:
            ax.text((slot.start + slot.end) / 2 - t0, y, str(slot.op.mb), ha="center", va="center",
                    fontsize=7, color="white")
    for i, c in enumerate(links_ms or []):
        if c > 0:  # a slow link sits between the rows of stage i and i+1
            ax.annotate(f"link {i}: +{c:g} ms", xy=(0, tl.stages - 1.5 - i), xytext=(4, 0), textcoords="offset points",
                        color="#C44E52", fontsize=8, fontweight="bold", va="center")
    ax.set_yticks(range(tl.stages))
    ax.set_yticklabels([f"stage {s}" for s in reversed(range(tl.stages))])
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, tl.iteration_ms)
    summary = f"iteration {tl.iteration_ms:.1f} ms, bubble rate {tl.bubble_rate:.1%}"
    ax.set_title(f"{title}: {summary}" if title else summary)
    ax.legend(handles=[Patch(color=COLORS[k], label=LABELS[k]) for k in KINDS] + [Patch(facecolor="white", edgecolor="grey", label="bubble (idle)")],
              loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4, frameon=False, fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=110)
    plt.close(fig)
    return buf.getvalue()
