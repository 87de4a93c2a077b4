"""``weightsync.loaders.copy_plan.CopyPlan``: copies learned from a model's own ``load_weights``
and replayed; against a second model loaded by ``load_weights`` every time, bit for bit.

The model here loads like vLLM does (fused q/k/v and gate/up filled by ``narrow`` + ``copy_``, a
padded vocabulary, a tied head the loader skips, a ``__setitem__`` copy), plus loaders the plan
must not replay (a transposed copy, ``fill_(item())``, a copy into a temporary). The real vLLM
Qwen2 model is checked in ``tests/integration/loaders/test_vllm_copy_plan.py``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from weightsync.loaders.copy_plan import CopyPlan  # noqa: E402

H, VOCAB, PADDED = 8, 6, 8


class VllmLike(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(PADDED, H), requires_grad=False)
        self.qkv = torch.nn.Parameter(torch.zeros(4 + 2 + 2, H), requires_grad=False)
        self.gate_up = torch.nn.Parameter(torch.zeros(2 * 16, H), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(H), requires_grad=False)
        self.odd = torch.nn.Parameter(torch.zeros(H, 4), requires_grad=False)
        self.scale = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        self.staged = torch.nn.Parameter(torch.zeros(H), requires_grad=False)
        self.register_buffer("inv_freq", torch.zeros(4))
        self.seen: list[str] = []

    def load_weights(self, items) -> None:
        qkv = {"q_proj.weight": (0, 4), "k_proj.weight": (4, 2), "v_proj.weight": (6, 2)}
        for name, t in items:
            self.seen.append(name)
            if name in qkv:
                start, n = qkv[name]
                dst = self.qkv.data.narrow(0, start, n)
                src = t.narrow(0, 0, n)  # vLLM narrows the source even at TP=1
                assert dst.shape == src.shape
                dst.copy_(src)
            elif name in ("gate_proj.weight", "up_proj.weight"):
                k = 0 if name.startswith("gate") else 1
                self.gate_up.data[k * 16:(k + 1) * 16] = t
            elif name == "embed.weight":
                self.embed.data[: t.shape[0]].copy_(t)
            elif name == "lm_head.weight":
                continue  # tied to the embedding: skipped, as vLLM skips it
            elif name == "norm.weight":
                self.norm.data.copy_(t)
            elif name == "odd.weight":  # stored transposed: the copy goes through a new tensor
                self.odd.data.copy_(t.t().contiguous())
            elif name == "scale":
                self.scale.data.fill_(t.item())
            elif name == "staged.weight":  # through a temporary, then assigned
                tmp = torch.empty_like(self.staged)
                tmp.copy_(t)
                self.staged.data = tmp
            elif name == "inv_freq":
                self.inv_freq.copy_(t)
            else:
                raise KeyError(name)


SHAPES = {
    "embed.weight": (VOCAB, H), "q_proj.weight": (4, H), "k_proj.weight": (2, H),
    "v_proj.weight": (2, H), "gate_proj.weight": (16, H), "up_proj.weight": (16, H),
    "lm_head.weight": (VOCAB, H), "norm.weight": (H,), "odd.weight": (4, H), "scale": (1,),
    "staged.weight": (H,), "inv_freq": (4,),
}
REPLAYED = {"embed.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight",
            "gate_proj.weight", "up_proj.weight", "lm_head.weight", "norm.weight", "inv_freq"}
OPAQUE = {"odd.weight", "scale", "staged.weight"}


def _state(seed: int, dtype=torch.bfloat16) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(s, generator=g).to(dtype)) for n, s in SHAPES.items()]


def _loader(model: VllmLike):
    def load(items) -> None:
        with torch.no_grad():
            model.load_weights(items)
    return load


def _same(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    sb = b.state_dict()
    return [n for n, t in a.state_dict().items() if not torch.equal(t, sb[n])]


def _pair():
    model, ref = VllmLike().to(torch.bfloat16), VllmLike().to(torch.bfloat16)
    return model, ref, CopyPlan(model, _loader(model))


def test_replayed_loads_equal_the_loaders_own_bit_for_bit():
    model, ref, plan = _pair()
    for step in range(4):
        items = _state(step)
        model.seen.clear()
        plan.load(items)
        _loader(ref)(items)
        assert _same(model, ref) == [], step
        if step == 0:  # learning: the real loader ran for every name
            assert set(model.seen) == set(SHAPES)
        else:  # replay: the loader only sees what it must always do itself
            assert set(model.seen) == OPAQUE, step
    assert set(plan.names) == REPLAYED
    assert set(plan.opaque) == OPAQUE
    assert plan.replayed == 3 * len(REPLAYED)
    # the padded rows of the embedding were never written
    assert torch.equal(model.embed[VOCAB:], torch.zeros(PADDED - VOCAB, H, dtype=torch.bfloat16))


def test_a_replaced_parameter_drops_the_plan():
    model, ref, plan = _pair()
    plan.load(_state(0))
    plan.load(_state(1))
    assert plan.check()
    model.qkv = torch.nn.Parameter(torch.zeros(8, H, dtype=torch.bfloat16), requires_grad=False)
    ref.qkv = torch.nn.Parameter(torch.zeros(8, H, dtype=torch.bfloat16), requires_grad=False)
    assert not plan.check() and plan.names == []
    items = _state(2)
    plan.load(items)
    _loader(ref)(items)
    assert _same(model, ref) == []
    assert not torch.equal(model.qkv, torch.zeros_like(model.qkv))  # landed in the new tensor


def test_a_module_added_or_replaced_anywhere_in_the_tree_drops_the_plan():
    """The plan keeps the module tree it learned on (each module's children): a module added
    to the model, or one replaced deep inside it, however its parameters look, drops it."""
    model, _, plan = _pair()
    model.block = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    plan.load(_state(0))
    plan.load(_state(1))
    assert plan.check() and plan.names
    model.block[1] = torch.nn.GELU()  # replaced two levels down
    assert not plan.check() and plan.names == []
    plan.load(_state(2))
    plan.load(_state(3))
    assert plan.check() and plan.names
    model.extra = torch.nn.Identity()  # added at the top
    assert not plan.check()


def test_a_deferred_check_runs_at_the_plans_next_use():
    """``defer_check`` (an update's start) checks at the plan's next use: unchanged, the plan
    keeps replaying; a leaf given a child or a replaced parameter since drops it there, before
    anything is written through it, and the load that follows learns the new tensors."""
    model, ref, plan = _pair()
    plan.load(_state(0))
    plan.load(_state(1))
    plan.defer_check()
    dst = plan.direct_target("q_proj.weight", torch.bfloat16, (4, H))  # checked here: kept
    assert dst is not None and dst.data_ptr() == model.qkv.data_ptr() and plan.names
    replayed = plan.replayed
    plan.defer_check()
    model.qkv = torch.nn.Parameter(torch.zeros(8, H, dtype=torch.bfloat16), requires_grad=False)
    ref.qkv = torch.nn.Parameter(torch.zeros(8, H, dtype=torch.bfloat16), requires_grad=False)
    assert plan.names  # nothing checked yet
    items = _state(2)
    plan.load(items)  # the check runs first: the plan is dropped, the load learns anew
    _loader(ref)(items)
    assert _same(model, ref) == [] and plan.replayed == replayed
    assert not torch.equal(model.qkv, torch.zeros_like(model.qkv))  # landed in the new tensor
    plan.load(_state(3))
    assert plan.check() and plan.replayed > replayed
    plan.defer_check()
    leaf = next(m for m in model.modules() if not m._modules)
    leaf.extra = torch.nn.Identity()  # a leaf that gained a child
    plan.load(_state(4))
    assert plan.replayed == replayed + len(REPLAYED)  # learned again, not replayed


def test_a_tensor_with_other_strides_is_learned_again():
    model, ref, plan = _pair()
    plan.load(_state(0))
    items = _state(1)
    # same values, transposed storage: a plan learned on a contiguous tensor must not replay
    items = [(n, t.t().contiguous().t() if t.dim() == 2 else t) for n, t in items]
    assert not items[0][1].is_contiguous()
    plan.load(items)
    _loader(ref)(items)
    assert _same(model, ref) == []


def test_replay_is_one_foreach_copy_per_dtype_and_reuses_its_cut_for_the_same_sources(
        monkeypatch):
    import gc
    import weakref

    model, ref, plan = _pair()
    plan.load(_state(0))  # learned
    _loader(ref)(_state(0))
    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: (calls.append(len(d)), real(d, s)))
    # one staging buffer, cut into the same views every update (as the streamed receiver does)
    shapes = {n: s for n, s in SHAPES.items() if n in REPLAYED}
    buf = torch.empty(sum(torch.Size(s).numel() for s in shapes.values()), dtype=torch.bfloat16)
    views, at = [], 0
    for n, s in shapes.items():
        k = torch.Size(s).numel()
        views.append((n, buf[at:at + k].view(s)))
        at += k
    for step in (1, 2, 3):
        values = dict(_state(step))
        for n, v in views:
            v.copy_(values[n])
        plan.load(views)
        _loader(ref)(views)
        assert _same(model, ref) == [], step
    # every copy of a batch in one call (one dtype, one device), the batch cut once
    assert calls == [len(REPLAYED) - 1] * 3  # the tied head copies nothing
    assert len(plan._prepared) == 1
    # other tensor objects under the same names: not the cut batch's, still exact
    plan.load(_state(4))
    _loader(ref)(_state(4))
    assert _same(model, ref) == []
    # the plan does not keep a staging buffer alive
    gone = weakref.ref(buf)
    del buf, views, v  # v: the loop's last view
    gc.collect()
    assert gone() is None



def test_copies_of_alone_bytes_or_more_run_on_their_own_the_rest_batched(monkeypatch):
    """``alone_mb``: a replayed copy at least that large is its own ``copy_`` (a memcpy on a
    device), the smaller ones stay in the one ``_foreach_copy_``; the result is the same."""
    model, ref = VllmLike().to(torch.bfloat16), VllmLike().to(torch.bfloat16)
    sizes = {n: torch.Size(s).numel() * 2 for n, s in SHAPES.items() if n in REPLAYED}
    alone = sorted(sizes.values())[len(sizes) // 2]  # about half the copies alone
    plan = CopyPlan(model, _loader(model), alone_mb=alone / 2**20)
    plan.load(_state(0))  # learned
    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: (calls.append(
        max(t.numel() * t.element_size() for t in d)), real(d, s)))
    for step in (1, 2):
        plan.load(_state(step))
        _loader(ref)(_state(step))
        assert _same(model, ref) == [], step
    assert len(calls) == 2 and all(biggest < alone for biggest in calls)


def test_direct_target_is_the_whole_copy_of_a_learned_name_and_nothing_else():
    model, ref, plan = _pair()
    assert plan.direct_target("q_proj.weight", torch.bfloat16, (4, H)) is None  # not learned
    plan.load(_state(0))
    direct = {n for n, s in SHAPES.items() if plan.direct_target(n, torch.bfloat16, s) is not None}
    # one copy of the whole source into a contiguous view: q/k/v rows of the fused qkv, the
    # gate/up halves, the embedding's first rows, the norm, the buffer; not the skipped tied
    # head (no copy), not what the loader does through Python (transposed, item(), temporary)
    assert direct == {"embed.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight",
                      "gate_proj.weight", "up_proj.weight", "norm.weight", "inv_freq"}
    assert plan.direct_target("q_proj.weight", torch.float32, (4, H)) is None  # other dtype
    assert plan.direct_target("q_proj.weight", torch.bfloat16, (2, H)) is None  # other shape
    # bytes written into the targets are exactly what a replay copies
    items = dict(_state(1))
    for name in direct:
        plan.direct_target(name, torch.bfloat16, SHAPES[name]).copy_(items[name])
    plan.load([(n, t) for n, t in items.items() if n not in direct])
    _loader(ref)(list(items.items()))
    assert _same(model, ref) == []


def test_staged_batches_land_only_at_commit_by_pointer_swap_or_copy_and_replay_follows():
    model, ref, plan = _pair()
    plan.load(_state(0))  # learned
    _loader(ref)(_state(0))
    ptrs = {n: t.data_ptr() for n, t in model.named_parameters()}
    qkv = model.qkv
    replayed = [(n, t) for n, t in _state(1) if n in REPLAYED]
    # a batch with a name the plan cannot replay is refused whole, nothing copied
    assert not plan.stage(_state(1))
    assert plan.stage(replayed[:3]) and plan.stage(replayed[3:])
    assert _same(model, ref) == []  # staged: the weights did not change
    plan.commit_staged(swap=True)
    _loader(ref)(replayed)
    assert _same(model, ref) == []
    # every byte of qkv, gate_up, norm and the buffer was staged: swapped in by pointer (the
    # same Parameter object, new storage); the embedding's padded rows were not: copied
    assert plan.swapped == 4
    assert model.qkv is qkv and qkv.data_ptr() != ptrs["qkv"]
    assert model.embed.data_ptr() == ptrs["embed"]
    assert plan.check() and set(plan.names) == REPLAYED  # the plan follows the swap
    plan.load(_state(2))  # an in-place update replays into the storage that now serves
    _loader(ref)(_state(2))
    assert _same(model, ref) == []
    # a failed staged update: discarded, the weights stay
    assert plan.stage([(n, t) for n, t in _state(3) if n in REPLAYED])
    plan.discard_staged()
    assert _same(model, ref) == []
    # a swap again: the two storages take turns (the old one became the shadow)
    batch = [(n, t) for n, t in _state(4) if n in REPLAYED]
    assert plan.stage(batch)
    plan.commit_staged(swap=True)
    _loader(ref)(batch)
    assert _same(model, ref) == [] and qkv.data_ptr() == ptrs["qkv"] and plan.swapped == 8
    # without swapping (an engine with CUDA graphs): copied, the addresses stay
    batch = [(n, t) for n, t in _state(5) if n in REPLAYED]
    assert plan.stage(batch)
    plan.commit_staged(swap=False)
    _loader(ref)(batch)
    assert _same(model, ref) == [] and qkv.data_ptr() == ptrs["qkv"] and plan.swapped == 8
    # a staged update that writes only part of a parameter (q of qkv): copied, not swapped
    batch = [(n, t) for n, t in _state(6) if n == "q_proj.weight"]
    assert plan.stage(batch)
    plan.commit_staged(swap=True)
    _loader(ref)(batch)
    assert _same(model, ref) == [] and qkv.data_ptr() == ptrs["qkv"] and plan.swapped == 8


def test_a_storage_behind_two_model_tensors_is_never_staged_into_a_shadow():
    model, ref, plan = _pair()
    # the head tied to the norm by storage, as two Parameter objects: swapping one would leave
    # the other on the old storage
    model.tied = torch.nn.Parameter(model.norm.data, requires_grad=False)
    ref.tied = torch.nn.Parameter(ref.norm.data, requires_grad=False)
    plan.load(_state(0))
    _loader(ref)(_state(0))
    norm = [(n, t) for n, t in _state(1) if n == "norm.weight"]
    assert not plan.stage(norm)  # the sink then keeps a copy and loads it at the finish
    qkv = [(n, t) for n, t in _state(1) if n.endswith(("q_proj.weight", "k_proj.weight",
                                                       "v_proj.weight"))]
    assert plan.stage(qkv)
    plan.commit_staged(swap=True)
    _loader(ref)(qkv)
    assert _same(model, ref) == [] and plan.swapped == 1
    assert model.tied.data_ptr() == model.norm.data_ptr()


def test_shadows_are_kept_between_staged_updates_and_released_before_a_sleep():
    import weakref

    model, ref, plan = _pair()
    plan.load(_state(0))
    _loader(ref)(_state(0))
    batch = [(n, t) for n, t in _state(1) if n in REPLAYED]
    assert plan.stage(batch)
    with pytest.raises(RuntimeError, match="a staged update holds them"):
        plan.release_shadows()
    plan.commit_staged(swap=True)
    _loader(ref)(batch)
    held = plan.shadow_bytes
    # one shadow per parameter written: qkv, gate_up, the embedding, the norm, the buffer
    assert held == sum(t.numel() * t.element_size() for t in
                       (model.qkv, model.gate_up, model.embed, model.norm, model.inv_freq))
    gone = [weakref.ref(t) for t in plan._shadows.values()]
    assert plan.release_shadows() == held and plan.shadow_bytes == 0
    assert all(r() is None for r in gone)  # freed, not kept by a cached replay
    batch = [(n, t) for n, t in _state(2) if n in REPLAYED]
    assert plan.stage(batch)  # made again
    plan.commit_staged(swap=True)
    _loader(ref)(batch)
    assert _same(model, ref) == []
