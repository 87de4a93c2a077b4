"""``cpu_core_slots``: disjoint core lists for vLLM CPU engines started together."""

from __future__ import annotations

import pytest

from weightsync.testing.servers import CPU_BIND_ENV, ServerProcess, cpu_core_slots


@pytest.fixture(autouse=True)
def _no_user_binding(monkeypatch):
    monkeypatch.delenv(CPU_BIND_ENV, raising=False)


@pytest.mark.parametrize(("n", "cores", "want"), [
    (2, [0, 1], ["0", "1"]),  # the CI box: one core each, none left over
    (2, [0, 1, 2, 3], ["0-1", "2-3"]),
    (2, list(range(16)), ["0-6", "7-13"]),  # 2n + 1 or more: the last core for the front ends
    (3, [4, 5, 6, 7, 8, 9, 10], ["4-5", "6-7", "8-9"]),
    (2, [0], [None, None]),  # fewer cores than engines: vLLM's own binding
    (1, [0, 1], [None]),  # one engine: nothing to share
])
def test_slots_are_disjoint_runs_of_the_cores(n, cores, want):
    assert cpu_core_slots(n, cores) == want


def test_a_binding_the_user_set_wins(monkeypatch):
    monkeypatch.setenv(CPU_BIND_ENV, "3")
    assert cpu_core_slots(2, [0, 1, 2, 3]) == [None, None]


def test_the_server_process_passes_its_slot_to_vllm(tmp_path):
    server = ServerProcess(str(tmp_path), scratch_dir=str(tmp_path), module="m", cpu_cores="1")
    assert server.env[CPU_BIND_ENV] == "1"
    assert CPU_BIND_ENV not in ServerProcess(str(tmp_path), scratch_dir=str(tmp_path),
                                             module="m").env


def test_servers_start_through_the_cli_without_the_callers_own_variables(tmp_path, monkeypatch):
    from weightsync.testing.servers import CALLER_ONLY_ENV, PolicyServerProcess

    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # set for in-process engines
    server = PolicyServerProcess(str(tmp_path), scratch_dir=str(tmp_path))
    assert server.cmd[1:4] == ["-m", "weightsync.cli", "serve-policy"]
    assert not set(CALLER_ONLY_ENV) & set(server.env)
    given = PolicyServerProcess(str(tmp_path), scratch_dir=str(tmp_path),
                                env={"VLLM_WORKER_MULTIPROC_METHOD": "fork"})
    assert given.env["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"  # passed on on purpose
