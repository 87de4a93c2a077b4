"""Where the demo's servers run and how weights reach them: on CPU as before, on one GPU beside a
trainer on that GPU (CUDA IPC), or on a second GPU (NCCL broadcast from the trainer's GPU 0).

Callers: ``weightsync.demo.cli`` (the default strategy for ``--device cuda``) and the demo's runs
(``weightsync.demo.rlhf``, ``weightsync.demo.run``), which start the servers as the plan says.
The servers size their own share of a GPU (``weightsync serve-policy`` / ``serve-reward``
defaults fit together on one card); on a GPU they are started one after the other, because
vLLM measures the card's free memory while it starts and another engine starting beside it
would be counted as its own use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: server flags on a GPU: the demo's checks compare served scores and log-probabilities with
#: the trainer's float32 model exactly, and its tiny models start faster without CUDA graphs
GPU_SERVER_ARGS = ("--dtype", "float32", "--enforce-eager")


@dataclass(frozen=True)
class Placement:
    """How the demo lays out its processes.

    Attributes:
        servers_on_gpu: whether vLLM's servers run on a GPU (any is visible).
        server_env: environment added to both servers (``CUDA_VISIBLE_DEVICES``).
        server_args: flags added to both servers.
        describe: one line for the progress output.
    """

    servers_on_gpu: bool
    server_env: dict[str, str] = field(default_factory=dict)
    server_args: tuple[str, ...] = ()
    describe: str = "servers on CPU"

    @property
    def start_one_by_one(self) -> bool:
        """On a GPU each server starts once the one before it is up (see the module doc)."""
        return self.servers_on_gpu


def visible_gpus() -> int:
    """GPUs this process sees, counted without initialising CUDA."""
    from weightsync._runtime.gpu import cuda_device_count

    return cuda_device_count()


def default_gpu_strategy(gpus: int) -> dict[str, Any]:
    """The strategy for a trainer on ``cuda`` when none was chosen: NCCL broadcast into servers
    on the second GPU when there are two, else CUDA IPC into servers on the trainer's GPU (NCCL
    takes one rank per GPU)."""
    if gpus >= 2:
        return {"type": "broadcast", "backend": "nccl"}
    return {"type": "cuda_ipc"}


def plan_placement(train_device: str, strategy: dict[str, Any], gpus: int | None = None
                   ) -> Placement:
    """Where the servers go for a trainer on ``train_device`` sending with ``strategy``.

    Args:
        train_device: ``cpu`` or ``cuda`` (the trainer's device, GPU 0).
        strategy: the strategy config the trainer pushes with.
        gpus: GPUs visible (default: counted).

    Returns:
        The ``Placement``: servers on CPU without a GPU; with a trainer on ``cuda`` pushing over
        NCCL and two GPUs, servers on GPU 1; otherwise on GPU 0.
    """
    gpus = visible_gpus() if gpus is None else gpus
    if gpus == 0:
        return Placement(servers_on_gpu=False)
    nccl = strategy.get("type") == "broadcast" and strategy.get("backend") == "nccl"
    if train_device == "cuda" and nccl and gpus >= 2:
        return Placement(servers_on_gpu=True, server_env={"CUDA_VISIBLE_DEVICES": "1"},
                         server_args=GPU_SERVER_ARGS,
                         describe="trainer on GPU 0, servers on GPU 1 (NCCL)")
    where = "trainer and servers on GPU 0" if train_device == "cuda" else \
        "trainer on CPU, servers on GPU 0"
    return Placement(servers_on_gpu=True, server_args=GPU_SERVER_ARGS, describe=where)
