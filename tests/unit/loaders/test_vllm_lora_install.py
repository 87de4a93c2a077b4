"""``weightsync.loaders.vllm_lora_install`` against stand-ins of vLLM's LoRA objects (no vLLM:
the real engine is tested in ``tests/integration/loaders/test_vllm_lora_adapter.py``; here the
cases it cannot reach: layers of different scalings, a ``set_lora`` that cannot be replayed,
an adapter vLLM copied). The stand-ins do what vLLM's do: ``LoRAModel.loras`` of layer weights
whose ``lora_b`` vLLM scales in place, and layers with stacked per-slot buffers that
``set_lora`` zeroes and copies into."""

from __future__ import annotations

import torch

from weightsync.loaders.vllm_lora_install import InstalledAdapter, leaf_scales, update_key
from weightsync.types import TensorMeta

ID = 7
SLOTS, MAX_RANK = 2, 4
LAYERS = {"m1": (6, 5, 2.0), "m2": (3, 8, 0.5)}  # out, in, scaling (alpha / r differs by layer)


class _Weights:
    def __init__(self, a, b, scaling):
        self.lora_a, self.lora_b, self.scaling = a, b, scaling


class _LoRA:
    def __init__(self, loras):
        self.loras = loras


class _Layer:
    """vLLM's linear LoRA layer as far as a slot goes: stacked A / B per slot, ``set_lora``
    zeroes the slot and copies the adapter's tensors into it."""

    def __init__(self, out_f, in_f, *, odd=False):
        self.lora_a_stacked = (torch.zeros(SLOTS, 1, MAX_RANK, in_f, dtype=torch.bfloat16),)
        self.lora_b_stacked = (torch.zeros(SLOTS, 1, out_f, MAX_RANK, dtype=torch.bfloat16),)
        self.odd = odd

    def set_lora(self, index, a, b):
        self.lora_a_stacked[0][index] = 0
        self.lora_b_stacked[0][index] = 0
        if self.odd:  # copies out of a temporary: nothing a replay could redo
            a = a.clone()
        self.lora_a_stacked[0][index, 0, :a.shape[0], :a.shape[1]].copy_(a)
        self.lora_b_stacked[0][index, 0, :b.shape[0], :b.shape[1]].copy_(b)


class _Adapters:
    def __init__(self, *, odd=False):
        self.modules = {n: _Layer(o, i, odd=odd) for n, (o, i, _) in LAYERS.items()}
        self.lora_index_to_id = [None] * SLOTS
        self._registered_adapters: dict[int, _LoRA] = {}

    def _get_lora_layer_weights(self, lora, name):
        return lora.loras.get(name)

    def activate(self, lora, index):  # vLLM's activation of a slot
        self.lora_index_to_id[index] = ID
        for name, layer in self.modules.items():
            w = lora.loras[name]
            layer.set_lora(index, w.lora_a, w.lora_b)


def _metas():
    out = []
    for n, (o, i, _) in LAYERS.items():
        out.append(TensorMeta(f"base_model.model.{n}.lora_A.weight", "float32", [2, i]))
        out.append(TensorMeta(f"base_model.model.{n}.lora_B.weight", "float32", [o, 2]))
    return out


def _version(seed):
    g = torch.Generator().manual_seed(seed)
    return {m.name: torch.randn(m.shape, generator=g) for m in _metas()}


def _vllm_built(values):
    """What vLLM makes of ``values``: cast to the LoRA dtype, each B scaled in place."""
    loras = {}
    for n, (_, _, scaling) in LAYERS.items():
        a = values[f"base_model.model.{n}.lora_A.weight"].to(torch.bfloat16)
        b = values[f"base_model.model.{n}.lora_B.weight"].to(torch.bfloat16)
        b *= scaling
        loras[n] = _Weights(a, b, 1)
    return loras


def _install_first(adapters, values, *, copy_in_vllm=False):
    """The first version as the loader builds it: into the inbox, cast into ``held``, handed
    to "vLLM" (which keeps the tensors, unless ``copy_in_vllm``), remembered."""
    record = InstalledAdapter.allocate(update_key({"r": 2}, _metas()), _metas(), "cpu")
    for n, t in values.items():
        record.inbox[n].copy_(t)
    given = record.private_copies(torch.bfloat16)
    take = (lambda t: t.clone()) if copy_in_vllm else (lambda t: t)
    lora = _LoRA({n: _Weights(take(given[f"base_model.model.{n}.lora_A.weight"]),
                              take(given[f"base_model.model.{n}.lora_B.weight"]), s)
                  for n, (_, _, s) in LAYERS.items()})
    scales = leaf_scales(lora)
    for w in lora.loras.values():  # vLLM's optimize
        w.lora_b *= w.scaling
        w.scaling = 1
    adapters._registered_adapters[ID] = lora
    record.remember(lora, given, scales)
    return record, lora


def _slot(adapters, index):
    return [t[index].clone() for layer in adapters.modules.values()
            for t in (*layer.lora_a_stacked, *layer.lora_b_stacked)]


def _same(xs, ys):
    return all(torch.equal(x, y) for x, y in zip(xs, ys, strict=True))


def test_next_versions_equal_vllms_build_and_activation_with_a_scaling_per_layer():
    adapters = _Adapters()
    record, lora = _install_first(adapters, _version(0))
    assert record.b_start == sum(m.numel for m in _metas() if "lora_A" in m.name)  # A's first
    assert record.can_rewrite(adapters, ID)
    assert record.rewrite(adapters, ID) == "inactive"  # not in a slot: only the LoRAModel
    adapters.activate(lora, 1)
    reference = _Adapters()
    for step, want_how in ((1, "recorded"), (2, "replayed"), (3, "replayed")):
        values = _version(step)
        for n, t in values.items():
            record.inbox[n].copy_(t)
        assert record.rewrite(adapters, ID) == want_how
        want = _vllm_built(values)
        for n, w in lora.loras.items():  # bit for bit what vLLM would hold
            assert torch.equal(w.lora_a, want[n].lora_a) and torch.equal(w.lora_b, want[n].lora_b)
        reference.activate(_LoRA(want), 1)
        assert _same(_slot(adapters, 1), _slot(reference, 1)), step
        assert not _slot(adapters, 0)[0].any()  # the other slot untouched


def test_a_set_lora_that_cannot_be_replayed_runs_each_time_and_stays_exact():
    adapters = _Adapters(odd=True)
    record, lora = _install_first(adapters, _version(0))
    adapters.activate(lora, 0)
    reference = _Adapters()
    for step in (1, 2):
        values = _version(step)
        for n, t in values.items():
            record.inbox[n].copy_(t)
        assert record.rewrite(adapters, ID) == "set_lora"  # recorded once: not replayable
        assert record.slot_copies[0] is None
        reference.activate(_LoRA(_vllm_built(values)), 0)
        assert _same(_slot(adapters, 0), _slot(reference, 0))


def test_an_adapter_vllm_copied_or_replaced_is_built_by_vllm_again():
    adapters = _Adapters()
    record, _ = _install_first(adapters, _version(0), copy_in_vllm=True)
    assert not record.can_rewrite(adapters, ID)  # its tensors are not ours: no fast path
    record, _ = _install_first(adapters, _version(0))
    assert record.can_rewrite(adapters, ID)
    adapters._registered_adapters[ID] = _LoRA({})  # vLLM holds another LoRAModel now
    assert not record.can_rewrite(adapters, ID)


def test_a_record_matches_the_same_config_and_manifest_only():
    adapters = _Adapters()
    record, _ = _install_first(adapters, _version(0))
    metas = _metas()
    assert record.matches({"r": 2}, metas) and record.matches({"r": 2}, metas)
    assert not record.matches({"r": 2, "lora_alpha": 8}, metas)
    wider = [TensorMeta(m.name, m.dtype, [m.shape[0], m.shape[1] + 1]) for m in metas]
    assert not record.matches({"r": 2}, wider)
    assert InstalledAdapter.allocate(("k",), [
        TensorMeta("a", "float32", [2]), TensorMeta("b", "bfloat16", [2])], "cpu") is None
