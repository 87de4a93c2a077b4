"""What a delta update carries, and the one encoder and decoder both sides use.

A delta update is a normal update (one start, chunks, one finish, on any strategy) whose tensors
describe how each *target* tensor of the engine changed since the version the engine serves
(the *base*). Who uses this module: ``weightsync.delta.tracker`` on the sending rank (encode,
and apply to its own copy of the base) and ``weightsync.delta.store`` in the engine (apply).

Per target the encoder picks, by exact byte count, the smallest of:

* ``unchanged``: nothing travels (after a small optimizer step most bf16 values keep their
  bits: the step is below half a unit in the last place);
* ``dense``: the whole tensor, under the target's own name;
* a sparse form ``<positions>+<values>``, two wire tensors ``<name>#delta.pos`` and
  ``<name>#delta.val``. Positions (of the elements whose bits changed, ascending):
  ``indices`` (int32, or int64 past 2**31 elements), ``gaps`` (the distance from the previous
  changed element minus one, as 16-bit words; only when every distance is at most 65536) or
  ``mask`` (one bit per element, packed in bytes). Values: ``values`` (the new elements, in the
  target's dtype) or ``bitdiff`` (for 2- and 4-byte dtypes: the difference of the new and old
  bit patterns as int8, so a value that moved by one unit in the last place costs one byte;
  a difference that does not fit is written as -128 and its new value travels whole in a third
  wire tensor, ``<name>#delta.esc``, in order).

Changes are found bit by bit (an integer view of both tensors), so reconstruction is exact:
``apply(base, target, parts)`` turns the base's bits into the new tensor's bits, nothing else.
A spec (``DeltaSpec``) travels in the update's start (``WeightUpdateStart.delta``): the base
version and, per target, its name, dtype, shape and encoding with the number of changed
elements, from which the wire tensors' metadata follows (``DeltaSpec.wire_metas``); an engine
checks that the start's manifest is exactly that before any byte moves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from weightsync.types import TensorMeta, dtype_to_str, is_int

if TYPE_CHECKING:  # pragma: no cover
    import torch

UNCHANGED = "unchanged"
DENSE = "dense"
POSITIONS = ("indices", "gaps", "mask")
VALUES = ("values", "bitdiff")
ENCODINGS = (UNCHANGED, DENSE, *(f"{p}+{v}" for p in POSITIONS for v in VALUES))

POS_SUFFIX = "#delta.pos"
VAL_SUFFIX = "#delta.val"
ESC_SUFFIX = "#delta.esc"
_ESCAPE = -128
_MAX_GAP = 1 << 16
_INT_OF_SIZE = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


@dataclass(frozen=True)
class DeltaTarget:
    """One engine tensor in a delta update: its metadata, how it travels and how many of its
    elements changed (``nnz``; 0 for ``unchanged``, every element for ``dense``); ``escapes``:
    how many of a ``bitdiff`` target's values travel whole. ``checksum``: the new tensor's
    64-bit checksum (``weightsync.integrity``), when the sender was asked for checksums; the
    engine then checks what it reconstructed."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    encoding: str
    nnz: int = 0
    escapes: int = 0
    checksum: int | None = None

    @property
    def meta(self) -> TensorMeta:
        return TensorMeta(self.name, self.dtype, list(self.shape))

    @property
    def positions(self) -> str:
        return self.encoding.split("+")[0]

    @property
    def values(self) -> str:
        return self.encoding.split("+")[1]

    def wire_metas(self) -> list[TensorMeta]:
        """What travels for this target (empty for ``unchanged``)."""
        if self.encoding == UNCHANGED:
            return []
        if self.encoding == DENSE:
            return [self.meta]
        numel = self.meta.numel
        out = [TensorMeta(self.name + POS_SUFFIX, *_positions_meta(self.positions, self.nnz, numel)),
               TensorMeta(self.name + VAL_SUFFIX, *_values_meta(self.values, self.nnz, self.dtype))]
        if self.escapes:
            out.append(TensorMeta(self.name + ESC_SUFFIX, self.dtype, [self.escapes]))
        return out

    def to_list(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.encoding, self.nnz, self.escapes,
                self.checksum]

    @classmethod
    def from_list(cls, item: Any) -> DeltaTarget:
        if not isinstance(item, (list, tuple)) or len(item) != 7:
            raise ValueError(f"delta target must be [name, dtype, shape, encoding, nnz, "
                             f"escapes, checksum], got {str(item)[:120]}")
        name, dtype, shape, encoding, nnz, escapes, checksum = item
        meta = TensorMeta.from_dict({"name": name, "dtype": dtype, "shape": shape})
        if encoding not in ENCODINGS:
            raise ValueError(f"delta target {name!r}: unknown encoding {encoding!r}; known: "
                             f"{', '.join(ENCODINGS)}")
        if not is_int(nnz) or not 0 <= nnz <= meta.numel:
            raise ValueError(f"delta target {name!r}: nnz must be an int in [0, {meta.numel}], "
                             f"got {nnz!r}")
        if not is_int(escapes) or not 0 <= escapes <= nnz or (
                escapes and not encoding.endswith("+bitdiff")):
            raise ValueError(f"delta target {name!r}: escapes must be an int in [0, nnz] (only "
                             f"for a bitdiff encoding), got {escapes!r}")
        if checksum is not None and not (is_int(checksum) and -(1 << 63) <= checksum < (1 << 63)):
            raise ValueError(f"delta target {name!r}: checksum must be a signed 64-bit int")
        return cls(meta.name, meta.dtype, tuple(meta.shape), encoding, int(nnz), int(escapes),
                   checksum)


@dataclass
class DeltaSpec:
    """The ``delta`` of an update's start. ``base_version`` None: a full update (every target
    ``dense``) after which the engine keeps what a later delta needs; an int: a delta against
    that version, which the engine refuses (``DeltaBaseMismatchError``) unless it serves exactly
    that version and still holds its base."""

    base_version: int | None
    targets: list[DeltaTarget] = field(default_factory=list)

    def wire_metas(self) -> list[TensorMeta]:
        return [m for t in self.targets for m in t.wire_metas()]

    def target_metas(self) -> list[TensorMeta]:
        return [t.meta for t in self.targets]

    @property
    def full_bytes(self) -> int:
        return sum(t.meta.nbytes for t in self.targets)

    def counts(self) -> dict[str, int]:
        """Targets per encoding."""
        out: dict[str, int] = {}
        for t in self.targets:
            out[t.encoding] = out.get(t.encoding, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"base_version": self.base_version, "targets": [t.to_list() for t in self.targets]}

    @classmethod
    def from_dict(cls, d: Any) -> DeltaSpec:
        if not isinstance(d, Mapping):
            raise ValueError(f"delta must be an object {{base_version, targets}}, got "
                             f"{type(d).__name__}")
        base = d.get("base_version")
        if base is not None and (not is_int(base) or base < 0):
            raise ValueError(f"delta.base_version must be an int >= 0 or null, got {base!r}")
        items = d.get("targets")
        if not isinstance(items, (list, tuple)) or not items:
            raise ValueError("delta.targets must be a non-empty list")
        targets = [DeltaTarget.from_list(x) for x in items]
        names = [t.name for t in targets]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"delta.targets repeat {dup[:5]}")
        if base is None and any(t.encoding != DENSE for t in targets):
            raise ValueError("a full update (delta.base_version null) sends every target dense")
        return cls(base, targets)


def full_spec(manifest: Iterable[TensorMeta]) -> DeltaSpec:
    """The spec of a full update that the engines keep as the base of later deltas."""
    return DeltaSpec(None, [DeltaTarget(m.name, m.dtype, tuple(m.shape), DENSE, m.numel)
                            for m in manifest])


def target_of(wire_name: str) -> tuple[str, str]:
    """``(target name, part)`` of a wire tensor: part ``pos``, ``val``, ``esc`` or ``""``
    (dense)."""
    for suffix, part in ((POS_SUFFIX, "pos"), (VAL_SUFFIX, "val"), (ESC_SUFFIX, "esc")):
        if wire_name.endswith(suffix):
            return wire_name[: -len(suffix)], part
    return wire_name, ""


# --------------------------------------------------------------------------------------------
# encode (sending rank) and apply (both sides); runs where the tensors are
# --------------------------------------------------------------------------------------------


def encode(name: str, new: torch.Tensor, base: torch.Tensor | None,
           ) -> tuple[DeltaTarget, dict[str, torch.Tensor]]:
    """How ``new`` differs from ``base`` (None, or another dtype or shape: ``dense``): the
    cheapest encoding and its wire tensors (name -> tensor; a dense target's is ``new``)."""
    dtype = dtype_to_str(new.dtype)
    shape = tuple(new.shape)
    numel = new.numel()
    dense = DeltaTarget(name, dtype, shape, DENSE, numel)
    if base is None or base.dtype != new.dtype or tuple(base.shape) != shape or numel == 0:
        return dense, {name: new}
    new_bits, old_bits = _bits(new), _bits(base)
    changed = new_bits != old_bits
    nnz = int(changed.sum())
    if nnz == 0:
        return DeltaTarget(name, dtype, shape, UNCHANGED, 0), {}
    import torch

    idx = torch.nonzero(changed, as_tuple=False).view(-1)
    item = new.element_size()
    pos_sizes = {"indices": _index_size(numel) * nnz, "mask": (numel + 7) // 8}
    if int(idx[0]) < _MAX_GAP and (nnz == 1 or int((idx[1:] - idx[:-1]).max()) <= _MAX_GAP):
        pos_sizes["gaps"] = 2 * nnz
    val_sizes = {"values": item * nnz}
    codes = None
    escaped = 0
    if item in (2, 4):
        diff = new_bits[idx].to(torch.int64) - old_bits[idx].to(torch.int64)
        fits = (diff > _ESCAPE) & (diff <= 127)
        escaped = nnz - int(fits.sum())
        codes = torch.where(fits, diff, _ESCAPE).to(torch.int8)
        val_sizes["bitdiff"] = nnz + item * escaped
    pos = min(pos_sizes, key=lambda k: (pos_sizes[k], POSITIONS.index(k)))
    val = min(val_sizes, key=lambda k: (val_sizes[k], VALUES.index(k)))
    if pos_sizes[pos] + val_sizes[val] >= numel * item:
        return dense, {name: new}
    flat = new.reshape(-1)
    pos_t = {"indices": lambda: idx.to(_index_dtype(numel)),
             "gaps": lambda: _gaps(idx),
             "mask": lambda: _pack_bits(changed)}[pos]()
    if val == "values":
        return (DeltaTarget(name, dtype, shape, f"{pos}+values", nnz),
                {name + POS_SUFFIX: pos_t, name + VAL_SUFFIX: flat[idx]})
    assert codes is not None
    wire = {name + POS_SUFFIX: pos_t, name + VAL_SUFFIX: codes}
    if escaped:
        wire[name + ESC_SUFFIX] = flat[idx[codes == _ESCAPE]]
    return DeltaTarget(name, dtype, shape, f"{pos}+bitdiff", nnz, escaped), wire


def apply(dst: torch.Tensor, target: DeltaTarget, parts: Mapping[str, torch.Tensor]) -> None:
    """Turn ``dst`` (contiguous, holding the base) into the new tensor, in place. ``parts``:
    the target's wire tensors by part (``"pos"``, ``"val"``, ``"esc"``; ``""`` for a dense
    one)."""
    import torch

    if target.encoding == UNCHANGED:
        return
    if target.encoding == DENSE:
        dst.copy_(parts[""].reshape(dst.shape))
        return
    numel = dst.numel()
    pos, val = parts["pos"].to(dst.device), parts["val"].to(dst.device)
    if target.positions == "indices":
        idx = pos.to(torch.int64)
    elif target.positions == "gaps":
        idx = torch.cumsum((pos.to(torch.int32) & 0xFFFF).to(torch.int64) + 1, 0) - 1
    else:
        idx = torch.nonzero(_unpack_bits(pos, numel), as_tuple=False).view(-1)
    if idx.numel() != target.nnz or (target.nnz and int(idx.max()) >= numel):
        raise ValueError(f"{target.name}: the delta's positions do not fit the tensor "
                         f"({idx.numel()} positions, {target.nnz} expected, {numel} elements)")
    flat = dst.view(-1)
    if target.values == "values":
        flat[idx] = val.to(dst.dtype)
        return
    fits = val != _ESCAPE
    escaped = idx[~fits]
    if escaped.numel() != target.escapes:
        raise ValueError(f"{target.name}: {escaped.numel()} escaped values, {target.escapes} "
                         f"announced")
    bits = _bits(dst)
    kept = idx[fits]
    bits[kept] = (bits[kept].to(torch.int64) + val[fits].to(torch.int64)).to(bits.dtype)
    if target.escapes:
        flat[escaped] = parts["esc"].to(dst.device, dst.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A flat integer view of ``t``'s bits (no copy for a contiguous tensor)."""
    import torch

    flat = t.reshape(-1)
    if t.dtype == torch.bool:
        return flat.view(torch.uint8)
    if t.is_floating_point() or t.is_complex():
        from weightsync.types import str_to_dtype

        return flat.view(str_to_dtype(_INT_OF_SIZE[t.element_size()]))
    return flat


def _index_size(numel: int) -> int:
    return 4 if numel < (1 << 31) else 8


def _index_dtype(numel: int) -> torch.dtype:
    import torch

    return torch.int32 if numel < (1 << 31) else torch.int64


def _gaps(idx: torch.Tensor) -> torch.Tensor:
    """Distances to the previous changed element (the first from -1), minus one, as the low
    16 bits of int16 words."""
    import torch

    prev = torch.cat([idx.new_full((1,), -1), idx[:-1]])
    return (idx - prev - 1).to(torch.int32).to(torch.int16)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    import torch

    n = mask.numel()
    padded = torch.zeros(((n + 7) // 8) * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask.reshape(-1).to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (padded.view(-1, 8) * weights).sum(1, dtype=torch.int32).to(torch.uint8)


def _unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    import torch

    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=packed.device)
    bits = (packed.view(-1, 1) & weights) != 0
    return bits.view(-1)[:numel]


def _positions_meta(kind: str, nnz: int, numel: int) -> tuple[str, list[int]]:
    if kind == "indices":
        return ("int32" if _index_size(numel) == 4 else "int64"), [nnz]
    if kind == "gaps":
        return "int16", [nnz]
    return "uint8", [(numel + 7) // 8]


def _values_meta(kind: str, nnz: int, dtype: str) -> tuple[str, list[int]]:
    return (dtype if kind == "values" else "int8"), [nnz]
