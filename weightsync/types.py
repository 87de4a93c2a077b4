"""Plain data types that cross process boundaries.

Every request and sync-info type round-trips through ``to_dict()`` / ``from_dict()`` as
JSON-safe data (dtype strings such as ``"bfloat16"``, shapes as lists of ints). Nothing here is
ever pickled onto a wire we own: IPC handles travel as plain fields (see ``IpcBufferHandle``)
and are rebuilt by our own code on the receiving side.

This module does not import torch at import time, so ``import weightsync`` stays light.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import operator
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # pragma: no cover
    import torch

# --------------------------------------------------------------------------------------------
# dtype helpers (string <-> torch.dtype), the only place that spells dtypes as strings
# --------------------------------------------------------------------------------------------

_DTYPE_NAMES = (
    "float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2",
    "int8", "uint8", "int16", "int32", "int64", "bool",
)


def dtype_to_str(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


_DTYPE_CACHE: dict[str, Any] = {}  # name -> torch.dtype (hot: called per tensor per chunk)


def str_to_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` (or ``"torch.bfloat16"``) -> ``torch.bfloat16``; unknown names raise."""
    if not isinstance(name, str):
        raise ValueError(f"dtype must be a string such as 'bfloat16', got {str(name)[:40]!r}")
    dtype = _DTYPE_CACHE.get(name)
    if dtype is not None:
        return dtype
    import torch

    key = name.removeprefix("torch.") if isinstance(name, str) else name
    dtype = getattr(torch, key, None) if isinstance(key, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(_DTYPE_NAMES)}")
    _DTYPE_CACHE[name] = dtype
    return dtype


def as_dtype(dtype: Any) -> Any:
    """An extractor's ``generator_dtype`` as a ``torch.dtype``: a string such as
    ``"bfloat16"`` converted, None or a dtype as given."""
    return str_to_dtype(dtype) if isinstance(dtype, str) else dtype


_ITEMSIZE: dict[str, int] = {}  # name -> bytes per element (hot: per tensor per update)


def dtype_itemsize(name: str) -> int:
    size = _ITEMSIZE.get(name)
    if size is None:
        size = _ITEMSIZE[name] = str_to_dtype(name).itemsize
    return size


# --------------------------------------------------------------------------------------------
# WeightChunk: what extractors yield and senders ship
# --------------------------------------------------------------------------------------------


@dataclass
class WeightChunk:
    """A batch of named tensors shipped as one unit (e.g. one module's q/k/v, or one bucket).

    The fields and their order are the interface design's: ``names[i]`` is the engine-side name
    of ``tensors[i]``; ``dtypes`` (``torch.dtype`` s) and ``shapes`` (tuples) describe them;
    ``module_name`` labels the group; ``total_size_bytes`` is the bytes of all tensors;
    ``packed`` tells a sender that the producer laid the tensors out contiguously (a hint;
    senders may ignore it). What is omitted (None) is derived from the tensors; what is given
    must agree with them, else a ``ValueError`` names the parameter. ``borrowed`` (ours): every
    tensor is memory that exists anyway (the model's own parameters, not a gathered or cast
    copy), so a sender may hold several such chunks at once at no memory cost (``cuda_ipc``
    then sends them as one request). ``dtype_names`` / ``shape_lists`` are the plain forms that
    requests carry.
    """

    names: list[str]
    tensors: list[torch.Tensor]
    dtypes: list[torch.dtype] | None = None
    shapes: list[tuple[int, ...]] | None = None
    module_name: str | None = None
    total_size_bytes: int | None = None
    packed: bool = False
    borrowed: bool = False

    def __post_init__(self) -> None:
        if len(self.names) != len(self.tensors):
            raise ValueError(
                f"WeightChunk has {len(self.names)} names but {len(self.tensors)} tensors"
            )
        if len(set(self.names)) != len(self.names):
            dup = sorted({n for n in self.names if self.names.count(n) > 1})
            raise ValueError(f"WeightChunk names repeated: {dup}")
        dtypes = [t.dtype for t in self.tensors]
        shapes = [tuple(t.shape) for t in self.tensors]
        if self.dtypes is None:
            self.dtypes = dtypes
        else:
            self.dtypes = [_as_torch_dtype(d) for d in self.dtypes]
            self._agree("dtypes", self.dtypes, dtypes)
        if self.shapes is None:
            self.shapes = shapes
        else:
            self.shapes = [tuple(s) for s in self.shapes]
            self._agree("shapes", self.shapes, shapes)
        total = sum(t.numel() * t.element_size() for t in self.tensors)
        if self.total_size_bytes is None:
            self.total_size_bytes = total
        elif self.total_size_bytes != total:
            raise ValueError(f"WeightChunk: total_size_bytes={self.total_size_bytes} but the "
                             f"tensors hold {total} bytes")

    def _agree(self, field_name: str, given: list[Any], actual: list[Any]) -> None:
        if len(given) != len(actual):
            raise ValueError(f"WeightChunk: {len(given)} {field_name} for {len(actual)} tensors")
        bad = [f"{n}: {field_name[:-1]} {g} but the tensor has {a}"
               for n, g, a in zip(self.names, given, actual, strict=True) if g != a]
        if bad:
            raise ValueError(f"WeightChunk: {field_name} disagree with the tensors: "
                             f"{'; '.join(bad[:5])}")

    @property
    def dtype_names(self) -> list[str]:
        return [dtype_to_str(d) for d in self.dtypes]  # type: ignore[union-attr]

    @property
    def shape_lists(self) -> list[list[int]]:
        return [list(s) for s in self.shapes]  # type: ignore[union-attr]

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(n, d, s)
                for n, d, s in zip(self.names, self.dtype_names, self.shape_lists, strict=True)]

    def __len__(self) -> int:
        return len(self.names)


def _as_torch_dtype(d: Any) -> Any:
    """A dtype given to ``WeightChunk`` as a ``torch.dtype`` or its name (``"bfloat16"``)."""
    return str_to_dtype(d) if isinstance(d, str) else d


#: the largest tensor a request may describe: more dimensions or elements than any model has
#: are refused while parsing, before a receiver sizes a buffer from them
MAX_NDIM = 8
MAX_NUMEL = 1 << 40


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_shape(name: Any, shape: Any) -> None:
    """A shape is a list of at most ``MAX_NDIM`` ints >= 0 with at most ``MAX_NUMEL`` elements;
    anything else is a ValueError naming the parameter."""
    if not isinstance(shape, (list, tuple)) or not all(is_int(x) and x >= 0 for x in shape):
        raise ValueError(f"parameter {name!r}: shape must be a list of ints >= 0, got "
                         f"{str(shape)[:80]}")
    if len(shape) > MAX_NDIM:
        raise ValueError(f"parameter {name!r}: {len(shape)} dimensions; at most {MAX_NDIM}")
    numel = 1
    for x in shape:
        numel *= x
    if numel > MAX_NUMEL:
        raise ValueError(f"parameter {name!r}: shape {list(shape)} has {numel} elements; at "
                         f"most {MAX_NUMEL}")


@dataclass(frozen=True)
class TensorMeta:
    """Name, dtype string and shape of one tensor: what validation compares."""

    name: str
    dtype: str
    shape: list[int]

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_itemsize(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorMeta:
        if not isinstance(d, dict):
            raise ValueError(f"tensor metadata must be a dict, got {type(d).__name__}")
        missing = [k for k in ("name", "dtype", "shape") if k not in d]
        if missing:
            raise ValueError(f"tensor metadata {d.get('name', '?')!r}: missing fields {missing}")
        name, dtype, shape = d["name"], d["dtype"], d["shape"]
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor metadata: name must be a non-empty string, got {name!r}")
        if not (isinstance(dtype, str) and dtype in _KNOWN_DTYPES):
            try:
                if not isinstance(dtype, str):
                    raise ValueError(f"dtype must be a string such as 'bfloat16', got {dtype!r}")
                str_to_dtype(dtype)
            except ValueError as e:
                raise ValueError(f"parameter {name!r}: {e}") from None
            _KNOWN_DTYPES.add(dtype)
        check_shape(name, shape)
        return cls(name, dtype.removeprefix("torch."), [int(s) for s in shape])


# --------------------------------------------------------------------------------------------
# Serialisable base: a "type" tag picks the dataclass on the receiving side
# --------------------------------------------------------------------------------------------


class _Tagged:
    """Mixin: ``to_dict`` adds ``"type"``; ``from_dict`` on the base class dispatches on it."""

    TYPE: ClassVar[str] = ""
    _subclasses: ClassVar[dict[str, type]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not hasattr(cls, "_subclasses"):
            cls._subclasses = {}
        if cls.TYPE:
            cls._subclasses[cls.TYPE] = cls

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.TYPE}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            out[f.name] = _to_jsonable(getattr(self, f.name))
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Any:
        if not isinstance(d, dict):
            raise ValueError(f"{cls.__name__}.from_dict expects a dict, got {type(d).__name__}")
        kind = d.get("type", cls.TYPE)
        if kind is not None and not isinstance(kind, str):
            raise ValueError(f"{cls.__name__}: type must be a string, got {str(kind)[:40]}")
        target = cls._subclasses.get(kind) if kind else cls
        if target is None:
            raise ValueError(
                f"unknown {cls.__name__} type {kind!r}; known: {sorted(cls._subclasses)}"
            )
        if cls.TYPE and target is not cls and not issubclass(target, cls):
            raise ValueError(f"expected a {cls.TYPE!r} request, got {kind!r}")
        names = {f.name for f in dataclasses.fields(target)}
        unknown = sorted(set(d) - names - {"type"})
        if unknown:
            raise ValueError(f"{target.__name__}: unknown fields {unknown}")
        kwargs = {k: v for k, v in d.items() if k in names}
        try:
            obj = target(**kwargs)
        except TypeError as e:  # missing required field
            raise ValueError(f"{target.__name__}: {e}") from None
        obj._coerce()
        return obj

    def _coerce(self) -> None:
        """Normalise and check field types after from_dict (subclasses extend)."""


_PLAIN = (str, int, float, bool, type(None))


def _to_jsonable(v: Any) -> Any:
    kind = type(v)  # (hot: the exact plain types and lists first, e.g. a request's shapes)
    if kind in _PLAIN_TYPES:
        return v
    if kind is list and all(type(x) in _PLAIN_TYPES for x in v):
        return list(v)
    if kind is TensorMeta:  # a manifest's entries
        return {"name": v.name, "dtype": v.dtype, "shape": list(v.shape)}
    if isinstance(v, _PLAIN):
        return v
    if isinstance(v, enum.Enum):
        return v.value
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return v.to_dict() if hasattr(v, "to_dict") else dataclasses.asdict(v)
    if isinstance(v, (list, tuple)):
        # lists of plain values (names, dtypes, a shape) are copied as they are: requests of a
        # few hundred tensors are serialised at every sync
        if all(type(x) in _PLAIN_TYPES for x in v):
            return list(v)
        return [_to_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _to_jsonable(x) for k, x in v.items()}
    return v


_PLAIN_TYPES = frozenset(_PLAIN)


# --------------------------------------------------------------------------------------------
# Weight update requests (control plane, one per chunk)
# --------------------------------------------------------------------------------------------


_KNOWN_DTYPES: set[str] = set()  # dtype strings str_to_dtype accepted (checked once each)
#: per request class, the last names / dtypes / shapes whose entries were checked: an engine
#: gets the same lists at every step of a training run (compared whole in C, ~30 us for 290
#: tensors, instead of checking each entry again)
_CHECKED: dict[type, tuple[list, list, list]] = {}


def _metadata_checked_before(request: Any) -> bool:
    """``request``'s names, dtypes and shapes equal the last ones checked for its class (they
    are then the already checked lists)."""
    last = _CHECKED.get(type(request))
    if last is None or (request.names, request.dtypes, request.shapes) != last:
        return False
    request.names, request.dtypes, request.shapes = last
    return True


@dataclass(kw_only=True)
class WeightUpdateRequest(_Tagged):
    """Metadata of one chunk; the bytes travel on the strategy's data plane.

    ``update_id`` names the whole update (all chunks of one sync); ``chunk_index`` counts from 0
    and ``is_last`` marks the chunk after which the engine may publish ``version``.
    """

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    update_id: str = ""
    chunk_index: int = 0
    is_last: bool = True
    version: int | None = None
    # one 64-bit checksum per tensor (``weightsync.integrity``), parallel to ``names``, when the
    # sender was asked for them (``checksum: true``); every engine verifies what it received
    checksums: list[int] | None = None
    #: set by the engine's endpoint (never sent): the metadata was checked already (it is the
    #: update's manifest, validated at start), so the receiver need not check it again
    validated: ClassVar[bool] = False

    def _coerce(self) -> None:
        for f in ("names", "dtypes", "shapes"):
            if not isinstance(getattr(self, f), (list, tuple)):
                raise ValueError(f"{type(self).__name__}: {f} must be a list, got "
                                 f"{type(getattr(self, f)).__name__}")
        if not isinstance(self.update_id, str):
            raise ValueError(f"{type(self).__name__}: update_id must be a string")
        if not is_int(self.chunk_index) or self.chunk_index < 0:
            raise ValueError(f"{type(self).__name__}: chunk_index must be an int >= 0, got "
                             f"{self.chunk_index!r}")
        if _metadata_checked_before(self):
            self._coerce_checksums()
            return
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError(
                f"{type(self).__name__}: names/dtypes/shapes lengths differ "
                f"({len(self.names)}/{len(self.dtypes)}/{len(self.shapes)})"
            )
        bad = [n for n in self.names if not isinstance(n, str) or not n]
        if bad:
            raise ValueError(f"{type(self).__name__}: parameter names must be non-empty strings")
        for n, d in zip(self.names, self.dtypes, strict=True):
            if isinstance(d, str) and d in _KNOWN_DTYPES:
                continue
            try:
                str_to_dtype(d)
            except ValueError as e:
                raise ValueError(f"parameter {n!r}: {e}") from None
            _KNOWN_DTYPES.add(d)
        shapes = []
        for n, s in zip(self.names, self.shapes, strict=True):
            check_shape(n, s)
            shapes.append(s if type(s) is list else list(s))
        self.shapes = shapes
        if type(self.names) is list and type(self.dtypes) is list:
            _CHECKED[type(self)] = (self.names, self.dtypes, self.shapes)
        self._coerce_checksums()

    def _coerce_checksums(self) -> None:
        if self.checksums is not None:
            if not isinstance(self.checksums, (list, tuple)) or len(self.checksums) != len(
                self.names
            ) or not all(is_int(c) and -(1 << 63) <= c < (1 << 63) for c in self.checksums):
                raise ValueError(
                    f"{type(self).__name__}: checksums must be a list of {len(self.names)} "
                    f"signed 64-bit ints (one per tensor), got {str(self.checksums)[:80]}"
                )
            self.checksums = list(self.checksums)

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(n, d, s) for n, d, s in zip(self.names, self.dtypes, self.shapes, strict=True)]

    @property
    def total_size_bytes(self) -> int:
        return request_nbytes({"dtypes": self.dtypes, "shapes": self.shapes})


def request_nbytes(request: dict[str, Any]) -> int:
    """The bytes a chunk request (plain dict) describes; 0 for anything malformed (the engine
    refuses it with the reason)."""
    try:
        dtypes, shapes = request["dtypes"], request["shapes"]
        if len(dtypes) != len(shapes):
            return 0
        return int(sum(map(operator.mul, map(math.prod, shapes), map(dtype_itemsize, dtypes))))
    except (KeyError, TypeError, ValueError):
        return 0


@dataclass(kw_only=True)
class IpcBufferHandle:
    """A plain-field handle to one shared buffer.

    ``kind="shm"``: a POSIX shared-memory segment named ``name`` of ``nbytes`` (CPU tensors).
    ``kind="cuda"``: a CUDA IPC memory handle; ``handle`` is the base64 of the 64-byte
    ``cudaIpcMemHandle_t`` of the allocation, ``offset`` the byte offset of the buffer inside it,
    ``device_uuid`` the GPU it lives on (the receiver maps it to its own device index).
    """

    kind: str
    nbytes: int
    name: str = ""
    handle: str = ""
    offset: int = 0
    alloc_nbytes: int = 0
    device_uuid: str = ""

    def to_dict(self) -> dict[str, Any]:  # by hand: a request carries hundreds of these
        return {"kind": self.kind, "nbytes": self.nbytes, "name": self.name,
                "handle": self.handle, "offset": self.offset,
                "alloc_nbytes": self.alloc_nbytes, "device_uuid": self.device_uuid}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> IpcBufferHandle:
        if not isinstance(d, dict):
            raise ValueError(f"IPC handle must be a dict, got {type(d).__name__}")
        if not d.keys() <= _HANDLE_FIELDS:
            raise ValueError(f"IPC handle: unknown fields {sorted(set(d) - _HANDLE_FIELDS)}")
        try:
            h = cls(**d)
        except TypeError as e:
            raise ValueError(f"IPC handle: {e}") from None
        if h.kind not in ("shm", "cuda"):
            raise ValueError(f"IPC handle kind must be 'shm' or 'cuda', got {str(h.kind)[:40]!r}")
        for f in ("nbytes", "offset", "alloc_nbytes"):
            v = getattr(h, f)
            if not is_int(v) or not 0 <= v <= MAX_NUMEL * 8:
                raise ValueError(f"IPC handle {f} must be an int >= 0, got {str(v)[:40]!r}")
        for f in ("name", "handle", "device_uuid"):
            if not isinstance(getattr(h, f), str):
                raise ValueError(f"IPC handle {f} must be a string")
        if h.kind == "shm" and not _SHM_NAME.fullmatch(h.name):
            raise ValueError(f"IPC handle name {h.name[:80]!r}: not a weightsync shared-memory "
                             f"segment (ws_... / wsw_...)")
        return h


#: the only shared-memory segments an engine maps: weightsync's transfer buffers and shared
#: weights (``_runtime.shm``), never an arbitrary segment of the machine
_SHM_NAME = re.compile(r"wsw?_[A-Za-z0-9_]{1,200}")

_HANDLE_FIELDS = frozenset(f.name for f in dataclasses.fields(IpcBufferHandle))


def parse_handles(items: list[Any]) -> list[IpcBufferHandle]:
    return [h if isinstance(h, IpcBufferHandle) else IpcBufferHandle.from_dict(h) for h in items]


def parse_replicas(
    replicas: list[Any], primary: list[IpcBufferHandle], kind: str, what: str
) -> list[list[IpcBufferHandle]]:
    """Coerce and check every_rank replicas: each a list parallel to ``primary`` whose buffers
    have the same sizes."""
    out = []
    for r, rep in enumerate(replicas or []):
        hs = parse_handles(list(rep))
        if [h.nbytes for h in hs] != [h.nbytes for h in primary]:
            raise ValueError(
                f"{kind} request: replica {r + 1} has buffers of {[h.nbytes for h in hs]} bytes "
                f"but the {what} have {[h.nbytes for h in primary]}: every rank must send the "
                f"same chunk"
            )
        out.append(hs)
    return out


#: the most ranks a weight-sync group may have, and the longest wait a peer may ask for
MAX_WORLD_SIZE = 4096
MAX_TIMEOUT_S = 24 * 3600.0


def check_timeouts(obj: Any, *names: str) -> None:
    """Each named field is a number in [0, ``MAX_TIMEOUT_S``] (and > 0 unless it is a per-GB
    rate): a peer cannot make another wait for days."""
    for name in names:
        v = getattr(obj, name)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
        if not ok or not (0 <= v <= MAX_TIMEOUT_S) or (v == 0 and not name.endswith("_per_gb")):
            raise ValueError(f"{type(obj).__name__}: {name} must be a number of seconds in "
                             f"(0, {MAX_TIMEOUT_S:g}], got {v!r}")
        setattr(obj, name, float(v))


# --------------------------------------------------------------------------------------------
# Sync info (built once by the controller, handed to both sides)
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class WeightSyncInfo(_Tagged):
    """What both sides need to set up the data plane once, before the first sync."""


@dataclass(kw_only=True)
class EmptyWeightSyncInfo(WeightSyncInfo):
    """For strategies that need no set-up (IPC: every request carries its own handles)."""

    TYPE: ClassVar[str] = "empty"


# --------------------------------------------------------------------------------------------
# Update lifecycle messages (start / finish), sent by the sender around the chunk requests
# --------------------------------------------------------------------------------------------


class TrainingMode(enum.StrEnum):
    """Which parameter names one update may carry (the per-update name policy, checked by the
    engine against the start's manifest and every chunk before any byte moves).

    HEAD_ONLY: only names matching the head patterns (``head_name_patterns``, default
    ``weightsync.naming.DEFAULT_HEAD_NAME_PATTERNS``: ``score.``, ``classifier.``, ``lm_head.``,
    ``v_head.``).
    LORA: merged weights: no unmerged adapter tensor (``lora_A`` / ``lora_B`` / DoRA ...).
    FULL: no unmerged adapter tensor, and a whole update carries backbone weights, not only the
    head. ``weightsync.reward`` calls this enum ``RewardModelTrainingMode``.
    """

    HEAD_ONLY = "head_only"
    LORA = "lora"
    FULL = "full"

    @classmethod
    def parse(cls, value: Any) -> TrainingMode:
        """Accept a member or its value / name (case-insensitive); anything else names the
        choices."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            for m in cls:
                if key in (m.value, m.name.lower()):
                    return m
        raise ValueError(f"training_mode must be one of {[m.value for m in cls]}, got {value!r}")


@dataclass(kw_only=True)
class WeightUpdateStart(_Tagged):
    """Announces an update. ``manifest`` (when known) lists every tensor the update will carry,
    so engines validate names/shapes/dtypes before any byte moves.

    Per-update options: ``training_mode`` (None: no name policy) and ``head_name_patterns``
    (for HEAD_ONLY; None: the defaults). ``extras``: free-form, for third-party loaders.
    ``version`` None or 0: the engine's next version (the reference's "bump").
    ``allow_version_reset``: publish ``version`` even when it is not newer than the served one
    (a trainer that restarted its count; the reference's rule); by default it must increase.
    ``manifest_of``: instead of a manifest, the id of the update whose manifest this one
    repeats (a replayed update, ``strategies/cuda_ipc``); an engine that does not hold that
    manifest refuses the start (``ManifestUnknownError``) and nothing changes.
    """

    TYPE: ClassVar[str] = "start"
    update_id: str
    version: int | None = None
    manifest: list[TensorMeta] | None = None
    training_mode: TrainingMode | None = None
    head_name_patterns: list[str] | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    # receive the whole update into staging buffers, copy into the weights at finish
    # (``weightsync.update_sink``); an engine that does not stage refuses such a start
    staged: bool = False
    # the sender promises a call at least this often; an engine that hears nothing for longer
    # abandons the update (None: the engine's own limit)
    idle_timeout_s: float | None = None
    allow_version_reset: bool = False
    # a delta update (``weightsync.delta``: ``{base_version, targets}``); the manifest then
    # lists its wire tensors. None: a plain update
    delta: dict[str, Any] | None = None
    # a LoRA adapter-only update (``weightsync.lora_adapter``: ``{name, config}``); the manifest
    # then lists the adapter's lora_A / lora_B tensors. None: an update of the model's weights
    lora_adapter: dict[str, Any] | None = None
    manifest_of: str = ""

    def __post_init__(self) -> None:
        if self.training_mode is not None:
            self.training_mode = TrainingMode.parse(self.training_mode)

    def _coerce(self) -> None:
        if not isinstance(self.update_id, str):
            raise ValueError(f"update_id must be a string, got {type(self.update_id).__name__}")
        if self.version is not None and (not is_int(self.version) or self.version < 0):
            raise ValueError(f"version must be an int >= 0 or null, got {self.version!r}")
        for flag in ("staged", "allow_version_reset"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        if self.idle_timeout_s is not None:
            check_timeouts(self, "idle_timeout_s")
        if self.manifest is not None and not isinstance(self.manifest, (list, tuple)):
            raise ValueError(f"manifest must be a list of tensor metadata or null, got "
                             f"{type(self.manifest).__name__}")
        if not isinstance(self.manifest_of, str) or (self.manifest_of and
                                                      self.manifest is not None):
            raise ValueError("manifest_of must be a string (an update id), given only without "
                             "a manifest")
        if self.manifest is not None:
            self.manifest = [
                m if isinstance(m, TensorMeta) else TensorMeta.from_dict(m) for m in self.manifest
            ]
        if self.head_name_patterns is not None:
            if not isinstance(self.head_name_patterns, (list, tuple)) or not all(
                isinstance(p, str) and p for p in self.head_name_patterns
            ):
                raise ValueError(
                    f"head_name_patterns must be a list of non-empty strings, got "
                    f"{self.head_name_patterns!r}"
                )
            self.head_name_patterns = list(self.head_name_patterns)
        if not isinstance(self.extras, dict):
            raise ValueError(f"extras must be an object, got {type(self.extras).__name__}")
        if self.lora_adapter is not None and not isinstance(self.lora_adapter, dict):
            raise ValueError(f"lora_adapter must be an object ({{name, config}}) or null, got "
                             f"{type(self.lora_adapter).__name__}")
        if self.delta is not None and not isinstance(self.delta, dict):
            raise ValueError(f"delta must be an object or null, got {type(self.delta).__name__}")


@dataclass(kw_only=True)
class WeightUpdateFinish(_Tagged):
    """Closes an update; engines publish ``version`` only if every chunk landed."""

    TYPE: ClassVar[str] = "finish"
    update_id: str
    version: int | None = None
    num_chunks: int = 0
    ok: bool = True
    error: str = ""

    def _coerce(self) -> None:
        if not isinstance(self.update_id, str):
            raise ValueError(f"update_id must be a string, got {type(self.update_id).__name__}")
        if self.version is not None and (not is_int(self.version) or self.version < 0):
            raise ValueError(f"version must be an int >= 0 or null, got {self.version!r}")
        if not is_int(self.num_chunks) or self.num_chunks < 0:
            raise ValueError(f"num_chunks must be an int >= 0, got {self.num_chunks!r}")
        if not isinstance(self.ok, bool):
            raise ValueError(f"ok must be true or false, got {self.ok!r}")
        if not isinstance(self.error, str):
            raise ValueError(f"error must be a string, got {type(self.error).__name__}")


# --------------------------------------------------------------------------------------------
# What one update did (returned to the trainer)
# --------------------------------------------------------------------------------------------


@dataclass
class SyncStats:
    """What one update did: returned by ``WeightTransferSender.send_chunks`` and by the front
    door's ``push``. ``versions[i]`` is what engine ``i`` (``engines[i]``, when known) serves
    now."""

    update_id: str
    num_chunks: int = 0
    num_tensors: int = 0
    total_bytes: int = 0
    seconds: float = 0.0
    versions: list[int | None] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)
    #: a push with ``delta``: how it went (``weightsync.delta.tracker``): ``base_version``,
    #: ``full_bytes`` (the bytes of a full update), ``encodings``, ``fallback``, seconds spent
    delta: dict[str, Any] | None = None
    #: a push through the front door (``SyncSession.push`` of a model): where its milliseconds
    #: went: ``prepare`` (the extractor and the manifest), ``sender`` (the sender made or
    #: reused), ``send`` (the sender's ``send_chunks``: the extraction, the transfer and the
    #: engines' load), ``total`` (call to return)
    front_ms: dict[str, float] | None = None

    @property
    def gbps(self) -> float:
        return self.total_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "gbps": self.gbps}
