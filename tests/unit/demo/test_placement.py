"""Where the demo's servers run (``weightsync.demo.placement``) for each trainer device, strategy
and number of GPUs."""

from __future__ import annotations

from weightsync.demo.placement import GPU_SERVER_ARGS, default_gpu_strategy, plan_placement

GLOO = {"type": "broadcast", "backend": "gloo"}
NCCL = {"type": "broadcast", "backend": "nccl"}


def test_on_cpu_machines_the_servers_stay_on_cpu():
    place = plan_placement("cpu", GLOO, gpus=0)
    assert not place.servers_on_gpu and place.server_args == () and not place.start_one_by_one


def test_one_gpu_the_servers_share_the_trainers_gpu_and_start_one_by_one():
    assert default_gpu_strategy(1) == {"type": "cuda_ipc"}
    place = plan_placement("cuda", default_gpu_strategy(1), gpus=1)
    assert place.servers_on_gpu and place.server_env == {} and place.start_one_by_one
    assert place.server_args == GPU_SERVER_ARGS and "--dtype" in GPU_SERVER_ARGS
    assert plan_placement("cpu", GLOO, gpus=1).describe == "trainer on CPU, servers on GPU 0"


def test_two_gpus_nccl_puts_the_servers_on_the_second():
    assert default_gpu_strategy(2) == NCCL
    place = plan_placement("cuda", NCCL, gpus=2)
    assert place.server_env == {"CUDA_VISIBLE_DEVICES": "1"}
    # CUDA IPC needs the servers on the trainer's GPU
    assert plan_placement("cuda", {"type": "cuda_ipc"}, gpus=2).server_env == {}
