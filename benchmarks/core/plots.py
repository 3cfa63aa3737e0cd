"""The report's shared chart: paired bars of output tokens/s per concurrency level (matplotlib axes)."""

from __future__ import annotations


def paired_bars(ax, concurrency, title: str, left: tuple, right: tuple) -> None:
    """Two bars (label, color, values) per concurrency level, output tokens/s."""
    xs = list(range(len(concurrency)))
    for offset, (label, color, values) in ((-0.2, left), (0.2, right)):
        ax.bar([x + offset for x in xs], values, 0.4, label=label, color=color)
    ax.set_xticks(xs, [str(c) for c in concurrency])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title)
    ax.legend(fontsize=8)
