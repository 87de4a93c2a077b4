"""FP8 targets: a trainer's weights quantised on the sender for a vLLM engine that serves an FP8
checkpoint.

A vLLM engine started from an FP8 checkpoint (``quantization_config.quant_method: fp8``, the
format of DeepSeek-V3, Qwen3-FP8 and llm-compressor's FP8 models) holds each quantised linear
weight as ``float8_e4m3fn`` with a float32 scale beside it, and dequantised ``w = q * scale``:

* block-scaled (``weight_block_size: [bn, bk]``): ``<module>.weight_scale_inv``, one scale per
  ``bn x bk`` block, shape ``[ceil(N / bn), ceil(K / bk)]``;
* per-tensor: ``<module>.weight_scale``, one value.

A trainer holds bf16 / fp32 weights. ``Fp8Layout`` says which engine names the engine holds in
FP8 and how they are scaled; ``Fp8Layout.quantize`` turns one of the trainer's (name, tensor)
into the engine's (the FP8 tensor and its scale), on the tensor's own device (the trainer's
GPU), so the wire carries one byte per weight instead of two and the engine loads them as it
loads its checkpoint (vLLM's layer-wise reload runs the quantisation method's own
post-processing). Quantisation follows the checkpoints' convention (DeepSeek's, vLLM's
``per_block_cast_to_fp8``): per block, ``scale = max(amax, 1e-4) / 448`` and ``q = fp8(w *
(1 / scale))``; per tensor, ``scale = max(amax, 1e-12) / 448`` and ``q = fp8(clamp(w / scale,
-448, 448))``.

Who uses it: the front door (``ws.connect(..., quantize=LAYOUT_OR_CHECKPOINT_DIR)``: every push
is quantised on the sending rank) and power users (``Fp8Layout.quantize_chunks`` over their own
``WeightChunk`` stream, ``Fp8Layout.manifest`` for its manifest). The engine checks what arrives
as for any update (names, the float8 / float32 dtypes, shapes) before any byte moves, so a bf16
push into an FP8 engine is refused naming the tensors, and the engine keeps serving.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightsync.types import TensorMeta, WeightChunk

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: the FP8 format the engines serve (vLLM's ``fp8`` method supports only this one)
FP8_DTYPE = "float8_e4m3fn"
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
#: the smallest block amax / tensor amax a scale is computed from (an all-zero block)
BLOCK_AMAX_FLOOR = 1e-4
TENSOR_AMAX_FLOOR = 1e-12
BLOCK_SCALE = "weight_scale_inv"
TENSOR_SCALE = "weight_scale"


def quantize_blockwise(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """``w`` ([N, K], floating) -> (``float8_e4m3fn`` [N, K], float32 scales [ceil(N / bn),
    ceil(K / bk)]), on ``w``'s device; edge blocks are padded with zeros for their amax."""
    import torch

    if w.dim() != 2:
        raise ValueError(f"block-scaled FP8 needs a 2-D weight, got shape {tuple(w.shape)}")
    bn, bk = block
    n, k = w.shape
    pn, pk = -(-n // bn) * bn, -(-k // bk) * bk
    # amax in the weight's own dtype (|x| and max are exact in any float format), and the
    # multiply promotes to float32 as it reads: no float32 copy of the weight, the same bytes
    x = w.contiguous()
    if (pn, pk) != (n, k):
        padded = torch.zeros((pn, pk), dtype=w.dtype, device=w.device)
        padded[:n, :k] = x
        x = padded
    blocks = x.view(pn // bn, bn, pk // bk, bk)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).float()
    scale = amax.clamp(min=BLOCK_AMAX_FLOOR) / FP8_MAX
    q = (blocks * (1.0 / scale)).to(torch.float8_e4m3fn).view(pn, pk)
    if (pn, pk) != (n, k):
        q = q[:n, :k].contiguous()
    return q, scale.view(pn // bn, pk // bk)


def block_scale_shape(shape: Any, block: tuple[int, int]) -> list[int]:
    """The scales of a ``shape`` ([N, K]) weight in ``block`` ([bn, bk]) blocks:
    ``[ceil(N / bn), ceil(K / bk)]``."""
    return [-(-int(shape[0]) // block[0]), -(-int(shape[1]) // block[1])]


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` (floating) -> (``float8_e4m3fn`` of its shape, a float32 scale of shape []), on
    ``w``'s device."""
    import torch

    scale = w.abs().amax().float().clamp(min=TENSOR_AMAX_FLOOR) / FP8_MAX  # exact in w's dtype
    q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


@dataclass(frozen=True)
class Fp8Layout:
    """Which engine names an FP8 engine holds in ``float8_e4m3fn`` (``weights``, each a
    ``...weight``), scaled per ``weight_block_size`` blocks (``(bn, bk)``) or, when that is
    None, per tensor with a scale of shape ``scale_shape`` (a checkpoint's: ``[]`` or ``[1]``).
    Build it from the engine's checkpoint directory (``from_checkpoint``) or its metadata
    (``from_metadata``)."""

    weights: frozenset[str]
    weight_block_size: tuple[int, int] | None = None
    scale_shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        bad = sorted(n for n in self.weights if not n.endswith("weight"))
        if bad:
            raise ValueError(f"Fp8Layout.weights: FP8 tensors are weights ('...weight'), got "
                             f"{bad[:5]}")
        if self.weight_block_size is not None:
            block = tuple(int(b) for b in self.weight_block_size)
            if len(block) != 2 or min(block) < 1:
                raise ValueError(f"Fp8Layout.weight_block_size: two positive sizes [bn, bk], "
                                 f"got {list(self.weight_block_size)}")
            object.__setattr__(self, "weight_block_size", block)
        object.__setattr__(self, "weights", frozenset(self.weights))

    # -- building ----------------------------------------------------------------------------
    @classmethod
    def from_metadata(cls, metas: Mapping[str, TensorMeta] | Iterable[TensorMeta],
                      weight_block_size: Any = None) -> Fp8Layout:
        """The layout of an engine whose tensors are ``metas`` (a checkpoint's names, dtypes
        and shapes): every ``float8_e4m3fn`` weight that has its scale beside it. Raises
        ``ValueError`` naming the tensor when a scale's shape does not fit the block size, or
        when nothing is FP8."""
        by_name = dict(metas) if isinstance(metas, Mapping) else {m.name: m for m in metas}
        block = tuple(int(b) for b in weight_block_size) if weight_block_size else None
        suffix = BLOCK_SCALE if block else TENSOR_SCALE
        weights, scale_shapes, offenders = set(), set(), []
        for name, meta in by_name.items():
            if meta.dtype != FP8_DTYPE or not name.endswith("weight"):
                continue
            scale = by_name.get(name[: -len("weight")] + suffix)
            if scale is None:
                offenders.append(f"{name}: FP8 without its {suffix}")
                continue
            if block is not None:
                want = block_scale_shape(meta.shape, block)
                if list(scale.shape) != want:
                    offenders.append(f"{scale.name}: shape {list(scale.shape)}, but a "
                                     f"{list(meta.shape)} weight in {list(block)} blocks has "
                                     f"{want}")
                    continue
            else:
                scale_shapes.add(tuple(scale.shape))
            weights.add(name)
        if offenders:
            raise ValueError("FP8 layout: " + "; ".join(offenders[:10]))
        if not weights:
            raise ValueError("FP8 layout: no float8_e4m3fn weight with its scale among the "
                             f"{len(by_name)} tensors given")
        if len(scale_shapes) > 1:
            raise ValueError(f"FP8 layout: per-tensor scales of several shapes "
                             f"{sorted(scale_shapes)}")
        shape = next(iter(scale_shapes)) if scale_shapes else ()
        return cls(frozenset(weights), block, tuple(int(s) for s in shape))

    @classmethod
    def from_checkpoint(cls, directory: str | os.PathLike) -> Fp8Layout:
        """The layout of the FP8 checkpoint in ``directory`` (the one the engines were started
        from): its ``config.json``'s ``quantization_config`` (``quant_method`` fp8,
        ``weight_block_size``) and its safetensors headers."""
        from weightsync._runtime.vllm_compat import checkpoint_metadata

        path = os.fspath(directory)
        try:
            with open(os.path.join(path, "config.json")) as f:
                config = json.load(f)
        except OSError as e:
            raise FileNotFoundError(f"FP8 layout: no config.json in {path!r} ({e})") from None
        quant = config.get("quantization_config") or {}
        method = str(quant.get("quant_method", ""))
        if "fp8" not in method:
            raise ValueError(f"FP8 layout: {path}/config.json quantization_config.quant_method "
                             f"is {method or 'missing'!r}, not fp8: the engine does not serve "
                             "FP8 weights")
        found = checkpoint_metadata(path)
        if found is None:
            raise FileNotFoundError(f"FP8 layout: no *.safetensors in {path!r}")
        metas = {n: TensorMeta(n, d, s) for n, (d, s) in found.items()}
        return cls.from_metadata(metas, quant.get("weight_block_size"))

    # -- quantising ----------------------------------------------------------------------------
    def scale_name(self, name: str) -> str:
        return name[: -len("weight")] + (BLOCK_SCALE if self.weight_block_size else TENSOR_SCALE)

    def quantize(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """``[(name, tensor)]`` unchanged for a name the engine does not hold in FP8; else
        ``[(name, fp8), (scale name, float32 scale)]``, computed on ``tensor``'s device."""
        if name not in self.weights:
            return [(name, tensor)]
        if not tensor.is_floating_point() or tensor.dtype.itemsize == 1:
            raise ValueError(f"{name}: FP8 quantisation needs a bf16/fp16/fp32 tensor, got "
                             f"{str(tensor.dtype).removeprefix('torch.')}")
        if self.weight_block_size is not None:
            q, scale = quantize_blockwise(tensor.detach(), self.weight_block_size)
        else:
            q, scale = quantize_per_tensor(tensor.detach())
            scale = scale.reshape(self.scale_shape)
        return [(name, q), (self.scale_name(name), scale)]

    def quantize_chunk(self, chunk: WeightChunk) -> WeightChunk:
        """``chunk`` with its FP8 weights quantised (their scales right after them); a chunk
        without any is returned as it is."""
        if not any(n in self.weights for n in chunk.names):
            return chunk
        pairs = [p for n, t in zip(chunk.names, chunk.tensors, strict=True)
                 for p in self.quantize(n, t)]
        return WeightChunk([n for n, _ in pairs], [t for _, t in pairs],
                           module_name=chunk.module_name)

    async def quantize_chunks(self, chunks: AsyncIterable[WeightChunk] | Iterable[WeightChunk]
                              ) -> AsyncIterator[WeightChunk]:
        """``chunks`` (iterable or async iterable) quantised one at a time, as the sender
        asks for them."""
        from weightsync.pipeline import aiter_chunks

        async for chunk in aiter_chunks(chunks):
            yield self.quantize_chunk(chunk)

    def manifest(self, metas: Iterable[TensorMeta]) -> list[TensorMeta]:
        """The manifest of the quantised stream: FP8 weights as ``float8_e4m3fn``, each
        followed by its float32 scale."""
        out: list[TensorMeta] = []
        for m in metas:
            if m.name not in self.weights:
                out.append(m)
                continue
            out.append(TensorMeta(m.name, FP8_DTYPE, list(m.shape)))
            shape = (block_scale_shape(m.shape, self.weight_block_size)
                     if self.weight_block_size is not None else list(self.scale_shape))
            out.append(TensorMeta(self.scale_name(m.name), "float32", shape))
        return out


def resolve_layout(quantize: Any) -> Fp8Layout | None:
    """``connect``'s ``quantize``: None, an ``Fp8Layout``, or the FP8 checkpoint directory the
    engines were started from."""
    if quantize is None or isinstance(quantize, Fp8Layout):
        return quantize
    if isinstance(quantize, (str, os.PathLike)):
        return Fp8Layout.from_checkpoint(quantize)
    raise TypeError(f"quantize: an Fp8Layout or the engines' FP8 checkpoint directory, got "
                    f"{type(quantize).__name__}")
