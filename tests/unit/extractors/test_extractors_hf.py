"""``hf`` / ``hf_head`` extractors on real torch modules and real (tiny, random) HF models."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import weightsync as ws
from weightsync.config import preset_path
from weightsync.extractors.hf import (
    HFHeadWeightExtractor,
    HFWeightExtractor,
    unique_named_tensors,
)
from weightsync.naming import NamingError


def _collect(extractor, model, dtype=None) -> list[ws.WeightChunk]:
    async def go():
        return [c async for c in extractor.extract_weights(model, dtype)]

    return asyncio.run(go())


def _flat(chunks) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for c in chunks:
        for n, t in zip(c.names, c.tensors, strict=True):
            assert n not in out, f"{n} sent twice"
            out[n] = t
    return out


def _qwen2(cls_name: str = "Qwen2ForCausalLM", *, tie: bool = False, num_labels: int = 1):
    import transformers

    cfg = transformers.Qwen2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie,
        num_labels=num_labels, pad_token_id=0,
    )
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(cfg).eval()


class WithBuffers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.bn = torch.nn.BatchNorm1d(3)  # running stats are persistent buffers (+ int64 counter)
        self.register_buffer("scratch", torch.zeros(5), persistent=False)


# -- hf: what is sent ---------------------------------------------------------------------------


def test_hf_sends_state_dict_bit_exact_without_copies():
    m = WithBuffers()
    chunks = _collect(HFWeightExtractor(), m)
    got = _flat(chunks)
    sd = m.state_dict()
    assert list(got) == list(sd)  # params and persistent buffers, state_dict order
    assert "scratch" not in got
    for n, t in sd.items():
        assert torch.equal(got[n], t)
        assert got[n].data_ptr() == t.data_ptr(), f"{n} was copied although no cast was asked"
        assert not got[n].requires_grad


def test_hf_casts_floating_only_and_accepts_dtype_strings():
    m = WithBuffers()
    got = _flat(_collect(HFWeightExtractor(), m, "bfloat16"))
    assert got["lin.weight"].dtype == torch.bfloat16
    assert torch.equal(got["lin.weight"], m.lin.weight.detach().to(torch.bfloat16))
    assert got["bn.num_batches_tracked"].dtype == torch.int64  # integer buffers keep their dtype
    assert m.lin.weight.dtype == torch.float32  # the model itself is untouched
    with pytest.raises(ValueError, match="unknown dtype 'bf17'"):
        _collect(HFWeightExtractor(), m, "bf17")


def test_hf_metadata_matches_extraction_and_needs_no_data():
    model = _qwen2()
    ex = HFWeightExtractor()
    metas = ex.metadata(model, torch.bfloat16)
    chunks = _collect(ex, model, torch.bfloat16)
    assert metas == [m for c in chunks for m in c.metas()]
    assert {m.dtype for m in metas} == {"bfloat16"}
    with torch.device("meta"):  # no storage at all: metadata reads shapes and dtypes only
        hollow = _qwen2()
    assert ex.metadata(hollow, torch.bfloat16) == metas


def test_hf_tied_embedding_sent_once_under_embedding_name():
    tied = _qwen2(tie=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    got = _flat(_collect(HFWeightExtractor(), tied))
    assert "lm_head.weight" not in got
    assert torch.equal(got["model.embed_tokens.weight"], tied.model.embed_tokens.weight)
    assert len(got) == len(tied.state_dict()) - 1

    untied = _qwen2(tie=False)
    got = _flat(_collect(HFWeightExtractor(), untied))
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(got)


class HeadFirst(torch.nn.Module):
    """Registers the output head before the embedding; ties them."""

    def __init__(self, with_getter: bool) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(8, 10, bias=False)
        self.embed = torch.nn.Embedding(10, 8)
        self.lm_head.weight = self.embed.weight
        self._with_getter = with_getter

    def get_input_embeddings(self):
        if not self._with_getter:
            raise NotImplementedError
        return self.embed


@pytest.mark.parametrize("with_getter", [True, False])
def test_tied_name_is_the_embedding_even_when_the_head_comes_first(with_getter):
    names = [n for n, _ in unique_named_tensors(HeadFirst(with_getter))]
    assert names == ["embed.weight"]


def test_other_ties_keep_the_first_registered_name():
    m = torch.nn.Module()
    m.b = torch.nn.Linear(3, 3)
    m.a = torch.nn.Linear(3, 3)
    m.a.weight = m.b.weight
    assert [n for n, _ in unique_named_tensors(m)] == ["b.weight", "b.bias", "a.bias"]


def test_tied_weight_round_trips_into_a_fresh_model_through_the_loader():
    from weightsync.loaders.torch_module import TorchModuleWeightLoader

    src, dst = _qwen2(tie=True), _qwen2(tie=True)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(1.0)
    loader = TorchModuleWeightLoader(module=dst)
    chunks = _collect(HFWeightExtractor(ws.ExtractorConfig(bucket_size_mb=0.01)), src)
    assert len(chunks) > 3
    for c in chunks:
        loader.validate(c.metas())
        asyncio.run(loader.load_weights(dict(zip(c.names, c.tensors, strict=True))))
    for (n, a), b in zip(src.state_dict().items(), dst.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    assert dst.lm_head.weight is dst.model.embed_tokens.weight


# -- names ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw,expected",
    [
        ("module.model.norm.weight", "model.norm.weight"),
        ("_orig_mod.model.norm.weight", "model.norm.weight"),
        ("module._orig_mod.lin.weight", "lin.weight"),
        ("model.layers.0._checkpoint_wrapped_module.mlp.up.weight", "model.layers.0.mlp.up.weight"),
        ("score.weight", "score.weight"),
    ],
)
def test_wrapper_prefixes_stripped(raw, expected):
    assert [m.name for m in HFWeightExtractor().metadata({raw: torch.zeros(2)})] == [expected]


def test_compiled_and_ddp_style_wrappers_do_not_reach_the_engine():
    m = WithBuffers()
    compiled = torch.compile(m)  # lazily compiled: never run here, only wrapped
    assert any(n.startswith("_orig_mod.") for n, _ in compiled.named_parameters())
    assert [n for n, _ in unique_named_tensors(compiled)] == list(m.state_dict())
    sd = {f"module.{k}": v for k, v in m.state_dict().items()}
    assert list(_flat(_collect(HFWeightExtractor(), sd))) == list(m.state_dict())


def test_two_tensors_colliding_on_one_engine_name_is_an_error():
    sd = {"module.w": torch.zeros(2), "w": torch.ones(2)}
    with pytest.raises(ValueError, match="'module.w' and 'w' both map to the engine name 'w'"):
        HFWeightExtractor().metadata(sd)


# -- PEFT models ------------------------------------------------------------------------------------


def _peft_seqcls(**lora_kwargs):
    from peft import LoraConfig, get_peft_model

    base = _qwen2("Qwen2ForSequenceClassification")
    cfg = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], modules_to_save=["score"],
                     **lora_kwargs)
    peft_model = get_peft_model(base, cfg)
    with torch.no_grad():  # "train" the head copy so it differs from the frozen original
        peft_model.base_model.model.score.modules_to_save["default"].weight.add_(1.0)
    return peft_model


def test_hf_refuses_unmerged_lora_tensors():
    model = _peft_seqcls()
    with pytest.raises(NamingError, match="unmerged adapter tensors .*lora_A.*'lora_merge'"):
        HFWeightExtractor().metadata(model)
    with pytest.raises(NamingError):
        _collect(HFWeightExtractor(), model)


def test_hf_head_on_a_peft_model_sends_the_trained_head_copy():
    model = _peft_seqcls()
    got = _flat(_collect(ws.build_extractor({"type": "hf_head"}), model))
    assert list(got) == ["score.weight"]
    trained = model.base_model.model.score.modules_to_save["default"].weight
    assert torch.equal(got["score.weight"], trained)
    assert not torch.equal(got["score.weight"], model.base_model.model.score.original_module.weight)


def test_hf_head_refuses_an_adapter_on_the_head_itself():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_qwen2("Qwen2ForSequenceClassification"),
                           LoraConfig(r=2, target_modules=["score"]))
    with pytest.raises(NamingError, match="score.lora_A"):
        ws.build_extractor({"type": "hf_head"}).metadata(model)


def test_merged_peft_model_goes_through_hf():
    model = _peft_seqcls()
    merged = model.merge_and_unload()
    names = [m.name for m in HFWeightExtractor().metadata(merged)]
    assert "score.weight" in names and not any("lora" in n or "base_layer" in n for n in names)


def test_bad_model_type_is_a_type_error():
    with pytest.raises(TypeError, match="needs a torch.nn.Module"):
        HFWeightExtractor().metadata([1, 2, 3])
    with pytest.raises(TypeError, match="not tensors: \\['b'\\]"):
        HFWeightExtractor().metadata({"a": torch.zeros(1), "b": 3})


# -- chunking ---------------------------------------------------------------------------------------


def test_chunks_respect_bucket_and_keep_modules_whole():
    model = _qwen2()
    threshold_mb = 0.02
    ex = HFWeightExtractor(ws.ExtractorConfig(bucket_size_mb=threshold_mb))
    chunks = _collect(ex, model)
    limit = int(threshold_mb * (1 << 20))
    names_in_order = [n for c in chunks for n in c.names]
    assert names_in_order == [n for n, _ in unique_named_tensors(model)]
    owner: dict[str, int] = {}
    for i, c in enumerate(chunks):
        modules = {n.rsplit(".", 1)[0] for n in c.names}
        if len(modules) > 1:
            assert c.total_size_bytes <= limit
        for mod in modules:
            assert owner.setdefault(mod, i) == i, f"module {mod} split across chunks"


def test_not_sender_yields_nothing_but_iterates():
    ex = HFWeightExtractor(ws.ExtractorConfig(is_sender=False))
    assert _collect(ex, WithBuffers()) == []


# -- hf_head --------------------------------------------------------------------------------------


def test_head_only_sends_score_layer():
    model = _qwen2("Qwen2ForSequenceClassification", num_labels=3)
    ex = ws.build_extractor({"type": "hf_head"})
    assert isinstance(ex, HFHeadWeightExtractor)
    got = _flat(_collect(ex, model))
    assert list(got) == ["score.weight"]
    assert got["score.weight"].shape == (3, 32)
    assert [m.name for m in ex.metadata(model)] == ["score.weight"]


def test_head_patterns_regex_and_substring():
    model = WithBuffers()
    ex = ws.build_extractor({"type": "hf_head", "head_name_patterns": ["re:^bn\\.(weight|bias)$"]})
    assert [m.name for m in ex.metadata(model)] == ["bn.weight", "bn.bias"]
    ex = ws.build_extractor({"type": "hf_head", "head_name_patterns": ["lin."]})
    assert [m.name for m in ex.metadata(model)] == ["lin.weight", "lin.bias"]


def test_head_no_match_lists_patterns_and_some_names():
    model = _qwen2()
    ex = ws.build_extractor({"type": "hf_head"})
    with pytest.raises(ValueError) as e:
        _collect(ex, model)
    msg = str(e.value)
    assert "['score.', 'classifier.', 'v_head.']" in msg
    assert "model.embed_tokens.weight" in msg and "model.norm.weight" in msg
    with pytest.raises(ValueError, match="head_name_patterns"):
        ex.metadata(model)


def test_head_empty_patterns_refused():
    with pytest.raises(ValueError, match="must not be empty"):
        ws.build_extractor({"type": "hf_head", "head_name_patterns": []})


# -- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset,cls", [("extractor_hf", HFWeightExtractor), ("extractor_hf_head", HFHeadWeightExtractor)]
)
def test_presets_build(preset, cls):
    ex = ws.build_extractor(preset_path(preset))
    assert type(ex) is cls
    assert isinstance(ex.cfg, cls.config_cls)
    assert ws.load_config(preset).extractor["type"] == cls.name


def test_unknown_field_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown field.*'head_patterns'.*head_name_patterns"):
        ws.build_extractor({"type": "hf_head", "head_patterns": ["x"]})


# -- bucketing (weightsync.pipeline), used by the extractor base class ---------------------------

from weightsync.pipeline import batch_by_threshold as _batch  # noqa: E402
from weightsync.pipeline import group_by_module as _group  # noqa: E402


def _named(spec: list[tuple[str, int]]) -> list[tuple[str, torch.Tensor]]:
    return [(n, torch.zeros(k, dtype=torch.float32)) for n, k in spec]


def test_group_by_module_groups_consecutive_names_of_one_module():
    named = _named([("a.w", 1), ("a.b", 1), ("b.w", 1), ("top", 1), ("a.x", 1)])
    groups = [(m, [n for n, _ in items]) for m, items in _group(named)]
    assert groups == [("a", ["a.w", "a.b"]), ("b", ["b.w"]), ("", ["top"]), ("a", ["a.x"])]
    assert list(_group([])) == []


def test_batch_by_threshold_bounds():
    groups = [("m1", _named([("m1.w", 10), ("m1.b", 2)])),  # 48 bytes
              ("m2", _named([("m2.w", 5)])),  # 20
              ("big", _named([("big.w", 100)])),  # 400 > threshold: a chunk of its own
              ("m3", _named([("m3.w", 3)]))]  # 12
    chunks = list(_batch(groups, 64))
    assert [c.names for c in chunks] == [["m1.w", "m1.b"], ["m2.w"], ["big.w"], ["m3.w"]]
    assert [c.module_name for c in chunks] == ["m1", "m2", "big", "m3"]
    chunks = list(_batch(groups[:2], 68))  # exactly at the bound: still one chunk
    assert [c.names for c in chunks] == [["m1.w", "m1.b", "m2.w"]]
    assert chunks[0].module_name == "m1..m2"
    assert list(_batch([], 64)) == []


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=4), max_size=12),
    threshold=st.integers(1, 200),
)
def test_batching_properties(sizes, threshold):
    groups = [
        (f"m{i}", _named([(f"m{i}.p{j}", k) for j, k in enumerate(g)])) for i, g in enumerate(sizes)
    ]
    chunks = list(_batch(groups, threshold))
    flat = [n for c in chunks for n in c.names]
    assert flat == [n for _, items in groups for n, _ in items]  # order preserved, nothing lost
    owner = {}
    for i, c in enumerate(chunks):
        for n in c.names:
            owner.setdefault(n.split(".")[0], set()).add(i)
        n_groups = len({n.split(".")[0] for n in c.names})
        assert c.total_size_bytes <= threshold or n_groups == 1  # only a lone group may exceed
    assert all(len(v) == 1 for v in owner.values())  # a group is never split


def test_cast_rules():
    f32, i64 = torch.ones(2), torch.ones(2, dtype=torch.int64)
    cast = ws.WeightExtractor._cast
    assert cast(f32, None) is f32 and cast(f32, torch.float32) is f32  # no copy when not needed
    assert cast(f32, torch.bfloat16).dtype == torch.bfloat16
    assert cast(i64, torch.bfloat16) is i64  # integer tensors are never cast


def test_group_by_module_off_sends_tensors_singly():
    ex = HFWeightExtractor(ws.ExtractorConfig(group_by_module=False, bucket_size_mb=1e-5))
    chunks = _collect(ex, WithBuffers())
    assert all(len(c) == 1 for c in chunks)
    assert [c.names[0] for c in chunks] == list(WithBuffers().state_dict())


def test_metadata_of_an_unchanged_model_is_reused_and_a_replaced_tensor_is_seen():
    model = torch.nn.Linear(4, 3)
    ext = HFWeightExtractor()
    first = ext.metadata(model)
    assert ext.metadata(model) == first
    model.weight = torch.nn.Parameter(torch.zeros(5, 4))  # a new tensor of another shape
    assert [m.shape for m in ext.metadata(model)] == [[5, 4], [3]]


def test_held_update_is_the_last_extraction_while_the_model_holds_the_same_tensors():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    ext = HFWeightExtractor()
    assert ext.held_update(model) is None  # nothing extracted yet
    manifest = ext.metadata(model)
    chunks = _collect(ext, model)
    held = ext.held_update(model)
    assert held is not None
    assert [c.names for c in held[0]] == [c.names for c in chunks] and held[1] == manifest
    own = {n: t.data_ptr() for n, t in model.state_dict().items()}
    assert all(t.data_ptr() == own[n] for c in held[0] for n, t in zip(c.names, c.tensors, strict=True))
    with torch.no_grad():
        model[0].weight.mul_(2)  # a training step in place: still held, today's values
    held = ext.held_update(model)
    assert held is not None and torch.equal(held[0][0].tensors[0], model[0].weight)
    model[1].bias = torch.nn.Parameter(torch.zeros(2))  # a replaced tensor: extract anew
    assert ext.held_update(model) is None
    ext.metadata(model)
    _collect(ext, model)
    assert ext.held_update(model) is not None
    assert ext.held_update(model, torch.bfloat16) is None  # another dtype: not what was made
    ext.metadata(model, torch.bfloat16)
    _collect(ext, model, torch.bfloat16)  # cast copies are not borrowed: never held
    assert ext.held_update(model, torch.bfloat16) is None
