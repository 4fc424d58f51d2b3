"""A learning curve as a PNG (matplotlib, the ``plot`` extra): by default the RL job's, the mean return of the last
100 episodes against environment steps; the RLHF job's held-out reward against samples with its labels."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from convoy.errors import ConfigError


def plot_curve(points: Sequence[tuple[float, float]], path: Path, title: str, x_label: str = "environment steps",
               y_label: str = "mean return, last 100 episodes", marker: str = "") -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError as exc:
        raise ConfigError("plotting the learning curve needs matplotlib: pip install 'convoy[plot]'") from exc
    figure, axes = pyplot.subplots(figsize=(7, 4))
    axes.plot([p[0] for p in points], [p[1] for p in points], linewidth=1.5, marker=marker or None)
    axes.set_xlabel(x_label)
    axes.set_ylabel(y_label)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
