"""``weightsync serve-policy`` arguments: ours are taken out, everything else goes through vLLM's
own parser; CPU defaults apply only where the user gave nothing."""

from __future__ import annotations

import pytest

from weightsync.loaders.vllm_worker import WORKER_EXTENSION

pytestmark = pytest.mark.slow  # imports vllm's argument parser (~5 s)


def parse(argv, device="cpu"):
    from weightsync.servers.policy import parse_args

    return parse_args(argv, device=device)


def test_cpu_defaults_and_ours(monkeypatch):
    monkeypatch.delenv("WEIGHTSYNC_API_KEY", raising=False)
    cfg, args = parse(["--model", "m", "--max-model-len", "123"])
    assert (cfg.host, cfg.port, cfg.api_key) == ("127.0.0.1", 8000, None)
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    assert args.model == "m" and args.max_model_len == 123
    assert args.dtype == "float32" and args.enforce_eager is True
    assert args.kv_cache_memory_bytes == 256 << 20
    assert args.worker_extension_cls == WORKER_EXTENSION


def test_vllm_arguments_pass_through_and_win_over_defaults(monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_API_KEY", "from-env")
    cfg, args = parse(["m", "--dtype", "bfloat16", "--no-enforce-eager", "--tensor-parallel-size",
                       "2", "--kv-cache-memory-bytes", "1000", "--served-model-name", "pol",
                       "--host", "0.0.0.0", "--port", "9000", "--request-wait-timeout-s", "5"])
    assert args.model == "m" and args.dtype == "bfloat16" and args.enforce_eager is False
    assert args.tensor_parallel_size == 2 and args.kv_cache_memory_bytes == 1000
    assert args.served_model_name == ["pol"]
    assert (cfg.host, cfg.port, cfg.api_key, cfg.request_wait_timeout_s) == (
        "0.0.0.0", 9000, "from-env", 5.0)
    assert parse(["--model", "m", "--api-key", "flag"])[0].api_key == "flag"
    kept, _ = parse(["--model", "m", "--in-flight-requests", "continue", "--in-flight-kv", "keep"])
    assert (kept.in_flight_requests, kept.in_flight_kv) == ("continue", "keep")
    assert cfg.in_flight_kv == "recompute"
    assert cfg.adapter_slots == 1
    slotted, _ = parse(["--model", "m", "--enable-lora", "--adapter-slots", "2"])
    assert slotted.adapter_slots == 2
    _, gpu = parse(["--model", "m"], device="cuda")
    assert gpu.dtype == "auto" and gpu.kv_cache_memory_bytes is None


@pytest.mark.parametrize("argv, needle", [
    (["--dtype", "float32"], "--model is required"),
    (["--model", "m", "--worker-extension-cls", "x.Y"], "--worker-extension-cls"),
    (["--model", "m", "--no-such-flag"], "no-such-flag"),
    (["--model", "m", "--in-flight-kv", "keep"], "--in-flight-kv keep needs --in-flight-requests "
                                                 "continue"),
    (["--model", "m", "--in-flight-kv", "drop"], "--in-flight-kv"),
    (["--model", "m", "--adapter-slots", "2"], "--adapter-slots keeps versions of LoRA adapters: "
                                                "it needs --enable-lora"),
    (["--model", "m", "--enable-lora", "--adapter-slots", "0"], "--adapter-slots must be >= 1"),
    (["--model", "m", "--enable-lora", "--adapter-slots", "2", "--in-flight-requests",
      "continue"], "--adapter-slots keeps each request on the adapter version it started with"),
])
def test_bad_arguments_exit_2_naming_them(capsys, argv, needle):
    with pytest.raises(SystemExit) as ei:
        parse(argv)
    assert ei.value.code == 2
    assert needle in capsys.readouterr().err


def test_warmup_is_on_unless_turned_off_and_help_says_its_cost(capsys):
    assert parse(["--model", "m"])[0].warmup is True
    assert parse(["--model", "m", "--no-warmup"])[0].warmup is False
    with pytest.raises(SystemExit):
        parse(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--warmup, --no-warmup" in text and "costs at start: 7-13 s on 2 CPU cores" in text


def test_versions_are_taken_as_given_unless_monotonic_versions(capsys):
    """The reward spec's rule is the default on both servers; ``--monotonic-versions`` keeps
    ours; the deprecated ``--allow-version-reset`` is accepted, but not with it."""
    assert parse(["--model", "m"])[0].monotonic_versions is False
    assert parse(["--model", "m", "--monotonic-versions"])[0].monotonic_versions is True
    assert parse(["--model", "m", "--allow-version-reset"])[0].allow_version_reset is True
    with pytest.raises(SystemExit):
        parse(["--model", "m", "--monotonic-versions", "--allow-version-reset"])
    assert "(--monotonic-versions) contradict each other" in capsys.readouterr().err
