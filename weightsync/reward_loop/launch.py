"""Reward-model servers launched on a Ray resource pool, placed the way verl places them.

``RewardModelManager(config, resource_pool)`` (verl's call) hands the pool here.
``launch_servers(section, pool, api_key=)`` takes the pool's bundles in order (verl's
``RayResourcePool`` / ``SubRayResourcePool``, anything with ``get_placement_groups()``, a
``PlacementGroup`` or a list of them), cuts them into replicas of
``reward_model.rollout.tensor_model_parallel_size`` bundles, and for each replica:

1. runs a probe task in each of its bundles (``PlacementGroupSchedulingStrategy``) that reports
   the bundle's node and, when the bundle holds a GPU, the GPU's id;
2. starts a ``RewardServerActor`` on the node of the replica's first bundle
   (``NodeAffinitySchedulingStrategy(node_id, soft=False)``, no resources of its own: the pool
   holds them) which runs ``weightsync serve-reward`` (``rollout.server: policy``:
   ``serve-policy``, a judge) with ``CUDA_VISIBLE_DEVICES`` set to the replica's GPUs.

That is verl's rule: its rollout replicas put one worker per bundle and the HTTP server on the
node of the replica's first worker. The servers start together; ``LaunchedServers`` waits for
every one's health and gives their URLs; ``shutdown()`` stops each server (its process group)
and kills its actor. A replica whose bundles span nodes is an error naming
``tensor_model_parallel_size`` (a server runs on one node).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

#: the resources a probe task asks of its bundle (a sliver, so it fits beside other users)
PROBE_SHARE = 0.01


@dataclass(frozen=True)
class BundleSlot:
    """Where one bundle of the pool is: its node and the GPU ids it holds."""

    node_id: str
    node_ip: str
    gpu_ids: tuple[str, ...]


def pool_bundles(pool: Any) -> list[tuple[Any, int]]:
    """The pool's bundles in order, as ``(placement_group, bundle_index)``.

    Args:
        pool: verl's ``RayResourcePool`` or ``SubRayResourcePool`` (``get_placement_groups()``,
            ``world_size``, ``start_bundle_index``), a ``PlacementGroup`` or a list of them.

    Returns:
        One entry per bundle the pool lends.

    Raises:
        TypeError: ``pool`` is none of those.
        ValueError: the pool has no bundle.
    """
    from ray.util.placement_group import PlacementGroup

    start, size = 0, None
    if isinstance(pool, PlacementGroup):
        pgs = [pool]
    elif isinstance(pool, (list, tuple)) and all(isinstance(p, PlacementGroup) for p in pool):
        pgs = list(pool)
    elif hasattr(pool, "get_placement_groups"):
        pgs = list(pool.get_placement_groups())
        start = int(getattr(pool, "start_bundle_index", 0) or 0)
        size = getattr(pool, "world_size", None)
    else:
        raise TypeError(f"resource_pool: a verl RayResourcePool, a Ray PlacementGroup or a list "
                        f"of them, got {type(pool).__name__}")
    flat = [(pg, i) for pg in pgs for i in range(pg.bundle_count)]
    flat = flat[start:] if size is None else flat[start:start + int(size)]
    if not flat:
        raise ValueError("resource_pool: the pool lends no bundle")
    return flat


def _where() -> tuple[str, str, list[str]]:
    import ray

    ctx = ray.get_runtime_context()
    gpus = ctx.get_accelerator_ids().get("GPU", [])
    return ctx.get_node_id(), ray.util.get_node_ip_address(), [str(g) for g in gpus]


def probe_bundles(bundles: list[tuple[Any, int]], timeout_s: float = 300.0) -> list[BundleSlot]:
    """Run a probe in each bundle; -> where each is (see ``BundleSlot``), in order."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.get([pg.ready() for pg in {pg.id: pg for pg, _ in bundles}.values()], timeout=timeout_s)
    task = ray.remote(_where)
    refs = []
    for pg, index in bundles:
        spec = pg.bundle_specs[index]
        refs.append(task.options(
            num_cpus=PROBE_SHARE if spec.get("CPU", 0) > 0 else 0,
            num_gpus=PROBE_SHARE if spec.get("GPU", 0) > 0 else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=index),
        ).remote())
    return [BundleSlot(n, ip, tuple(g)) for n, ip, g in ray.get(refs, timeout=timeout_s)]


def server_args(section: Any, tp: int, on_gpu: bool, api_key: str) -> list[str]:
    """The command line the reward-model section asks for (``reward_model.rollout.*``)."""
    r = section.rollout
    args = ["--api-key", api_key]
    if section.model.served_model_name:
        args += ["--served-model-name", str(section.model.served_model_name)]
    for flag, value in (("--dtype", r.dtype), ("--max-model-len", r.max_model_len),
                        ("--max-num-seqs", r.max_num_seqs)):
        if value is not None:
            args += [flag, str(value)]
    if tp > 1:
        args += ["--tensor-parallel-size", str(tp)]
    if r.enforce_eager:
        args.append("--enforce-eager")
    if on_gpu:
        if r.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", str(r.gpu_memory_utilization)]
        if r.free_cache_engine:
            args.append("--enable-sleep-mode")
    return args + [str(a) for a in r.server_args]


class LaunchedServers:
    """The servers ``launch_servers`` started: ``urls``, ``slots`` (each replica's bundles),
    ``infos`` (each server's ``RewardServerActor.start`` answer), ``actors``."""

    def __init__(self, actors: list[Any], slots: list[list[BundleSlot]]) -> None:
        self.actors, self.slots = actors, slots
        self.infos: list[dict[str, Any]] = []

    @property
    def urls(self) -> list[str]:
        return [info["url"] for info in self.infos]

    def shutdown(self) -> None:
        """Stop every server (together), then kill the actors. Idempotent."""
        import ray

        actors, self.actors = self.actors, []
        refs = [a.stop.remote() for a in actors]
        for ref in refs:
            try:
                ray.get(ref, timeout=60)
            except Exception:  # noqa: BLE001 - a dead actor's guard has stopped its server
                pass
        for a in actors:
            ray.kill(a, no_restart=True)


def launch_servers(section: Any, pool: Any, *, api_key: str,
                   timeout_s: float | None = None) -> LaunchedServers:
    """Start one server per replica on ``pool`` (see the module docstring) and wait for all.

    Args:
        section: the typed ``reward_model`` section (``RewardModelSection``).
        pool: the resource pool (``pool_bundles`` lists the forms).
        api_key: the servers' control-plane token.
        timeout_s: start-up limit per server; default ``rollout.start_timeout_s``.

    Returns:
        The running servers.

    Raises:
        ValueError: the configuration does not fit the pool (a named key).
        RuntimeError: a server failed to start (its log tail); all are stopped then.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from weightsync.reward_loop.server_actor import RewardServerActor

    r = section.rollout
    if not section.model.path:
        raise ValueError("reward_model.model.path: the checkpoint the launched servers load")
    tp = int(r.tensor_model_parallel_size)
    bundles = pool_bundles(pool)
    if len(bundles) % tp:
        raise ValueError(f"reward_model.rollout.tensor_model_parallel_size: {tp} does not "
                         f"divide the pool's {len(bundles)} bundles")
    where = probe_bundles(bundles)
    replicas = [where[i:i + tp] for i in range(0, len(where), tp)]
    for k, rep in enumerate(replicas):
        if len({s.node_id for s in rep}) > 1:
            raise ValueError(f"reward_model.rollout.tensor_model_parallel_size: replica {k}'s "
                             f"{tp} bundles span nodes; a server runs on one node")
    on_gpu = any(s.gpu_ids for s in where)
    if r.free_cache_engine and not on_gpu:
        raise ValueError("reward_model.rollout.free_cache_engine: vLLM's sleep mode needs a GPU "
                         "and the pool's bundles hold none")
    actor_cls = ray.remote(RewardServerActor)
    tag = uuid.uuid4().hex[:8]
    actors = []
    for k, rep in enumerate(replicas):
        env = {"CUDA_VISIBLE_DEVICES": ",".join(g for s in rep for g in s.gpu_ids)} \
            if on_gpu else {}
        actors.append(actor_cls.options(
            name=f"reward_server_{tag}_{k}", num_cpus=0, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=rep[0].node_id,
                                                               soft=False),
        ).remote(r.server, str(section.model.path), server_args(section, tp, on_gpu, api_key),
                 env))
    launched = LaunchedServers(actors, replicas)
    limit = float(timeout_s if timeout_s is not None else r.start_timeout_s)
    refs = [a.start.remote(limit) for a in actors]
    infos, errors = [], []
    for k, ref in enumerate(refs):
        try:
            infos.append(ray.get(ref, timeout=limit + 120))
        except Exception as e:  # noqa: BLE001 - reported together below
            errors.append(f"replica {k}: {type(e).__name__}: {e}")
    if errors:
        launched.shutdown()
        raise RuntimeError("reward-model servers failed to start on the resource pool: "
                           + "; ".join(errors))
    launched.infos = infos
    return launched
