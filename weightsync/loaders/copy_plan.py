"""Where each checkpoint tensor's bytes land in a model, learned from the model's own loader.

``CopyPlan`` lives next to a loader whose model loads checkpoint-format tensors through Python
(vLLM's ``model.load_weights``: a mapper, fused q/k/v and gate/up, vocabulary padding, tensor
parallel slices, one ``weight_loader`` call per tensor). That Python costs tens of microseconds
per tensor on every update, while what it does for an unquantized layer is always the same: copy
a view of the incoming tensor into a view of a parameter. So the first time a name is loaded,
the plan runs the real loader on the real tensor wrapped in a recording tensor subclass and
writes down every copy it makes (which view of the source, into which view of which
parameter). Later loads of that name replay the copies directly, batched: one
``torch._foreach_copy_`` per dtype and device (a plain copy where a copy casts or crosses
devices), with no Python per tensor beyond a shape check. A batch of the same source tensors as
before (the streamed receiver hands the loader the same views of its staging buffer every
update) skips even that: its foreach lists were cut the first time (``_Prepared``; held by weak
reference to the sources, so a staging buffer is not kept alive by the plan). On 2 x H100
(2026-11-26) the copy-by-copy replay of qwen2-0.5b's 289 staged tensors took 3.4 ms of host
time, most of it one launch per large copy.

A name is replayed only when everything the loader did with its tensor was understood:

* views of the source (``narrow``, slicing, ``view``/``reshape`` without a copy, ``t()``, a
  no-op ``to``/``contiguous``) followed by ``Tensor.copy_`` (or ``__setitem__``) into a view of a
  parameter or persistent buffer of the model;
* metadata queries (``shape``, ``size``, ``dim``, ``numel``, ``dtype``, ``device``, ...).

Anything else (arithmetic, a cast that copies, ``item()``, a copy into a tensor that is not the
model's, an in-place change of the source) makes the name *opaque*: it always goes through the
real loader. A name the loader skipped without touching (a tied ``lm_head.weight``) is replayed as
a no-op, which is what the loader does. A replayed name must come with the shape, strides and
dtype it was learned with (otherwise it is learned again), and the plan is dropped when the
model's parameters changed identity or storage since it was learned (``check``): a reload,
``process_weights_after_loading`` that replaced a tensor, a sleep/wake cycle.

Order: replayed copies run before the loader's calls for the rest of the same batch; the two
sets write disjoint bytes for every model we know (the loader writes each byte once).

**Staging beside the weights** (a staged update: the weights must not change before its
finish). ``stage(items)`` replays a batch into *shadows* of the parameters it writes (one
``empty_like`` each, made the first time) instead of the parameters; ``commit_staged(swap=)``
then publishes them: a parameter whose every byte this update wrote is swapped in by pointer
(``param.data = shadow``; the old storage becomes its shadow for the next update), the rest of
what was staged is copied from the shadows (one ``_foreach_copy_``). Swapping is for engines
that read their parameters through the module (eager); a captured CUDA graph holds the old
addresses, so there the caller asks for the copy. Memory: one shadow per parameter an update
writes, kept (a whole-model update: one more copy of the model, as any staging).

Callers: ``weightsync.loaders.vllm.VLLMWeightLoader`` (direct mode), in the vLLM worker process,
on the thread that runs the loader. Copies are asynchronous on the current CUDA stream, as the
loader's own are: the caller synchronises before the source buffers may be reused.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch  # this module is imported only where a model is loaded (a vLLM worker)

#: the most batches whose replay is kept cut (``_Prepared``): a 7B model streams ~15 chunks
MAX_PREPARED = 64

# calls on a recorded tensor that only read metadata (result is not a tensor)
_METADATA = frozenset({
    "shape", "dtype", "device", "ndim", "is_cuda", "is_cpu", "is_meta", "layout",
    "requires_grad", "is_leaf", "names", "is_sparse", "is_quantized", "itemsize", "nbytes",
    "size", "dim", "numel", "nelement", "stride", "is_contiguous", "storage_offset",
    "element_size", "is_floating_point", "is_complex", "__len__", "get_device", "data_ptr",
    "__format__", "__repr__", "__str__", "__hash__", "_is_view", "is_shared", "is_pinned",
})


@dataclass(frozen=True)
class _Copy:
    """``dst.copy_(src.as_strided(size, stride, src.storage_offset() + delta))``."""

    dst: Any  # a view of a parameter / buffer of the model
    size: tuple[int, ...]
    stride: tuple[int, ...]
    delta: int  # storage offset of the source view relative to the source tensor
    identity: bool  # the source itself (same size and stride, delta 0)


@dataclass(frozen=True)
class _Entry:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: Any
    device_type: str
    copies: tuple[_Copy, ...]


class CopyPlan:
    """Learned copies for a ``model`` loaded through ``load_fn(items)`` (see the module
    docstring). ``load(items)`` loads a batch of ``(name, tensor)``: replayed where known, the
    rest through ``load_fn`` (recording what it does for names not seen before). Not
    thread-safe: one loader thread."""

    def __init__(self, model: Any, load_fn: Callable[[list[tuple[str, Any]]], None], *,
                 alone_mb: float = 0.0) -> None:
        self.model = model
        self.load_fn = load_fn
        # copies of at least this many bytes run as their own ``copy_`` (a device memcpy),
        # the rest batched (``_Prepared``); 0: every copy batched
        self.alone_bytes = int(alone_mb * 2**20)
        self._entries: dict[str, _Entry] = {}
        self._opaque: set[str] = set()
        # the module tree the plan was learned on: each module's children table with the ids of
        # the children it held and the children themselves (held: an id compared is never a
        # later module's; a module replaced anywhere changes its parent's table), and the
        # tables that were empty (most: leaves)
        self._modules: list[tuple[dict, tuple[int, ...], tuple]] | None = None
        self._leaves: list[dict] = []
        self._check_due = False  # ``defer_check``: checked at the plan's next use
        self._owners: list[tuple[dict, str, Any, int]] = []  # tensors the plan writes into
        self.replayed = 0  # tensors loaded by replay (cumulative)
        self.loaded = 0  # tensors loaded through load_fn (cumulative)
        self.direct = 0  # tensors a transport wrote into their direct_target (cumulative)
        self._prepared: dict[tuple[str, ...], _Prepared] = {}  # by the batch's names
        # staging beside the weights: storage pointer of a parameter -> its shadow
        self._shadows: dict[int, Any] = {}
        self._staged_prepared: dict[tuple[str, ...], _Prepared] = {}
        self._covered: dict[int, int] = {}  # storage pointer -> bytes staged this update
        self._staged_names: list[str] = []
        self._whole: dict[int, Any] | None = None  # storage pointer -> whole-storage owner
        self._moved: dict[int, Any] = {}  # swapped storages whose copies are not yet retargeted
        self.swapped = 0  # parameters swapped in by pointer (cumulative)

    # -- public ----------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """Names that are replayed."""
        return sorted(self._entries)

    @property
    def opaque(self) -> list[str]:
        """Names that always go through ``load_fn``."""
        return sorted(self._opaque)

    def direct_target(self, name: str, dtype: Any, shape: Sequence[int]) -> Any:
        """The parameter view that a contiguous ``dtype`` tensor of ``shape`` named ``name``
        is copied into whole, when that is all the loader does with it (one copy of the whole
        source into a contiguous view of the same dtype and size: most tensors of an unsharded
        model, q/k/v into their rows of a fused ``qkv_proj``); else None. Bytes written there
        are exactly what a replay would copy."""
        self._settle()
        e = self._entries.get(name)
        if e is None or len(e.copies) != 1 or e.dtype != dtype or e.shape != tuple(shape):
            return None
        c = e.copies[0]
        dst = c.dst
        if (not c.identity or dst.dtype != dtype or not dst.is_contiguous()
                or e.stride != _contiguous_strides(e.shape)):
            return None
        return dst

    def check(self) -> bool:
        """Drop the plan if the model changed under it since it was learned (returns whether it
        was kept): a module of the model replaced, or a parameter / buffer the plan writes into
        replaced or given other storage. Call before each update, or ``defer_check`` to its
        first use (a few hundred microseconds for a 7B model)."""
        self._check_due = False
        if self._modules is None:
            return True
        self._settle()
        # (vLLM's parameter classes answer every method through __torch_function__, a Python
        # call each; without it data_ptr() is a plain C call)
        with torch._C.DisableTorchFunctionSubclass():
            same = not any(self._leaves) and all(
                tuple(map(id, children.values())) == ids
                for children, ids, _ in self._modules) and all(
                table.get(key) is t and t.data_ptr() == ptr for table, key, t, ptr in self._owners)
        if not same:
            self.clear()
        return same

    def defer_check(self) -> None:
        """``check`` at the plan's next use (its first ``direct_target``, ``load``, ``stage``
        or ``commit_staged``) instead of now: an update's start calls this, and a streamed
        receiver's first use falls while its vote is out."""
        self._check_due = True

    def clear(self) -> None:
        self._entries.clear()
        self._prepared.clear()
        self._opaque.clear()
        self._modules = None
        self._leaves = []
        self._owners = []
        self._shadows.clear()
        self._staged_prepared.clear()
        self._whole = None
        self._moved.clear()
        self.discard_staged()

    # -- staging beside the weights (see the module docstring) -------------------------------
    def stage(self, items: Sequence[tuple[str, Any]]) -> bool:
        """Replay a batch into the shadows of the parameters it writes. False (and nothing
        copied) unless every name replays and writes only whole, contiguous parameters: the
        caller then keeps its own copy of the batch and loads it at the finish."""
        self._settle()
        owners = self._whole_owners()
        entries = []
        for name, t in items:
            e = self._entries.get(name)
            if e is None or not _fits(e, t) or any(
                    c.dst.untyped_storage().data_ptr() not in owners for c in e.copies):
                return False
            entries.append(e)
        names = tuple(name for name, _ in items)
        tensors = [t for _, t in items]
        prepared = self._staged_prepared.get(names)
        if prepared is None or not prepared.holds(tensors):
            shadowed = [(_Entry(e.shape, e.stride, e.dtype, e.device_type, tuple(
                _Copy(self._shadow_view(c.dst, owners), c.size, c.stride, c.delta, c.identity)
                for c in e.copies)), t) for e, t in zip(entries, tensors, strict=True)]
            prepared = _Prepared(shadowed, self.alone_bytes)
            if len(self._staged_prepared) >= MAX_PREPARED:
                self._staged_prepared.clear()
            self._staged_prepared[names] = prepared
        with torch.no_grad():
            prepared.run(tensors)
        for e in entries:
            for c in e.copies:
                ptr = c.dst.untyped_storage().data_ptr()
                self._covered[ptr] = self._covered.get(ptr, 0) + c.dst.numel() * c.dst.element_size()
        self._staged_names.extend(names)
        return True

    def commit_staged(self, *, swap: bool) -> None:
        """Publish what ``stage`` staged in this update: with ``swap``, a parameter every byte of
        which was staged is swapped in by pointer; everything else staged is copied from the
        shadows. Copies are asynchronous on the current stream, as ``load``'s."""
        if not self._covered:
            return
        self._settle()
        owners = self._whole_owners()
        full = {ptr for ptr, n in self._covered.items()
                if swap and ptr in owners and n == _nbytes(owners[ptr])}
        copies: dict[tuple, tuple[list[Any], list[Any]]] = {}
        for name in self._staged_names:
            for c in self._entries[name].copies:
                ptr = c.dst.untyped_storage().data_ptr()
                if ptr in full:
                    continue
                dsts, srcs = copies.setdefault((c.dst.dtype, c.dst.device), ([], []))
                dsts.append(c.dst)
                srcs.append(self._shadow_view(c.dst, owners))
        with torch.no_grad():
            for dsts, srcs in copies.values():
                torch._foreach_copy_(dsts, srcs)
        if full:
            self._swap(full, owners)
        self.discard_staged()

    def discard_staged(self) -> None:
        """Forget what was staged in this update (the shadows stay, for the next one)."""
        self._covered.clear()
        self._staged_names.clear()

    @property
    def shadow_bytes(self) -> int:
        """Device memory the shadows hold (kept between staged updates)."""
        return sum(_nbytes(t) for t in self._shadows.values())

    def release_shadows(self) -> int:
        """Drop the shadows (before the engine sleeps; the next staged update makes them
        again); returns the bytes they held. Not while an update is staged."""
        if self._covered:
            raise RuntimeError("release_shadows: a staged update holds them; finish it first")
        freed = self.shadow_bytes
        self._shadows.clear()
        self._staged_prepared.clear()
        return freed

    def _whole_owners(self) -> dict[int, Any]:
        """Storage pointer -> the model's tensor that is the whole of that storage (contiguous,
        offset 0): the parameters a shadow can stand in for. Worked out once per learned plan
        (vLLM's parameter subclasses make each query a Python call: ~10 us)."""
        if self._whole is None:
            out: dict[int, Any] = {}
            seen: dict[int, set[int]] = {}  # storage -> the model tensors on it (by id)
            with torch._C.DisableTorchFunctionSubclass():
                for _table, _key, t, _ptr in self._owners:
                    ptr = t.untyped_storage().data_ptr()
                    seen.setdefault(ptr, set()).add(id(t))
                    if t.is_contiguous() and t.storage_offset() == 0 and \
                            t.untyped_storage().nbytes() == _nbytes(t):
                        out[ptr] = t
            # a storage behind two model tensors (a tie by storage, a view) is never swapped:
            # the other tensor would keep reading the old storage
            self._whole = {ptr: t for ptr, t in out.items() if len(seen[ptr]) == 1}
        return self._whole

    def _settle(self) -> None:
        """Run a deferred ``check``; point the copies of swapped parameters at the storage that
        serves now (deferred from the swap, which stands generation still, to the next use of
        the plan)."""
        if self._check_due:
            self.check()  # (clears the flag first, then settles)
        if not self._moved:
            return
        moved, self._moved = self._moved, {}
        with torch._C.DisableTorchFunctionSubclass():
            for name, e in list(self._entries.items()):
                if any(c.dst.untyped_storage().data_ptr() in moved for c in e.copies):
                    self._entries[name] = _Entry(e.shape, e.stride, e.dtype, e.device_type,
                                                 tuple(_retarget(c, moved) for c in e.copies))
        self._prepared.clear()
        self._staged_prepared.clear()

    def _shadow_view(self, dst: Any, owners: dict[int, Any]) -> Any:
        ptr = dst.untyped_storage().data_ptr()
        shadow = self._shadows.get(ptr)
        if shadow is None:
            shadow = self._shadows[ptr] = torch.empty_like(
                owners[ptr], memory_format=torch.contiguous_format)
        return shadow.as_strided(tuple(dst.shape), tuple(dst.stride()), dst.storage_offset())

    def _swap(self, ptrs: set[int], owners: dict[int, Any]) -> None:
        """``param.data = shadow`` for every model tensor on those storages (identity kept: the
        model's tables and vLLM's weight loaders hold the same objects); the old storage
        becomes the shadow. The plan's copies are pointed at the new storage at its next use
        (``_settle``), outside the pause this runs in."""
        moved: dict[int, Any] = {}  # old storage pointer -> the tensor now serving
        whole = self._whole_owners()
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            for ptr in ptrs:
                t = whole.pop(ptr)  # one object per storage (a tied table entry is the same)
                shadow = self._shadows.pop(ptr)
                old = t.data
                t.data = shadow
                moved[ptr] = t
                new_ptr = shadow.untyped_storage().data_ptr()
                self._shadows[new_ptr] = old
                whole[new_ptr] = t
            self._owners = [(table, key, t, t.data_ptr() if t.untyped_storage().data_ptr()
                             in whole else ptr) for table, key, t, ptr in self._owners]
        self.swapped += len(moved)
        self._moved.update(moved)
        self._prepared.clear()
        self._staged_prepared.clear()

    def load(self, items: Sequence[tuple[str, Any]]) -> None:
        self._settle()
        names = tuple(name for name, _ in items)
        prepared = self._prepared.get(names)
        if prepared is not None:
            tensors = [t for _, t in items]
            if prepared.holds(tensors):  # the same source tensors as last time
                with torch.no_grad():
                    prepared.run(tensors)
                self.replayed += len(tensors)
                return
        replay: list[tuple[_Entry, Any]] = []
        learn: list[tuple[str, Any]] = []
        rest: list[tuple[str, Any]] = []
        for name, t in items:
            e = self._entries.get(name)
            if e is not None and _fits(e, t):
                replay.append((e, t))
            elif name in self._opaque:
                rest.append((name, t))
            else:
                learn.append((name, t))
        if replay:
            prepared = _Prepared(replay, self.alone_bytes)
            if not learn and not rest:  # the whole batch replays: keep it cut
                if len(self._prepared) >= MAX_PREPARED:
                    self._prepared.clear()
                self._prepared[names] = prepared
            with torch.no_grad():
                prepared.run([t for _, t in replay])
            self.replayed += len(replay)
        if learn:
            self._learn(learn)
            self.loaded += len(learn)
        if rest:
            self.load_fn(rest)
            self.loaded += len(rest)

    # -- learning --------------------------------------------------------------------------
    def _tables(self) -> Iterable[dict]:
        """Every module's own parameter and buffer tables."""
        for m in self.model.modules():
            yield m._parameters
            yield m._buffers

    def _learn(self, items: list[tuple[str, Any]]) -> None:
        owned = {t.untyped_storage().data_ptr() for table in self._tables()
                 for t in table.values() if t is not None and t.numel()}
        rec = _Recorder(owned)
        wrapped = []
        for i, (name, t) in enumerate(items):
            w = t.as_subclass(_Recorded)
            w._ws_source = i
            rec.sources.append(_Source(t))
            wrapped.append((name, w))
        with rec.active():
            self.load_fn(wrapped)
        for (name, t), src in zip(items, rec.sources, strict=True):
            if src.opaque:
                self._opaque.add(name)
                self._entries.pop(name, None)
            else:
                self._entries[name] = _Entry(tuple(t.shape), tuple(t.stride()), t.dtype,
                                             t.device.type, tuple(src.copies))
        self._note_owners()

    def _note_owners(self) -> None:
        """Remember the model's module tree and the tensors the plan writes into (as they are
        after the loader ran: it may have replaced some); entries whose target is no longer
        the model's are dropped (learned again next time)."""
        targets = {c.dst.untyped_storage().data_ptr() for e in self._entries.values()
                   for c in e.copies}
        owners, found = [], set()
        for table in self._tables():
            for key, t in table.items():
                if t is None or not t.numel():
                    continue
                ptr = t.untyped_storage().data_ptr()
                if ptr in targets:
                    owners.append((table, key, t, t.data_ptr()))
                    found.add(ptr)
        for name in [n for n, e in self._entries.items()
                     if any(c.dst.untyped_storage().data_ptr() not in found for c in e.copies)]:
            del self._entries[name]
        self._owners = owners
        self._whole = None
        modules = list(self.model.modules())
        self._modules = [(m._modules, tuple(map(id, m._modules.values())),
                          tuple(m._modules.values())) for m in modules if m._modules]
        self._leaves = [m._modules for m in modules if not m._modules]


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def _retarget(c: _Copy, moved: dict[int, Any]) -> _Copy:
    """``c`` writing into the same view of the tensor that now serves in its storage's place."""
    now = moved.get(c.dst.untyped_storage().data_ptr())
    if now is None:
        return c
    dst = now.data.as_strided(tuple(c.dst.shape), tuple(c.dst.stride()), c.dst.storage_offset())
    return _Copy(dst, c.size, c.stride, c.delta, c.identity)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _fits(e: _Entry, t: Any) -> bool:
    return (e.dtype == t.dtype and e.shape == tuple(t.shape) and e.stride == tuple(t.stride())
            and e.device_type == t.device.type)


class _Prepared:
    """One batch's replay cut into its calls: per dtype and device one ``_foreach_copy_`` over
    every copy that neither casts nor crosses devices, a ``copy_`` for each one that does and
    for each of at least ``alone_bytes`` (> 0; a plain copy of a large contiguous view is a
    device memcpy, which ``benchmarks/bench_copies.py`` compares with the batched kernel).
    Sources are held by weak reference: ``holds(tensors)`` says whether ``tensors`` are the very
    objects it was cut for (same storage, offset, shape and strides: the checks ``load`` makes
    hold for them), and ``run(tensors)`` replays it from them."""

    def __init__(self, batch: list[tuple[_Entry, Any]], alone_bytes: int = 0) -> None:
        self._refs = [weakref.ref(t) for _, t in batch]
        groups: dict[tuple, tuple[list[Any], list[tuple[int, _Copy]]]] = {}
        self._singles: list[tuple[int, _Copy]] = []
        for i, (e, t) in enumerate(batch):
            for c in e.copies:
                dst = c.dst
                if not dst.numel():
                    continue
                if (dst.dtype != t.dtype or dst.device != t.device or (
                        alone_bytes and dst.numel() * dst.element_size() >= alone_bytes)):
                    self._singles.append((i, c))
                    continue
                dsts, specs = groups.setdefault((dst.dtype, dst.device), ([], []))
                dsts.append(dst)
                specs.append((i, c))
        self._groups = list(groups.values())

    def holds(self, tensors: list[Any]) -> bool:
        refs = self._refs
        return len(refs) == len(tensors) and all(
            r() is t for r, t in zip(refs, tensors, strict=True))

    def run(self, tensors: list[Any]) -> None:
        for dsts, specs in self._groups:
            torch._foreach_copy_(dsts, [_source(tensors[i], c) for i, c in specs])
        for i, c in self._singles:
            c.dst.copy_(_source(tensors[i], c), non_blocking=c.dst.device != tensors[i].device)


def _source(t: Any, c: _Copy) -> Any:
    """The view of ``t`` that copy ``c`` reads."""
    return t if c.identity else t.as_strided(c.size, c.stride, t.storage_offset() + c.delta)


# --------------------------------------------------------------------------------------------
# recording
# --------------------------------------------------------------------------------------------


class _Source:
    """What the loader did with one incoming tensor."""

    def __init__(self, t: Any) -> None:
        self.storage = t.untyped_storage().data_ptr()
        self.offset = t.storage_offset()
        self.size = tuple(t.shape)
        self.stride = tuple(t.stride())
        self.copies: list[_Copy] = []
        self.opaque = False

    def view_spec(self, v: Any) -> tuple[tuple[int, ...], tuple[int, ...], int, bool] | None:
        """(size, stride, delta, identity) of ``v`` as a view of this source, or None."""
        if v.untyped_storage().data_ptr() != self.storage:
            return None
        size, stride, delta = tuple(v.shape), tuple(v.stride()), v.storage_offset() - self.offset
        return size, stride, delta, (size == self.size and stride == self.stride and delta == 0)


_state = threading.local()


class _Recorder:
    def __init__(self, owned: set[int]) -> None:
        self.owned = owned  # storage pointers of the model's parameters and buffers
        self.sources: list[_Source] = []

    def active(self) -> Any:
        import contextlib

        @contextlib.contextmanager
        def scope() -> Any:
            prev = getattr(_state, "recorder", None)
            _state.recorder = self
            try:
                yield
            finally:
                _state.recorder = prev

        return scope()

    def copied(self, dst: Any, src: Any) -> None:
        source = self.sources[src._ws_source]
        spec = source.view_spec(src)
        if spec is None or dst.untyped_storage().data_ptr() not in self.owned or not dst.numel():
            source.opaque = True
            return
        size, stride, delta, identity = spec
        if tuple(dst.shape) != size:  # broadcasting copy: not replayed
            source.opaque = True
            return
        source.copies.append(_Copy(dst.detach(), size, stride, delta, identity))


def _func_name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        owner = getattr(getattr(func, "__self__", None), "__name__", "?")
        return owner if name == "__get__" else f"{name}:{owner}"
    return name


def _recorded_args(args: Any, kwargs: Any) -> list[Any]:
    found = []

    def walk(x: Any) -> None:
        if isinstance(x, _Recorded):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)

    walk(args)
    walk(kwargs)
    return found


def _plain_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, _Recorded)


class _Recorded(torch.Tensor):
    """A view of an incoming tensor that reports what the loader does with it."""

    _ws_source: int = -1

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        rec: _Recorder | None = getattr(_state, "recorder", None)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if rec is None:
            return out
        name = _func_name(func)
        involved = _recorded_args(args, kwargs)
        sources = {r._ws_source for r in involved}

        def opaque() -> None:
            for s in sources:
                rec.sources[s].opaque = True

        with torch._C.DisableTorchFunctionSubclass():
            if name == "copy_" and len(args) >= 2 and _plain_tensor(args[0]) \
                    and isinstance(args[1], _Recorded) and len(sources) == 1:
                rec.copied(args[0], args[1])
                return out
            if name == "__setitem__" and len(args) >= 3 and _plain_tensor(args[0]) \
                    and isinstance(args[2], _Recorded) and len(sources) == 1:
                dst = args[0][args[1]]
                if dst.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr():
                    rec.copied(dst, args[2])
                else:
                    opaque()
                return out
            if not isinstance(out, torch.Tensor):
                if name not in _METADATA:
                    opaque()
                return out
            # a tensor result: a view of exactly one source, not written in place, stays recorded
            in_place = name.endswith("_") and not name.endswith("__")
            if len(sources) == 1 and not in_place and not name.startswith("__set__"):
                (s,) = sources
                if rec.sources[s].view_spec(out) is not None:
                    wrapped = out.as_subclass(_Recorded)
                    wrapped._ws_source = s
                    return wrapped
            opaque()
            return out
