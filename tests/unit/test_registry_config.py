"""Registries (weightsync/registry.py) and config building (weightsync/config.py)."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator

import pytest

import weightsync as ws
from weightsync.config import WeightSyncConfig, make_config, preset_names, read_preset
from weightsync.interfaces import WeightTransferStrategy
from weightsync.registry import EXTRACTORS, LOADERS, STRATEGIES, Registry


@pytest.fixture
def fresh_name() -> Iterator[str]:
    """A unique registry name, removed from every registry afterwards (registries are global)."""
    name = f"test_{uuid.uuid4().hex[:8]}"
    yield name
    for reg in (STRATEGIES, EXTRACTORS, LOADERS):
        reg._entries.pop(name, None)


# -- registry ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build,kind,some",
    [
        (ws.build_strategy, "strategy", ["broadcast", "cuda_ipc", "packed_cuda_ipc"]),
        (ws.build_extractor, "extractor", ["deepspeed", "fsdp", "hf", "hf_head", "lora_merge"]),
        (ws.build_loader, "loader", ["torch_module", "vllm"]),
    ],
)
def test_unknown_type_lists_registered_names(build, kind, some):
    with pytest.raises(ValueError) as e:
        build({"type": "nope"})
    msg = str(e.value)
    assert f"unknown {kind} type 'nope'" in msg
    for name in some:
        assert name in msg


def test_builtins_are_lazy_strings_until_used():
    reg = Registry("thing", {"x": "weightsync.extractors.hf:HFWeightExtractor"})
    assert reg.names() == ["x"] and "x" in reg and "y" not in reg
    assert isinstance(reg._entries["x"], str)
    cls = reg.get("x")
    assert cls.__name__ == "HFWeightExtractor" and reg._entries["x"] is cls


def test_duplicate_registration_refused(fresh_name):
    @ws.register_extractor(fresh_name)
    class A(ws.WeightExtractor):
        def _extract_raw_weights(self, model, generator_dtype):
            yield from ()

    assert ws.register_extractor(fresh_name)(A) is A  # the same class again is fine

    class B(A):
        pass

    with pytest.raises(ValueError, match=f"extractor '{fresh_name}' is already registered"):
        ws.register_extractor(fresh_name)(B)
    with pytest.raises(ValueError, match="extractor 'hf' is already registered"):
        ws.register_extractor("hf")(B)  # a built-in cannot be shadowed either
    assert EXTRACTORS.get(fresh_name) is A


@dataclasses.dataclass(kw_only=True)
class CarrierConfig(ws.StrategyConfig):
    type: str = "carrier"
    birds: int = 1


class CarrierStrategy(WeightTransferStrategy):
    """Third-party strategy: only the factory plumbing is exercised here."""

    config_cls = CarrierConfig

    async def create_sync_info(self, cfg, inference_client):
        return ws.EmptyWeightSyncInfo()

    async def create_sender(self, cfg, inference_client, sync_info):
        raise NotImplementedError

    async def create_receiver(self, cfg, sync_info, rank_offset):
        raise NotImplementedError

    @classmethod
    def get_request_type(cls):
        return ws.WeightUpdateRequest


def test_third_party_strategy_through_build_strategy(fresh_name, tmp_path):
    ws.register_strategy(fresh_name)(CarrierStrategy)
    s = ws.build_strategy({"type": fresh_name, "birds": 3, "timeout_s": 5})
    assert isinstance(s, CarrierStrategy)
    assert s.cfg == CarrierConfig(type=fresh_name, birds=3, timeout_s=5)
    assert s.config_dict()["birds"] == 3
    with pytest.raises(ValueError) as e:
        ws.build_strategy({"type": fresh_name, "bird": 3})
    assert "unknown field(s) ['bird']" in str(e.value)
    assert "birds" in str(e.value) and "timeout_s" in str(e.value)
    path = tmp_path / "carrier.yaml"
    path.write_text(f"strategy:\n  type: {fresh_name}\n  birds: 9\nextractor:\n  type: hf\n")
    assert ws.build_strategy(str(path)).cfg.birds == 9
    assert ws.load_config(path).strategy == {"type": fresh_name, "birds": 9}


def test_class_without_dataclass_config_gets_the_plain_dict(fresh_name):
    @ws.register_loader(fresh_name)
    class DictLoader(ws.WeightLoader):
        def __init__(self, cfg, *, target):
            self.cfg, self.target = cfg, target

        async def load_weights(self, named_tensors):
            self.target.update(named_tensors)

    target: dict = {}
    loader = ws.build_loader({"type": fresh_name, "anything": 1}, target=target)
    assert isinstance(loader, DictLoader)
    assert loader.cfg == {"type": fresh_name, "anything": 1} and loader.target is target


# -- config: the forms a config may take --------------------------------------------------------


def _forms(tmp_path) -> dict[str, object]:
    from omegaconf import OmegaConf

    data = {"type": "hf_head", "bucket_size_mb": 8, "head_name_patterns": ["v_head."]}
    path = tmp_path / "ex.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(data)))
    return {
        "dict": data,
        "omegaconf": OmegaConf.create(data),
        "dataclass": ws.HeadExtractorConfig(bucket_size_mb=8, head_name_patterns=["v_head."]),
        "yaml_path": str(path),
        "pathlike": path,
        "whole_preset": {"strategy": {"type": "broadcast"}, "extractor": data},
        "whole_preset_omegaconf": OmegaConf.create({"extractor": data, "loader": {"type": "vllm"}}),
        "preset_dataclass": WeightSyncConfig(extractor=data),
    }


@pytest.mark.parametrize(
    "form",
    ["dict", "omegaconf", "dataclass", "yaml_path", "pathlike", "whole_preset",
     "whole_preset_omegaconf", "preset_dataclass"],
)
def test_build_extractor_from_every_form(form, tmp_path):
    ex = ws.build_extractor(_forms(tmp_path)[form])
    assert type(ex).__name__ == "HFHeadWeightExtractor"
    assert isinstance(ex.cfg, ws.HeadExtractorConfig)
    assert ex.cfg.bucket_size_mb == 8 and ex.cfg.head_name_patterns == ["v_head."]


def test_defaults_when_type_or_config_missing():
    assert type(ws.build_extractor()).__name__ == "HFWeightExtractor"
    assert type(ws.build_extractor({"bucket_size_mb": 2})).__name__ == "HFWeightExtractor"


def test_omegaconf_interpolation_is_resolved():
    from omegaconf import OmegaConf

    node = OmegaConf.create({"size": 16, "extractor": {"type": "hf", "bucket_size_mb": "${size}"}})
    assert ws.build_extractor(node).cfg.bucket_size_mb == 16


def test_unknown_field_lists_valid_ones():
    with pytest.raises(ValueError) as e:
        ws.build_extractor({"type": "hf", "bucket_mb": 1})
    msg = str(e.value)
    assert "extractor 'hf'" in msg and "['bucket_mb']" in msg
    for valid in ("bucket_size_mb", "group_by_module", "is_sender", "type"):
        assert valid in msg


def test_make_config_names_missing_required_field():
    @dataclasses.dataclass(kw_only=True)
    class Needs:
        port: int

    with pytest.raises(ValueError, match="thing: .*port"):
        make_config(Needs, {}, what="thing")


def test_config_of_wrong_kind_is_a_type_error():
    with pytest.raises(TypeError, match="mapping, OmegaConf node, dataclass or YAML path, got int"):
        ws.build_extractor(42)


# -- presets ---------------------------------------------------------------------------------------

_SECTIONS = {f.name for f in dataclasses.fields(WeightSyncConfig)}


def _sync_presets() -> list[str]:
    """Shipped presets shaped as a WeightSyncConfig (others, e.g. demo.yaml, have their own)."""
    out = []
    for name in preset_names():
        data = read_preset(name)
        if isinstance(data, dict) and set(data) <= _SECTIONS and {"strategy", "extractor"} & set(data):
            out.append(name)
    return out


def test_my_presets_are_found():
    assert {"extractor_hf", "extractor_hf_head"} <= set(_sync_presets())


@pytest.mark.parametrize("preset", _sync_presets())
def test_preset_loads_and_every_section_is_valid(preset):
    cfg = ws.load_config(preset)  # a bare name is looked up among the shipped presets
    assert isinstance(cfg, WeightSyncConfig)
    for section, reg in (("strategy", STRATEGIES), ("extractor", EXTRACTORS), ("loader", LOADERS)):
        data = getattr(cfg, section)
        cls = reg.get(data["type"])  # registered and importable
        config_cls = getattr(cls, "config_cls", None)
        if config_cls is not None and dataclasses.is_dataclass(config_cls):
            make_config(config_cls, data, what=f"{preset}.{section}")  # fields all known


def test_load_config_missing_preset_says_where_it_looked():
    with pytest.raises(FileNotFoundError, match="no config file at 'no_such_preset'.*presets: .*broadcast_nccl"):
        ws.load_config("no_such_preset")


def test_load_config_finds_presets_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert ws.load_config("broadcast_nccl").strategy["backend"] == "nccl"
    assert ws.load_config("broadcast_gloo.yaml").strategy["backend"] == "gloo"
    (tmp_path / "broadcast_nccl").write_text("strategy:\n  type: cuda_ipc\n")
    assert ws.load_config("broadcast_nccl").strategy["type"] == "cuda_ipc"  # a file wins


def test_load_config_unknown_section(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("strategy:\n  type: broadcast\nextractors:\n  type: hf\n")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['extractors'\].*extractor"):
        ws.load_config(path)


@pytest.mark.parametrize(
    ("cfg", "field"),
    [
        ({"type": "broadcast", "bucket_size_mb": "big"}, "bucket_size_mb"),
        ({"type": "broadcast", "packed": "yes"}, "packed"),
        ({"type": "broadcast", "master_port": "8000"}, "master_port"),
        ({"type": "broadcast", "timeout_s": True}, "timeout_s"),
    ],
)
def test_config_field_of_wrong_type_is_named(cfg: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"field '{field}' must be"):
        ws.build_strategy(cfg)


def test_config_accepts_int_for_float_and_none_for_optional() -> None:
    s = ws.build_strategy({"type": "broadcast", "bucket_size_mb": 64, "master_port": None})
    assert s.cfg.bucket_size_mb == 64 and s.cfg.master_port is None


@pytest.mark.parametrize(
    "field,value,msg",
    [
        ("max_inflight_chunks", 0, "max_inflight_chunks must be >= 1, got 0"),
        ("bucket_size_mb", 0, "bucket_size_mb must be > 0, got 0"),
        ("timeout_s", -1.0, "timeout_s must be > 0, got -1.0"),
    ],
)
def test_strategy_numbers_out_of_range_name_the_field(field, value, msg):
    from weightsync import build_strategy

    with pytest.raises(ValueError, match=msg):
        build_strategy({"type": "packed_cuda_ipc", field: value})


def test_pipelining_defaults():
    from weightsync import build_strategy

    assert build_strategy({"type": "cuda_ipc"}).cfg.max_inflight_chunks == 2
    assert build_strategy({"type": "packed_cuda_ipc"}).cfg.max_inflight_chunks == 2
    assert build_strategy({"type": "broadcast"}).cfg.max_inflight_chunks == 1


def test_a_skyrl_style_config_picks_the_strategy_as_the_design_controller_does():
    from omegaconf import OmegaConf

    from weightsync.config import resolve_strategy

    def cfg(backend, colocate, **gen):
        return OmegaConf.create({"generator": {"weight_sync_backend": backend, **gen},
                                 "trainer": {"placement": {"colocate_all": colocate}}})

    assert resolve_strategy(cfg("nccl", False)) == {"type": "broadcast", "backend": "nccl"}
    assert resolve_strategy(cfg("gloo", True)) == {"type": "broadcast", "backend": "gloo"}
    assert resolve_strategy(cfg("nccl", True)) == {"type": "cuda_ipc"}
    assert resolve_strategy(cfg("nccl", True, weight_transfer_threshold_cuda_ipc_GB=0.5)) == {
        "type": "cuda_ipc", "bucket_size_mb": 512.0}
    assert resolve_strategy(cfg("nccl", True, use_cuda_ipc=False))["type"] == "broadcast"
    with pytest.raises(ValueError, match="generator.weight_sync_backend must be"):
        resolve_strategy(cfg("mpi", False))


def test_bucket_size_has_one_home_the_strategy_section(tmp_path):
    from weightsync.config import DEFAULT_BUCKET_MB, WeightSyncConfig, load_config

    for preset in ("broadcast_gloo", "cuda_ipc", "extractor_hf", "extractor_hf_head"):
        cfg = load_config(preset)
        assert cfg.extractor["bucket_size_mb"] == float(cfg.strategy["bucket_size_mb"]), preset
    assert ws.build_extractor(load_config("extractor_hf_head")).cfg.bucket_size_mb == 64
    assert ws.build_extractor({"type": "hf"}).cfg.bucket_size_mb == DEFAULT_BUCKET_MB  # alone
    with pytest.raises(ValueError, match="set it once, in the strategy section"):
        WeightSyncConfig(strategy={"type": "broadcast", "bucket_size_mb": 64},
                         extractor={"type": "hf", "bucket_size_mb": 512})
