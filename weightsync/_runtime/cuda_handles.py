"""CUDA IPC handles as plain fields, and our own code to open them (no pickle, no torch
reductions).

Sender side (``encode``): the CUDA IPC memory handle (``cudaIpcMemHandle_t``, 64 bytes) of the
allocation that holds a tensor, base64 in ``IpcBufferHandle.handle``, plus the byte offset of
the tensor inside that allocation, the allocation size and the GPU's UUID. torch's own
``storage._share_cuda_()`` is avoided on purpose: it attaches a ref-counted "sent data" record
whose memory is only released when a torch consumer decrements it, which our receivers (which
rebuild the tensor themselves) never do.

Receiver side (``CudaHandleCache``): maps the sender's GPU UUID to a local device index, opens
each distinct handle once (``cudaIpcOpenMemHandle`` with lazy peer access), wraps the pointer
as a uint8 tensor through ``__cuda_array_interface__`` and caches it; evicted handles are closed.
The sender keeps the memory alive until the engine's ``update_named_weights`` returned, and
the loader copies out of the view before that.

Everything here needs CUDA; the module imports on CPU machines and fails only when used.
"""

from __future__ import annotations

import base64
import ctypes
import ctypes.util
import glob
import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from weightsync.errors import WeightSyncError
from weightsync.types import IpcBufferHandle

if TYPE_CHECKING:  # pragma: no cover
    import torch

_HANDLE_BYTES = 64
_IPC_LAZY_ENABLE_PEER_ACCESS = 1


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _HANDLE_BYTES)]


_libs: dict[str, Any] = {}


def _cudart() -> Any:
    """The CUDA runtime that torch loaded (found by soname, then next to torch)."""
    if "cudart" in _libs:
        return _libs["cudart"]
    import torch

    torch.cuda.init()
    names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"]
    torch_dir = os.path.dirname(torch.__file__)
    names += sorted(glob.glob(os.path.join(torch_dir, "lib", "libcudart*.so*")))
    names += sorted(glob.glob(os.path.join(torch_dir, "..", "nvidia", "cu*", "lib", "libcudart.so*")))
    names += sorted(glob.glob(os.path.join(torch_dir, "..", "nvidia", "cuda_runtime", "lib", "libcudart.so*")))
    found = ctypes.util.find_library("cudart")
    if found:
        names.append(found)
    for n in names:
        try:
            lib = ctypes.CDLL(n)
            lib.cudaIpcGetMemHandle  # noqa: B018 - probe the symbol
        except (OSError, AttributeError):
            continue
        _libs["cudart"] = lib
        return lib
    raise WeightSyncError("CUDA IPC needs libcudart, which was not found next to torch")


def _cuda_driver() -> Any:
    if "cuda" not in _libs:
        try:
            _libs["cuda"] = ctypes.CDLL("libcuda.so.1")
        except OSError as e:  # pragma: no cover - no driver
            raise WeightSyncError(f"CUDA IPC needs the CUDA driver (libcuda.so.1): {e}") from e
    return _libs["cuda"]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        lib = _cudart()
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        msg = lib.cudaGetErrorString(rc).decode(errors="replace")
        raise WeightSyncError(f"{what} failed: CUDA error {rc} ({msg})")


def device_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def local_index_of(uuid: str) -> int:
    """The local CUDA device index of the GPU with ``uuid`` (CUDA_VISIBLE_DEVICES-aware)."""
    import torch

    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise WeightSyncError(
        f"the sender's GPU {uuid} is not visible in this engine process "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); CUDA IPC "
        f"needs both processes on the same node with that GPU visible: use 'broadcast' instead"
    )


def _bind(index: int) -> None:
    """Make device ``index``'s primary context current on this thread (driver calls need it;
    a fresh worker thread has none even when torch's current device is already ``index``)."""
    _check(_cudart().cudaSetDevice(ctypes.c_int(index)), "cudaSetDevice")


def _allocation_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the cudaMalloc allocation that contains device pointer ``ptr``."""
    drv = _cuda_driver()
    base = ctypes.c_uint64()
    size = ctypes.c_size_t()
    fn = getattr(drv, "cuMemGetAddressRange_v2", None) or drv.cuMemGetAddressRange
    rc = fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise WeightSyncError(f"cuMemGetAddressRange failed for pointer {ptr:#x}: CUDA error {rc}")
    return int(base.value), int(size.value)


def encode(t: torch.Tensor) -> IpcBufferHandle:
    """Handle of CUDA tensor ``t`` (contiguous); ``t`` must stay alive while it is used."""
    import torch

    if not t.is_cuda:
        raise ValueError("encode() needs a CUDA tensor")
    if not t.is_contiguous():
        raise ValueError("CUDA IPC shares contiguous tensors only; call .contiguous() first")
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    nbytes = t.numel() * t.element_size()
    with torch.cuda.device(index):
        _bind(index)
        ptr = t.data_ptr()
        base, alloc = _allocation_range(ptr)
        handle = _handle_of(base)
    return IpcBufferHandle(
        kind="cuda", nbytes=nbytes, handle=handle, offset=ptr - base, alloc_nbytes=alloc,
        device_uuid=device_uuid(index),
    )


# cuPointerGetAttribute: CU_POINTER_ATTRIBUTE_BUFFER_ID, a process-wide unique id of the
# allocation that holds a pointer (never reused, unlike addresses)
_CU_POINTER_ATTRIBUTE_BUFFER_ID = 7
_MAX_CACHED = 8192
# buffer id -> (allocation base, allocation size, base64 handle): an allocation's IPC handle is
# made once, not at every sync (cudaIpcGetMemHandle per tensor is most of encoding a request)
_by_buffer: OrderedDict[int, tuple[int, int, str]] = OrderedDict()
_uuids: dict[int, str] = {}


def _buffer_id(ptr: int) -> int | None:
    value = ctypes.c_ulonglong()
    rc = _cuda_driver().cuPointerGetAttribute(
        ctypes.byref(value), ctypes.c_int(_CU_POINTER_ATTRIBUTE_BUFFER_ID), ctypes.c_uint64(ptr))
    return int(value.value) if rc == 0 and value.value else None


def _handle_of(base: int) -> str:
    h = _IpcHandle()
    rc = _cudart().cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(base))
    if rc != 0:
        hint = (
            " (memory from expandable segments / cuMemCreate cannot be shared with CUDA IPC: "
            "unset PYTORCH_CUDA_ALLOC_CONF=expandable_segments or use packed_cuda_ipc)"
        )
        _check(rc, "cudaIpcGetMemHandle" + hint)
    return base64.b64encode(ctypes.string_at(ctypes.addressof(h), _HANDLE_BYTES)).decode()


def encode_many(tensors: list[torch.Tensor]) -> list[IpcBufferHandle]:
    """``encode`` for each (contiguous CUDA) tensor, with the per-tensor work kept small: the
    device is bound once per run of tensors on one GPU, and an allocation's handle is made once
    per allocation (cached by the driver's buffer id) and reused at later syncs."""
    import torch

    out: list[IpcBufferHandle] = []
    current = -1
    uuid = ""
    for t in tensors:
        if not t.is_cuda:
            raise ValueError("encode_many() needs CUDA tensors")
        if not t.is_contiguous():
            raise ValueError("CUDA IPC shares contiguous tensors only; call .contiguous() first")
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        if index != current:
            _bind(index)
            current = index
            uuid = _uuids.get(index) or _uuids.setdefault(index, device_uuid(index))
        ptr = t.data_ptr()
        key = _buffer_id(ptr)
        hit = _by_buffer.get(key) if key is not None else None
        if hit is None or not hit[0] <= ptr < hit[0] + hit[1]:
            base, alloc = _allocation_range(ptr)
            hit = (base, alloc, _handle_of(base))
            if key is not None:
                _by_buffer[key] = hit
                while len(_by_buffer) > _MAX_CACHED:
                    _by_buffer.popitem(last=False)
        else:
            _by_buffer.move_to_end(key)  # type: ignore[arg-type]
        base, alloc, handle = hit
        out.append(IpcBufferHandle(
            kind="cuda", nbytes=t.numel() * t.element_size(), handle=handle, offset=ptr - base,
            alloc_nbytes=alloc, device_uuid=uuid,
        ))
    return out


class _DevicePointer:
    """Minimal ``__cuda_array_interface__`` exporter so torch can wrap a raw pointer."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None,
        }


class CudaHandleCache:
    """Receiver side: opened allocations by handle, LRU-bounded by count."""

    def __init__(self, max_handles: int = 1024) -> None:
        self.max_handles = max_handles
        self._open: OrderedDict[str, tuple[int, int, torch.Tensor]] = OrderedDict()
        self.opened = 0
        self.closed = 0  # handles closed so far (views made before may be dangling)

    def view(self, h: IpcBufferHandle) -> torch.Tensor:
        """uint8 tensor over the ``h.nbytes`` bytes at ``h.offset`` of the shared allocation."""
        import torch

        if h.kind != "cuda":
            raise ValueError(f"not a CUDA handle: kind={h.kind!r}")
        hit = self._open.get(h.handle)
        if hit is None:
            index = local_index_of(h.device_uuid)
            raw = base64.b64decode(h.handle)
            if len(raw) != _HANDLE_BYTES:
                raise ValueError(f"CUDA IPC handle must be {_HANDLE_BYTES} bytes, got {len(raw)}")
            ih = _IpcHandle()
            ctypes.memmove(ctypes.addressof(ih), raw, _HANDLE_BYTES)
            ptr = ctypes.c_void_p()
            with torch.cuda.device(index):
                _bind(index)
                _check(
                    _cudart().cudaIpcOpenMemHandle(
                        ctypes.byref(ptr), ih, ctypes.c_uint(_IPC_LAZY_ENABLE_PEER_ACCESS)
                    ),
                    "cudaIpcOpenMemHandle",
                )
                size = h.alloc_nbytes or (h.offset + h.nbytes)
                whole = torch.as_tensor(_DevicePointer(int(ptr.value), size), device=f"cuda:{index}")
            hit = (index, int(ptr.value), whole)
            self._open[h.handle] = hit
            self.opened += 1
            while len(self._open) > self.max_handles:
                self._close(next(iter(self._open)))
        else:
            self._open.move_to_end(h.handle)
        whole = hit[2]
        if h.offset + h.nbytes > whole.numel():
            raise WeightSyncError(
                f"CUDA IPC handle: bytes [{h.offset}, {h.offset + h.nbytes}) fall outside the "
                f"shared allocation of {whole.numel()} bytes"
            )
        return whole[h.offset : h.offset + h.nbytes]

    def _close(self, key: str) -> None:
        import torch

        self.closed += 1
        index, ptr, whole = self._open.pop(key)
        del whole
        with torch.cuda.device(index):
            _bind(index)
            torch.cuda.current_stream().synchronize()
            _cudart().cudaIpcCloseMemHandle(ctypes.c_void_p(ptr))

    def __len__(self) -> int:
        return len(self._open)

    def close(self) -> None:
        for key in list(self._open):
            self._close(key)
