"""The ``weightsync`` command: ``bench``, ``demo``, ``serve-reward``, ``serve-policy``,
``make-model``.

A dispatcher only: each subcommand hands its remaining arguments to the ``main(argv)`` of its
own module (``_SUBCOMMANDS``: ``weightsync.bench.cli``, ``weightsync.demo.cli``,
``weightsync.servers.reward``, ``weightsync.servers.policy``,
``weightsync.testing.make_model``), imported only when chosen, so
``weightsync bench --help`` stays fast. Bad arguments exit with status 2 and a message that
names the argument and lists the valid values.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

_SUBCOMMANDS = {
    "bench": ("weightsync.bench.cli", "main", "weight-sync bandwidth benchmark"),
    "demo": ("weightsync.demo.cli", "main", "RLHF with a vLLM reward and policy server, on CPU or GPU (the main job)"),
    "serve-reward": (
        "weightsync.servers.reward", "main", "serve a reward model on vLLM with weight-sync endpoints"
    ),
    "serve-policy": (
        "weightsync.servers.policy", "main",
        "serve a causal LM: vLLM's OpenAI server plus weight-sync endpoints",
    ),
    "make-model": (
        "weightsync.testing.make_model", "main",
        "write a tiny policy or reward model (tokenizer, chat template) to serve, offline",
    ),
}


def _delegate(name: str) -> Callable[[list[str]], int | None]:
    module, attr, _ = _SUBCOMMANDS[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        missing = e.name or ""
        if missing and (module == missing or module.startswith(missing + ".")):
            raise SystemExit(
                f"weightsync {name}: module {module} is missing from this installation "
                f"({e}); reinstall weightsync from a complete checkout"
            ) from None
        raise SystemExit(
            f"weightsync {name}: importing {module} failed: {e}; install the extra it needs: "
            f"pip install 'weightsync[vllm]' (CPU) or 'weightsync[gpu]' (GPU)"
        ) from None
    fn = getattr(mod, attr, None)
    if fn is None:
        raise SystemExit(f"weightsync {name}: {module} has no {attr}(argv) entry point")
    return fn


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = argparse.ArgumentParser(
        prog="weightsync",
        description="Move freshly trained weights into running inference engines.",
    )
    sub = top.add_subparsers(dest="command", metavar="{" + ",".join(_SUBCOMMANDS) + "}")
    for name, (_, _, help_) in _SUBCOMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command in _SUBCOMMANDS:
        rc = _delegate(command)(rest)
        return int(rc or 0)
    top.error(f"unknown command {command!r}; valid commands: {', '.join(_SUBCOMMANDS)}")
    return 2  # pragma: no cover - error() exits


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
