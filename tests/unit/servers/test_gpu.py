"""How a server starts on a GPU (``weightsync.servers._gpu``): its share of the card fitted to
the card's free memory and to the model, the dtype its ready line names, the engine core's start
method. The card's memory is given as NVML would report it: this machine has no GPU."""

from __future__ import annotations

import logging
import types

import pytest

from weightsync._runtime.gpu import GpuMemory
from weightsync.servers._gpu import (
    POLICY_GPU_SHARE,
    REWARD_GPU_SHARE,
    START_METHOD_ENV,
    GpuBudgetError,
    fit_gpu_share,
    model_bytes,
    resolve_device,
    served_dtype_note,
    start_engine_core_with_spawn,
)

GIB = 1 << 30
H200 = 140 * GIB


def _fit(asked, free, weights=GIB, default=REWARD_GPU_SHARE):
    return fit_gpu_share(asked, default=default, flag="--gpu-memory-utilization",
                         memory=GpuMemory(0, H200, free), weights_bytes=weights,
                         what="reward server")


def test_the_two_defaults_fit_one_card_together_under_vllms_own():
    assert POLICY_GPU_SHARE + REWARD_GPU_SHARE < 0.92
    share, why = _fit(None, H200)
    assert share == REWARD_GPU_SHARE and "default" in why
    # the policy server started first holds its share: the reward server's default still fits
    left = H200 - int(POLICY_GPU_SHARE * H200) - GIB
    assert _fit(None, left)[0] == REWARD_GPU_SHARE


def test_a_default_that_does_not_fit_is_lowered_to_the_free_memory():
    share, why = _fit(None, 20 * GIB)
    assert share == pytest.approx((20 * GIB - GIB) / H200, abs=0.01) and share < REWARD_GPU_SHARE
    assert "lowered" in why and "--gpu-memory-utilization" in why


def test_an_asked_share_the_card_cannot_give_is_refused_naming_the_flag():
    with pytest.raises(GpuBudgetError) as e:
        _fit(0.92, 9 * GIB)
    text = str(e.value)
    assert "--gpu-memory-utilization 0.92" in text and "pass --gpu-memory-utilization 0.05" in text
    assert "9.0 of 140.0 GiB free" in text


def test_a_share_too_small_for_the_model_is_refused_with_the_least_that_holds_it():
    with pytest.raises(GpuBudgetError) as e:
        _fit(0.05, H200, weights=15 * GIB)  # a 7B model in bf16 in 7 GiB
    text = str(e.value)
    assert "needs about 16.0 GiB" in text and "--gpu-memory-utilization 0.12 or more" in text
    with pytest.raises(GpuBudgetError, match=r"\(0, 1\]"):
        _fit(1.5, H200)


def test_without_nvml_the_share_is_taken_as_it_is():
    assert fit_gpu_share(None, default=0.6, flag="--f", memory=None, weights_bytes=None,
                         what="x") == (0.6, "the default")


def test_model_bytes_from_the_checkpoint_at_the_served_dtype(tmp_path):
    from weightsync.testing.tiny_models import build_tiny_reward_model

    d = build_tiny_reward_model(tmp_path / "rm", seed=0)
    stored = model_bytes(d, None)  # float32 as saved
    assert stored and model_bytes(d, "bfloat16") * 2 == stored
    assert model_bytes(str(tmp_path / "nothing"), None) is None


def _config(served, stored):
    return types.SimpleNamespace(dtype=served, hf_config=types.SimpleNamespace(dtype=stored))


def test_the_ready_line_says_which_dtype_is_served_and_why():
    import torch

    cast = served_dtype_note(_config(torch.float16, torch.float32), asked=None, device="cuda")
    assert cast == ("dtype float16, cast from the checkpoint's float32 by vLLM's --dtype auto on "
                    "cuda (--dtype float32 keeps it)")
    assert served_dtype_note(_config(torch.bfloat16, torch.bfloat16), asked="auto",
                             device="cuda") == "dtype bfloat16, the checkpoint's"
    assert served_dtype_note(_config(torch.float32, torch.float32), asked="float32",
                             device="cuda") == "dtype float32, as --dtype asked"
    assert served_dtype_note(_config(torch.float32, torch.float32), asked=None, device="cpu",
                             server_default="float32") == (
        "dtype float32, the server's default on cpu (--dtype sets it)")


def test_the_engine_core_starts_with_spawn_unless_the_user_chose(monkeypatch, caplog):
    log = logging.getLogger("test_gpu")
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="test_gpu"):
        assert start_engine_core_with_spawn(log) == "spawn"
    import os

    assert os.environ[START_METHOD_ENV] == "spawn" and "as `vllm serve` does" in caplog.text
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    assert start_engine_core_with_spawn(log) == "fork"


def test_devices():
    assert resolve_device("cpu") == "cpu" and resolve_device("cuda") == "cuda"
    assert resolve_device("auto") == "cpu"  # no GPU on this machine
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        resolve_device("tpu")
