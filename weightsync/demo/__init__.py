"""``weightsync demo``, the main job: train a tiny vLLM-served reward model's head in this
process, publish it through a weight-sync strategy, and check served scores == transformers.

- ``cli``: the command line (``main(argv)``, ``build_parser``, ``apply_overrides``,
  ``summary_table``); ``python -m weightsync.demo``.
- ``run``: the cycle itself (``run_demo(cfg) -> DemoResult``), for library use.
- ``config`` (typed config, the ``demo`` preset), ``data`` (synthetic preferences), ``train``
  (Bradley-Terry head), ``server`` (the reward server as a subprocess), ``report``.
"""

from weightsync.demo.cli import apply_overrides, build_parser, main, summary_table
from weightsync.demo.run import DemoResult, run_demo, strategy_label

__all__ = [
    "DemoResult", "apply_overrides", "build_parser", "main", "run_demo", "strategy_label",
    "summary_table",
]
