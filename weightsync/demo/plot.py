"""The RLHF demo's PNG: mean reward and sync time per step (matplotlib, the ``demo`` extra).

``plot_steps(steps, path)`` writes the figure and returns the path, or returns None when
matplotlib is not installed; ``matplotlib_missing()`` says why and how to get it (the demo prints
that and goes on: the plot is a view of the JSON record, never needed for a pass).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

INSTALL_HINT = "pip install 'weightsync[demo]' (matplotlib)"


def matplotlib_missing() -> str | None:
    """None when matplotlib imports, else why not and how to get it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        return f"matplotlib is not installed ({e}); {INSTALL_HINT}"
    return None


def plot_steps(steps: Sequence[Mapping[str, Any]], path: str, *, title: str = "") -> str | None:
    """Two panels over ``step``: ``mean_reward`` (and ``judge_score`` when present) above,
    ``sync_seconds`` below. -> ``path``, or None when matplotlib is missing."""
    if matplotlib_missing() is not None:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    xs = [int(s["step"]) for s in steps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(xs, [s["mean_reward"] for s in steps], marker="o", label="mean reward (reward model)")
    if all(s.get("judge_score") is not None for s in steps):
        judge = top.twinx()
        judge.plot(xs, [s["judge_score"] for s in steps], marker="s", color="tab:green",
                   alpha=0.6, label="judge score (hidden rule)")
        judge.set_ylabel("judge score")
        judge.legend(loc="lower right")
    top.set_ylabel("mean reward")
    top.legend(loc="upper left")
    top.grid(alpha=0.3)
    if title:
        top.set_title(title)
    bottom.bar(xs, [1e3 * s["sync_seconds"] for s in steps], color="tab:orange")
    bottom.set_ylabel("policy sync (ms)")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
