"""The interface design's config keys for the sharded extractors (``fsdp``, ``deepspeed``).

Who calls: ``GatheringExtractor.__init__`` on every training rank. The design's example builds
``FSDPWeightExtractor(cfg)`` from the whole trainer config (a SkyRL ``DictConfig``) and sets its
flags from three keys: modules are grouped when ``generator.weight_sync_backend`` is ``nccl``
and ``trainer.placement.colocate_all`` is true, and batched by threshold when, in addition,
``generator.weight_transfer_threshold_cuda_ipc_GB`` is present (its value is then the bucket
size). A config that has a ``generator`` or ``trainer`` section is read that way; the
extractor's own fields (``bucket_size_mb``, ``max_live_chunks``, ...) may stand beside those
sections and are read as from any config. Anything else (the extractor's dataclass, a mapping of
its fields, None) is read as before, the flags then following ``group_by_module`` (default
True) and batching on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DesignFlags:
    """The design's two flags, as its example derives them from a trainer config."""

    group_by_module: bool
    batch_by_threshold: bool


def split_config(cfg: Any, config_cls: type) -> tuple[Any, DesignFlags | None]:
    """``(the extractor's own config, the design's flags or None)`` from what the extractor was
    given (see the module docstring). Only the keys named here are read (a trainer config's
    other entries are neither resolved nor checked).

    Raises:
        ValueError: a backend other than ``nccl`` / ``gloo`` (naming the key), or a field the
            extractor does not have in a config without the trainer's sections.
    """
    from weightsync.config import make_config, to_plain

    if cfg is None:
        return config_cls(), None
    if dataclasses.is_dataclass(cfg) or not (
            isinstance(cfg, Mapping) or type(cfg).__module__.startswith("omegaconf")):
        return cfg, None
    what = f"extractor {getattr(config_cls, 'type', config_cls.__name__)!r}"
    if not any(_is_section(_get(cfg, k)) for k in ("generator", "trainer")):
        return make_config(config_cls, to_plain(cfg), what=what), None
    generator = _get(cfg, "generator")
    backend = _get(generator, "weight_sync_backend", "nccl")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"{what}: generator.weight_sync_backend must be 'nccl' or 'gloo', got "
                         f"{backend!r}")
    colocated = bool(_get(_get(_get(cfg, "trainer"), "placement"), "colocate_all", False))
    key = "weight_transfer_threshold_cuda_ipc_GB"
    has_threshold = _is_section(generator) and key in generator
    flags = DesignFlags(group_by_module=backend == "nccl" and colocated,
                        batch_by_threshold=backend == "nccl" and colocated and has_threshold)
    own = {f.name: _plain(_get(cfg, f.name)) for f in dataclasses.fields(config_cls)
           if f.name in cfg}
    threshold = _get(generator, key)
    if threshold is not None and "bucket_size_mb" not in own:
        own["bucket_size_mb"] = float(threshold) * 1024
    return make_config(config_cls, own, what=what), flags


def _is_section(node: Any) -> bool:
    return isinstance(node, Mapping) or type(node).__module__.startswith("omegaconf")


def _plain(value: Any) -> Any:
    """An OmegaConf list or mapping as plain Python (what the typed config checks)."""
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    return value


def _get(node: Any, key: str, default: Any = None) -> Any:
    """``node[key]`` of a mapping or an OmegaConf node; ``default`` when absent or None."""
    if not _is_section(node):
        return default
    value = node.get(key, default)
    return default if value is None else value
