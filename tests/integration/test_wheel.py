"""The wheel carries what the package needs at run time: ``pip wheel`` builds it (offline, no
build isolation), the YAML presets are inside, and an installed copy finds a preset by name from a
directory outside the checkout, with nothing but the installed copy on ``PYTHONPATH``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_wheel_ships_the_presets_and_load_config_finds_them_anywhere(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    # build from a copy, so the checkout gets no build/ or *.egg-info
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    shutil.copytree(ROOT / "weightsync", src / "weightsync",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation",
          "--no-index", "-q", "-w", str(dist)], cwd=src)
    (wheel,) = dist.glob("weightsync-*.whl")

    presets = sorted(p.name for p in (ROOT / "weightsync" / "configs").glob("*.yaml"))
    assert "broadcast_nccl.yaml" in presets
    with zipfile.ZipFile(wheel) as zf:
        shipped = sorted(Path(n).name for n in zf.namelist()
                         if n.startswith("weightsync/configs/") and n.endswith(".yaml"))
    assert shipped == presets

    target = tmp_path / "target"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
          "--target", str(target), str(wheel)])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    code = (
        "import weightsync, weightsync.config as c\n"
        "cfg = weightsync.load_config('broadcast_nccl')\n"
        "assert cfg.strategy['type'] == 'broadcast' and cfg.strategy['backend'] == 'nccl', cfg\n"
        "assert c.read_preset('demo')['strategy']['type'] == 'broadcast'\n"
        "print(weightsync.__file__)\n"
        "print(','.join(c.preset_names()))\n"
    )
    out = _run([sys.executable, "-c", code], cwd=elsewhere, env=env).stdout.splitlines()
    assert Path(out[0]).is_relative_to(target)  # the installed copy, not the checkout
    assert out[1].split(",") == [p[: -len(".yaml")] for p in presets]
