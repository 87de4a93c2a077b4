"""``import weightsync`` stays light: no heavy backend is imported until it is used."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ["torch", "vllm", "ray", "deepspeed", "peft", "transformers", "omegaconf", "fastapi",
         "uvicorn", "httpx", "aiohttp"]

_PROBE = """
import json, sys
import weightsync
from weightsync import *  # noqa: F403 - every public name
import weightsync.registry, weightsync.config, weightsync.engine, weightsync.validation
import weightsync.extractors, weightsync.loaders, weightsync.strategies, weightsync.reward
import weightsync.clients, weightsync.connect, weightsync.pipeline
import weightsync.reward_loop
from weightsync.reward_loop import *  # noqa: F403 - names resolve lazily
print(json.dumps(sorted(m for m in HEAVY if m in sys.modules)))
"""


def _loaded_after(code: str) -> list[str]:
    code = code.replace("HEAVY", repr(HEAVY))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_weightsync_imports_no_heavy_dependency():
    assert _loaded_after(_PROBE) == []


def test_probe_detects_a_heavy_import():
    """The check can fail: resolving a dtype does pull in torch."""
    code = _PROBE.replace("print(", "weightsync.types.str_to_dtype('bfloat16')\nprint(", 1)
    assert "torch" in _loaded_after(code)
