"""``weightsync demo``, the main job: RLHF on CPU with tiny models and two vLLM servers
(``--mode rlhf``, the default), or one train -> sync -> score cycle of a reward model
(``--mode head_only`` / ``full``).

- ``cli``: the command line (``main(argv)``, ``build_parser``, ``apply_overrides``,
  ``summary_table``, ``rlhf_tables``); ``python -m weightsync.demo``.
- ``rlhf``: the RLHF loop (``run_rlhf(cfg) -> RLHFResult``), for library use; ``task`` (the
  hidden judge and its preference pairs), ``policy`` (sampling from the policy server, the
  trainer's policy copy), ``plot`` (the PNG).
- ``run``: the reward-model cycle (``run_demo(cfg) -> DemoResult``).
- ``config`` (typed config, the ``demo`` preset), ``data`` (synthetic preferences), ``train``
  (Bradley-Terry), ``report``; the servers run as subprocesses (``weightsync.testing.servers``).
"""

from weightsync.demo.cli import apply_overrides, build_parser, main, rlhf_tables, summary_table
from weightsync.demo.run import DemoResult, run_demo, strategy_label

__all__ = [
    "DemoResult", "apply_overrides", "build_parser", "main", "rlhf_tables", "run_demo",
    "strategy_label", "summary_table",
]
