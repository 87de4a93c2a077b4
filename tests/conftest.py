"""Shared pytest set-up: GPU tests skip without CUDA; vLLM/Ray state goes to a temp dir."""

from __future__ import annotations

import os
import signal
import tempfile

import pytest

_TMP = tempfile.mkdtemp(prefix="weightsync-tests-")
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(_TMP, "vllm-cache"))
os.environ.setdefault("VLLM_RPC_BASE_PATH", os.path.join(_TMP, "vllm-rpc"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.makedirs(os.environ["VLLM_RPC_BASE_PATH"], exist_ok=True)


try:  # every property test draws the same examples here and in CI (hypothesis is pinned too)
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("weightsync", derandomize=True, database=None)
    _hypothesis_settings.load_profile("weightsync")
except ImportError:  # the dev extra is not installed: no property tests to run either
    pass


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    # SIGTERM (a CI time limit, `kill`, `timeout`) ends the session the way Ctrl-C does: pytest
    # stops and tears the fixtures down, so the server processes they started (each in a session
    # of its own, 1-2 GB) stop with it instead of outliving the run
    signal.signal(signal.SIGTERM, _interrupt)


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def trace_timeline():
    """``benchmarks/trace_timeline.py`` as a module (benchmarks/ is not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "trace_timeline.py"
    spec = importlib.util.spec_from_file_location("trace_timeline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
