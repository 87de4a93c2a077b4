"""Typed configs and the ``build_*`` helpers.

A config is given as a mapping, an OmegaConf node, a dataclass instance or a YAML path, e.g.
``{"type": "broadcast", "backend": "gloo", "bucket_size_mb": 512}``. The ``type`` picks the
class from the registry; the class's ``config_cls`` (a dataclass) takes the remaining fields, and
an unknown field is an error that names it and lists the valid ones.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from weightsync.registry import EXTRACTORS, LOADERS, STRATEGIES, Registry

# --------------------------------------------------------------------------------------------
# Config dataclasses
# --------------------------------------------------------------------------------------------


#: the one default of ``bucket_size_mb``: the most bytes a chunk (and so a transfer buffer) holds.
#: Its one home is the strategy's config; an extractor built with a strategy takes the
#: strategy's (``WeightSyncConfig``, the front door, the Ray controller), one built alone this.
DEFAULT_BUCKET_MB = 1024.0


@dataclass(kw_only=True)
class StrategyConfig:
    """Fields every strategy understands.

    Timeouts (seconds; a stuck or dead peer turns into an error naming it and the phase, never a
    hang; ``docs/reliability.md``):

    * ``timeout_s``: every control call (start, finish, close, status) and the fixed part of
      every data-plane wait (a chunk's collectives, its engines' answer);
    * ``timeout_s_per_gb``: data-plane waits grow by this much per GB of the chunk (a 1 GB chunk
      waits ``timeout_s + timeout_s_per_gb`` seconds), so a big bucket on a slow link is not
      mistaken for a dead peer and a small one does not wait minutes for one;
    * ``join_timeout_s``: building the data plane (a process group's rendezvous, the engines'
      receivers) and starting an update (a server first drains its requests in flight);
    * ``idle_timeout_s``: sent with every update; an engine that hears nothing from the sender
      for this long between calls abandons the update (the sender died), so it never waits
      forever for a chunk.

    Per update: ``checksum`` sends a 64-bit checksum of every tensor with its chunk, and every
    engine verifies the bytes it received (``weightsync.integrity``); ``staged`` asks engines to
    receive the whole update into staging buffers and copy it into the weights only at finish
    (an aborted update leaves version v exactly; costs one extra copy of the update's bytes on
    the engine; ``weightsync.update_sink``).
    """

    type: str = "broadcast"
    bucket_size_mb: float = DEFAULT_BUCKET_MB
    timeout_s: float = 30.0
    timeout_s_per_gb: float = 20.0
    join_timeout_s: float = 120.0
    idle_timeout_s: float = 60.0
    device: str = "auto"  # "cpu", "cuda" or "auto" (follows the tensors)
    # chunks whose transfer may be under way at once: 2 lets chunk i+1's request reach the
    # engines while chunk i lands (hides the control-plane round trip); 1 = strictly one by one
    max_inflight_chunks: int = 2
    checksum: bool = False
    staged: bool = False

    def __post_init__(self) -> None:
        for name in ("bucket_size_mb", "timeout_s", "join_timeout_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"strategy {self.type!r}: {name} must be > 0, got {getattr(self, name)!r}")
        if not self.timeout_s_per_gb >= 0:
            raise ValueError(f"strategy {self.type!r}: timeout_s_per_gb must be >= 0, got "
                             f"{self.timeout_s_per_gb!r}")
        if self.max_inflight_chunks < 1:
            raise ValueError(
                f"strategy {self.type!r}: max_inflight_chunks must be >= 1, got "
                f"{self.max_inflight_chunks!r}"
            )

    def chunk_timeout_s(self, nbytes: int) -> float:
        """How long one chunk of ``nbytes`` may take end to end (its collectives, the engines
        receiving and loading it): ``timeout_s + timeout_s_per_gb`` per GB."""
        return scaled_timeout(self.timeout_s, self.timeout_s_per_gb, nbytes)


def scaled_timeout(base_s: float, per_gb_s: float, nbytes: int) -> float:
    """``base_s`` plus ``per_gb_s`` for every 1e9 bytes: the one rule for data-plane waits
    (senders, receivers and their collectives all use it, so both sides give up alike)."""
    return float(base_s) + float(per_gb_s) * max(int(nbytes), 0) / 1e9


@dataclass(kw_only=True)
class ExtractorConfig:
    type: str = "hf"
    bucket_size_mb: float = DEFAULT_BUCKET_MB  # with a strategy: the strategy's (see above)
    group_by_module: bool = True
    is_sender: bool = True  # False on training ranks that only take part in the collectives


@dataclass(kw_only=True)
class HeadExtractorConfig(ExtractorConfig):
    type: str = "hf_head"
    head_name_patterns: list[str] = field(
        default_factory=lambda: ["score.", "classifier.", "v_head."]
    )


@dataclass(kw_only=True)
class LoaderConfig:
    type: str = "torch_module"


@dataclass(kw_only=True)
class WeightSyncConfig:
    """A whole preset: what the shipped ``weightsync/configs/*.yaml`` hold."""

    strategy: dict[str, Any] = field(default_factory=lambda: {"type": "broadcast"})
    extractor: dict[str, Any] = field(default_factory=lambda: {"type": "hf"})
    loader: dict[str, Any] = field(default_factory=lambda: {"type": "torch_module"})
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.extractor = with_strategy_bucket(self.extractor, self.strategy)


def with_strategy_bucket(extractor: Mapping[str, Any], strategy: Mapping[str, Any]) -> dict:
    """The extractor section with the strategy's ``bucket_size_mb`` (its one home); an
    extractor section that sets another value is a ``ValueError`` saying where to set it."""
    out = dict(extractor)
    bucket = strategy.get("bucket_size_mb")
    mine = out.get("bucket_size_mb")
    if bucket is None:
        return out
    if mine is not None and float(mine) != float(bucket):
        raise ValueError(
            f"bucket_size_mb is {mine} in the extractor section but {bucket} in the strategy "
            f"section; set it once, in the strategy section (the extractor takes it from there)")
    out["bucket_size_mb"] = float(bucket)
    return out


# --------------------------------------------------------------------------------------------
# Conversion helpers
# --------------------------------------------------------------------------------------------


def to_plain(cfg: Any) -> dict[str, Any]:
    """Mapping / OmegaConf node / dataclass / YAML path -> plain dict."""
    if isinstance(cfg, (str, os.PathLike)):
        return to_plain(_read_yaml(cfg))
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.asdict(cfg)
    if type(cfg).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    if isinstance(cfg, Mapping):
        return dict(cfg)
    raise TypeError(
        f"config must be a mapping, OmegaConf node, dataclass or YAML path, got {type(cfg).__name__}"
    )


def _read_yaml(path: str | os.PathLike) -> Any:
    try:
        from omegaconf import OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a core dependency
        import yaml  # type: ignore[import-untyped]

        with open(path) as f:
            return yaml.safe_load(f)
    return OmegaConf.load(path)


def make_config(config_cls: type, data: Mapping[str, Any], *, what: str) -> Any:
    """Build ``config_cls`` from ``data``; unknown fields raise with the list of valid ones."""
    valid = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(data) - valid)
    if unknown:
        raise ValueError(
            f"{what}: unknown field(s) {unknown}; valid fields: {', '.join(sorted(valid))}"
        )
    hints = typing.get_type_hints(config_cls)
    for key, value in data.items():
        hint = hints.get(key)
        if hint is not None and not _matches(value, hint):
            raise ValueError(
                f"{what}: field {key!r} must be {_type_name(hint)}, got {value!r} "
                f"({type(value).__name__})"
            )
    try:
        return config_cls(**data)
    except TypeError as e:
        raise ValueError(f"{what}: {e}") from None


def _matches(value: Any, hint: Any) -> bool:
    """Shallow type check of a config value against its dataclass annotation."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is not None:
        hint = origin
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (list, tuple):
        return isinstance(value, (list, tuple))
    if hint is dict:
        return isinstance(value, Mapping)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _type_name(hint: Any) -> str:
    return str(hint).replace("typing.", "") if not isinstance(hint, type) else hint.__name__


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg)


def _build(registry: Registry, cfg: Any, section: str, default_type: str, **kwargs: Any) -> Any:
    data = to_plain(cfg) if cfg is not None else {}
    if section in data and isinstance(data[section], Mapping) and "type" not in data:
        data = dict(data[section])  # a whole preset was given
    kind = data.get("type", default_type)
    cls = registry.get(kind)
    config_cls = getattr(cls, "config_cls", None)
    if config_cls is None or not dataclasses.is_dataclass(config_cls):
        return cls(data, **kwargs)
    data = {"type": kind, **data}
    return cls(make_config(config_cls, data, what=f"{registry.kind} {kind!r}"), **kwargs)


def build_strategy(cfg: Any = None) -> Any:
    """-> a ``WeightTransferStrategy`` (default ``broadcast``)."""
    return _build(STRATEGIES, cfg, "strategy", "broadcast")


def build_extractor(cfg: Any = None) -> Any:
    """-> a ``WeightExtractor`` (default ``hf``)."""
    return _build(EXTRACTORS, cfg, "extractor", "hf")


def build_loader(cfg: Any = None, **kwargs: Any) -> Any:
    """-> a ``WeightLoader``; ``kwargs`` carry runtime objects (e.g. ``module=``)."""
    return _build(LOADERS, cfg, "loader", "torch_module", **kwargs)


def load_config(path: str | os.PathLike) -> WeightSyncConfig:
    """Read a preset into a ``WeightSyncConfig``: a YAML path, or the bare name of a preset
    shipped inside the package (``"broadcast_nccl"``, see ``preset_names()``; found through
    ``importlib.resources``, so it works from an installed wheel and from any directory). An
    existing file wins over a preset of the same name."""
    p = os.fspath(path)
    if os.path.exists(p):
        data, where = to_plain(p), p
    else:
        data, where = read_preset(p), f"preset {p!r}"
    return make_config(WeightSyncConfig, data, what=f"config {where}")


# --------------------------------------------------------------------------------------------
# Presets shipped as package data (weightsync/configs/*.yaml)
# --------------------------------------------------------------------------------------------


def _preset_dir() -> Any:
    from importlib.resources import files

    return files("weightsync") / "configs"


def preset_names() -> list[str]:
    """Names of the YAML presets shipped in the package (``weightsync/configs/*.yaml``)."""
    return sorted(e.name[: -len(".yaml")] for e in _preset_dir().iterdir()
                  if e.name.endswith(".yaml"))


def read_preset(name: str) -> dict[str, Any]:
    """The shipped preset ``name`` (``"demo"`` or ``"demo.yaml"``) as a plain dict; an unknown
    name raises ``FileNotFoundError`` listing the presets there are."""
    base = os.path.basename(name)
    stem = base[: -len(".yaml")] if base.endswith(".yaml") else base
    entry = _preset_dir() / f"{stem}.yaml"
    if base != name or not entry.is_file():
        raise FileNotFoundError(
            f"no config file at {name!r} and no preset of that name in the package; "
            f"presets: {', '.join(preset_names())}"
        )
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.create(entry.read_text()), resolve=True)  # type: ignore[return-value]


def preset_path(name: str) -> str:
    """File path of the shipped preset ``name``, for tools that take a path (``--config``)."""
    read_preset(name)  # the same check and error
    stem = name[: -len(".yaml")] if name.endswith(".yaml") else name
    return str(_preset_dir() / f"{stem}.yaml")


# --------------------------------------------------------------------------------------------
# Resolving a strategy / extractor given any way (the front door takes them all)
# --------------------------------------------------------------------------------------------


def resolve_strategy(strategy: Any) -> dict[str, Any]:
    """A strategy given any way: a registered name, a preset name, a YAML path (a preset or a
    bare strategy mapping), a mapping, a ``StrategyConfig``, a ``WeightSyncConfig`` or a strategy
    instance -> its config mapping (``type`` set; no ``backend`` when the caller gave none).
    Callers: the front door (``weightsync.connect``)."""
    if strategy is None:
        return {"type": "broadcast"}
    if callable(getattr(strategy, "create_sender", None)):  # a WeightTransferStrategy
        return strategy.config_dict()
    if isinstance(strategy, StrategyConfig):
        return dataclasses.asdict(strategy)
    if isinstance(strategy, WeightSyncConfig):
        return dict(strategy.strategy)
    if isinstance(strategy, (str, os.PathLike)):
        s = os.fspath(strategy)
        if s in STRATEGIES:
            return {"type": s}
        if os.path.exists(s) or s.endswith((".yaml", ".yml")):
            return _strategy_section(to_plain(s), where=s)
        if s in preset_names() or s.removesuffix(".yaml") in preset_names():
            return dict(load_config(s).strategy)
        raise ValueError(
            f"strategy {s!r}: not a registered strategy ({', '.join(STRATEGIES.names())}), a "
            f"preset ({', '.join(preset_names())}) or a YAML file"
        )
    if isinstance(strategy, Mapping) or type(strategy).__module__.startswith("omegaconf"):
        return _strategy_section(to_plain(strategy), where="strategy")
    raise TypeError(
        f"strategy: expected a name, a preset, a YAML path, a mapping or a StrategyConfig, got "
        f"{type(strategy).__name__}"
    )


def _strategy_section(data: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    if "type" not in data and isinstance(data.get("strategy"), Mapping):
        data = data["strategy"]  # a whole preset: its strategy section
    elif "type" not in data and isinstance(data.get("generator"), Mapping):
        return skyrl_strategy(data)
    out = dict(data)
    out.setdefault("type", "broadcast")
    return out


def skyrl_strategy(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The strategy a SkyRL-style trainer config asks for (the interface design's controller
    picks it the same way): ``generator.weight_sync_backend`` (``nccl`` / ``gloo``) and
    ``trainer.placement.colocate_all``; CUDA IPC when ``generator.use_cuda_ipc`` (default: an
    ``nccl`` backend with every model colocated), its buckets of
    ``generator.weight_transfer_threshold_cuda_ipc_GB``; otherwise a broadcast over the backend.
    Unknown backends are a ``ValueError`` naming the key."""
    generator = dict(cfg.get("generator") or {})
    placement = dict((cfg.get("trainer") or {}).get("placement") or {})
    backend = str(generator.get("weight_sync_backend", "nccl"))
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"generator.weight_sync_backend must be 'nccl' or 'gloo', got "
                         f"{backend!r}")
    colocated = bool(placement.get("colocate_all", False))
    use_ipc = generator.get("use_cuda_ipc")
    if use_ipc is None:
        use_ipc = backend == "nccl" and colocated
    if use_ipc:
        out: dict[str, Any] = {"type": "cuda_ipc"}
        gb = generator.get("weight_transfer_threshold_cuda_ipc_GB")
        if gb is not None:
            out["bucket_size_mb"] = float(gb) * 1024
        return out
    return {"type": "broadcast", "backend": backend}


def resolve_extractor(extractor: Any) -> dict[str, Any] | None:
    """An extractor given any way (a registered name, a preset, a YAML path, a mapping) -> its
    config mapping; None stays None (the caller picks one from the model)."""
    if extractor is None:
        return None
    if isinstance(extractor, str) and extractor in EXTRACTORS:
        return {"type": extractor}
    if isinstance(extractor, str) and not os.path.exists(extractor) and (
        extractor in preset_names() or extractor.removesuffix(".yaml") in preset_names()
    ):
        return dict(load_config(extractor).extractor)
    data = to_plain(extractor)
    if "type" not in data and isinstance(data.get("extractor"), Mapping):
        data = data["extractor"]
    return dict(data)


def broadcast_backend(device: Any) -> str:
    """The collective backend for tensors on ``device`` (a ``torch.device``, its name, or None
    for CPU): NCCL for CUDA, gloo for anything else. The one rule behind every default backend
    (the front door, the reward client, the bench)."""
    return "nccl" if str(getattr(device, "type", device) or "cpu").startswith("cuda") else "gloo"


def strategy_needs_backend(cfg: Mapping[str, Any]) -> bool:
    """A strategy whose config has a ``backend`` field the caller did not set."""
    if "backend" in cfg:
        return False
    config_cls = getattr(STRATEGIES.get(str(cfg.get("type", "broadcast"))), "config_cls", None)
    return dataclasses.is_dataclass(config_cls) and any(
        f.name == "backend" for f in dataclasses.fields(config_cls))
