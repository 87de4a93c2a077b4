"""Ready-made actors for tests and simple use: a torch module engine and a torch module trainer.

Both are plain classes (so ``import weightsync.ray`` does not import Ray); make them actors with
``ray.remote(TorchModuleEngineActor).options(num_cpus=0).remote(...)`` or ``spawn_*`` below.
The module comes from a factory string ``"pkg.mod:fn"`` called with ``factory_kwargs`` in the
actor's process, e.g. ``"weightsync.bench.shapes:build_module"`` with
``{"shape": "tiny", "seed": 0}``.
"""

from __future__ import annotations

import importlib
from typing import Any

from weightsync.ray.engine import WeightSyncEngineMixin
from weightsync.ray.trainer import WeightSyncTrainerMixin


def load_factory(spec: str) -> Any:
    """``"pkg.mod:fn"`` (or ``"pkg.mod:Class.method"``, e.g.
    ``"transformers:AutoModelForSequenceClassification.from_pretrained"``) -> the callable; a bad
    spec names what is wrong."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"module factory must look like 'pkg.mod:fn', got {spec!r}")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if not callable(obj):
        raise ValueError(f"module factory {spec!r}: {module} has no callable {attr!r}")
    return obj


class _TorchModuleHolder:
    def __init__(
        self, module_factory: str, factory_kwargs: dict | None = None, *, name: str = ""
    ) -> None:
        import torch

        self.module: torch.nn.Module = load_factory(module_factory)(**(factory_kwargs or {}))
        self._weightsync_engine_name = name

    async def state_digest(self) -> dict[str, dict[str, Any]]:
        """``{name: {"digest", "dtype", "shape"}}`` of the module's state dict (bit-exact check)."""
        from weightsync.digest import module_digest

        return module_digest(self.module)

    async def ping(self) -> str:
        return "pong"

    async def node_ip(self) -> str:
        """The address Ray reports for this actor's node."""
        import ray

        return ray.util.get_node_ip_address()

    async def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


class TorchModuleEngineActor(_TorchModuleHolder, WeightSyncEngineMixin):
    """An inference engine holding a torch module; loads with the ``torch_module`` loader."""

    def _weightsync_loader(self) -> Any:
        from weightsync.config import build_loader

        return build_loader({"type": "torch_module"}, module=self.module)


class TorchModuleTrainerActor(_TorchModuleHolder, WeightSyncTrainerMixin):
    """A trainer holding a torch module; ``train_step`` stands in for an optimiser step."""

    def _weightsync_model(self) -> Any:
        return self.module

    async def train_step(self, seed: int = 0, scale: float = 1e-2) -> int:
        """Change every floating-point parameter (deterministic in ``seed``); returns how many
        tensors changed."""
        import torch

        gen = torch.Generator().manual_seed(int(seed))
        n = 0
        with torch.no_grad():
            for p in self.module.parameters():
                if p.is_floating_point():
                    noise = torch.rand(p.shape, generator=gen, dtype=torch.float32) - 0.5
                    p.add_(noise.to(device=p.device, dtype=p.dtype), alpha=scale)
                    n += 1
        return n


def spawn_engine_actors(
    n: int,
    module_factory: str,
    factory_kwargs: dict | None = None,
    *,
    num_cpus: float = 0,
    names: list[str] | None = None,
    **options: Any,
) -> list[Any]:
    """Start ``n`` ``TorchModuleEngineActor``s (needs ``ray.init`` first)."""
    import ray

    cls = ray.remote(TorchModuleEngineActor)
    names = names or [f"engine{i}" for i in range(n)]
    return [
        cls.options(num_cpus=num_cpus, **options).remote(
            module_factory, factory_kwargs, name=names[i]
        )
        for i in range(n)
    ]


def spawn_trainer_actor(
    module_factory: str,
    factory_kwargs: dict | None = None,
    *,
    num_cpus: float = 0,
    name: str = "trainer",
    **options: Any,
) -> Any:
    """Start one ``TorchModuleTrainerActor`` (needs ``ray.init`` first)."""
    import ray

    cls = ray.remote(TorchModuleTrainerActor)
    return cls.options(num_cpus=num_cpus, **options).remote(
        module_factory, factory_kwargs, name=name
    )
