"""Draw a pipeline step as a Gantt chart (PNG): one row per rank, one bar per compute action.

``draw`` takes spans from the simulator (``simulate.Span``) or measured by a runtime (the same
type, start and end in seconds); ``draw_schedule`` simulates a schedule and draws it.
matplotlib is imported only when drawing (``pip install 'convoy[plot]'``); no pyplot, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from convoy.errors import ConfigError
from convoy.parallel.pipeline.schedule import Kind, Schedule
from convoy.parallel.pipeline.simulate import Costs, Span, simulate

COLORS = {Kind.F: "#4c78a8", Kind.B: "#59a14f", Kind.I: "#f28e2b", Kind.W: "#e15759", Kind.H: "#b07aa1"}
NAMES = {Kind.F: "forward (F)", Kind.B: "backward (B)", Kind.I: "input grad (I)", Kind.W: "weight grad (W)",
         Kind.H: "helper forward (H)"}
FONT = 7  # points, for the labels inside bars


def _label(span: Span, with_stage: bool, room_pt: float) -> str:
    """``str(action)`` when stages matter and it fits, else the micro-batch number if that fits, else nothing."""
    for text in ([str(span.action)] if with_stage else []) + [str(span.action.mb)]:
        if len(text) * FONT * 0.62 + 2 <= room_pt:
            return text
    return ""


def draw(spans: Iterable[Span], path: str | Path, title: str = "", n_ranks: int | None = None) -> Path:
    """Write a PNG Gantt chart of ``spans`` to ``path`` and return the path.

    Only compute actions are drawn; time starts at the earliest span. A forward split with a
    helper (``action.peer`` set) is hatched. ``n_ranks`` adds rows for ranks with no spans."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ConfigError("drawing a pipeline timeline needs matplotlib; install it with "
                          "pip install 'convoy[plot]'") from exc
    bars = sorted((s for s in spans if s.action.compute), key=lambda s: (s.rank, s.start))
    rows = max([s.rank + 1 for s in bars] + [n_ranks or 1])
    t0 = min((s.start for s in bars), default=0.0)
    t1 = max((s.end for s in bars), default=1.0)
    extent = max(t1 - t0, 1e-12)
    with_stage = len({s.action.stage for s in bars if s.action.kind is not Kind.H}) > rows
    per_row = max([sum(1 for s in bars if s.rank == r) for r in range(rows)] + [1])
    width_in = min(40.0, max(8.0, 0.32 * per_row * (2 if with_stage else 1)))
    fig = Figure(figsize=(width_in, 1.2 + 0.55 * rows), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    axes_pt = width_in * 72 * 0.8  # the axes take about 80% of the figure's width
    for span in bars:
        kind, duration = span.action.kind, span.end - span.start
        split = kind is Kind.F and span.action.peer is not None
        y = rows - 1 - span.rank  # rank 0 at the top
        ax.barh(y, duration, left=span.start - t0, height=0.8, color=COLORS.get(kind, "#999999"),
                edgecolor="black", linewidth=1.2 if split else 0.4, hatch="///" if split else None)
        text = _label(span, with_stage, duration / extent * axes_pt)
        if text:
            ax.text(span.start - t0 + duration / 2, y, text, ha="center", va="center", fontsize=FONT, color="white")
    ax.set_yticks(range(rows), [f"rank {rows - 1 - y}" for y in range(rows)])
    ax.set_ylim(-0.6, rows - 0.4)
    ax.set_xlim(0, extent)
    ax.set_xlabel("time")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    present = [k for k in COLORS if any(s.action.kind is k for s in bars)]
    handles = [Patch(facecolor=COLORS[k], edgecolor="black", linewidth=0.4, label=NAMES[k]) for k in present]
    if any(s.action.kind is Kind.F and s.action.peer is not None for s in bars):
        handles.append(Patch(facecolor=COLORS[Kind.F], edgecolor="black", hatch="///", label="split forward (F@peer)"))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    try:
        fig.savefig(out, format="png", bbox_inches="tight")
    except OSError as exc:
        raise ConfigError(f"cannot write the timeline to {str(out)!r}: {exc.strerror or exc}; "
                          f"pick a path in a writable directory") from exc
    return out


def draw_schedule(schedule: Schedule, path: str | Path, costs: Costs | None = None) -> Path:
    """Simulate ``schedule`` under ``costs`` and draw it, titled with its makespan and bubble."""
    result = simulate(schedule, costs)
    title = (f"{schedule.name}: {schedule.n_stages} stages on {schedule.n_ranks} ranks, "
             f"{schedule.n_microbatches} micro-batches; makespan {result.makespan:.3f}, bubble {result.bubble:.1%}")
    return draw(result.spans, path, title, n_ranks=schedule.n_ranks)
