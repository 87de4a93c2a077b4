"""``torch_module`` loader: copies received tensors into a plain ``torch.nn.Module``.

Runs in the engine process that owns the module (a ``weightsync.local`` engine, a Ray actor, a
test). ``expected_metadata()`` comes from the module's state dict (parameters and persistent
buffers), so ``validate`` rejects unknown names, wrong shapes and wrong dtypes, all listed,
before any byte moves. Loading is a copy into the existing tensors under ``torch.no_grad``
(``weightsync._runtime.copy.copy_many``: small tensors batched per dtype, large ones split across a few
copy threads):
the module keeps its storage (optimisers, CUDA graphs and views stay valid) and the received
tensors, often views of transfer buffers, are not kept.

Tied weights: names that share one storage (``lm_head.weight`` and ``embed_tokens.weight``)
are aliases. Either name is accepted; an update that carries both copies the data twice into the
same storage, which is harmless when the sender sends the same values (extractors send a tied
weight once).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from weightsync.config import LoaderConfig
from weightsync.interfaces import WeightLoader
from weightsync.types import TensorMeta, dtype_to_str

if TYPE_CHECKING:  # pragma: no cover
    import torch


class TorchModuleWeightLoader(WeightLoader):
    """Load named tensors into ``module`` in place.

    ``strict_dtype`` (default True) makes a dtype difference an error; with False the loader
    casts on copy (``copy_`` converts), for engines that keep e.g. fp32 masters of bf16 updates.
    """

    config_cls = LoaderConfig

    def __init__(
        self, cfg: Any = None, *, module: torch.nn.Module, strict_dtype: bool = True
    ) -> None:
        import torch

        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"TorchModuleWeightLoader needs module=<torch.nn.Module>, got {type(module).__name__}"
            )
        self.cfg = cfg if cfg is not None else LoaderConfig()
        self.module = module
        self.strict_dtype = strict_dtype
        # keep_vars: the Parameter objects themselves, so copy_ lands in the live storage
        self._targets: dict[str, torch.Tensor] = dict(module.state_dict(keep_vars=True))
        self._meta = {
            name: TensorMeta(name, dtype_to_str(t.dtype), list(t.shape))
            for name, t in self._targets.items()
        }
        self.aliases = _tied_groups(self._targets)
        self._tied = {n for group in self.aliases for n in group}
        self.loads = 0  # number of load_weights calls that copied something

    def expected_metadata(self) -> Mapping[str, TensorMeta]:
        return self._meta

    def validate(self, metas) -> None:  # type: ignore[override]
        from weightsync.validation import check_metadata

        check_metadata(
            metas, self._meta, check_dtype=self.strict_dtype,
            target=f"module {type(self.module).__name__}",
        )

    def direct_target(self, meta: TensorMeta) -> torch.Tensor | None:
        """The module's own tensor for ``meta.name`` when it is contiguous, of ``meta``'s dtype
        and shape, and not tied to another name (its bytes are then written in place)."""
        t = self._targets.get(meta.name)
        if (t is None or meta.name in self._tied or list(t.shape) != list(meta.shape)
                or _dtype_str(t.dtype) != meta.dtype or not t.is_contiguous()):
            return None
        return t.detach()

    def loaded_in_place(self, names: Sequence[str]) -> None:
        self.loads += 1

    async def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        self.load_weights_sync(named_tensors)

    def load_weights_sync(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Validate then copy; nothing is copied if any tensor is rejected."""
        import torch

        from weightsync._runtime.copy import copy_many

        if not self._matches(named_tensors):  # the full check names every offender
            self.validate(
                TensorMeta(n, _dtype_str(t.dtype), list(t.shape)) for n, t in named_tensors.items()
            )
        with torch.no_grad():
            copy_many([self._targets[n] for n in named_tensors], list(named_tensors.values()))
            if any(t.is_cuda for t in named_tensors.values()):
                torch.cuda.current_stream().synchronize()
        self.loads += 1

    def _matches(self, named_tensors: Mapping[str, torch.Tensor]) -> bool:
        """Fast path of ``validate``: every name known, same shape (and dtype when strict)."""
        targets = self._targets
        strict = self.strict_dtype
        for name, t in named_tensors.items():
            dst = targets.get(name)
            if dst is None or dst.shape != t.shape or (strict and dst.dtype != t.dtype):
                return False
        return True

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: t.detach() for n, t in self._targets.items()}


_DTYPE_STR: dict = {}


def _dtype_str(dtype: torch.dtype) -> str:
    s = _DTYPE_STR.get(dtype)
    if s is None:
        s = _DTYPE_STR[dtype] = dtype_to_str(dtype)
    return s


def _tied_groups(targets: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Groups of names whose tensors share storage and layout (tied weights)."""
    by_key: dict[tuple, list[str]] = {}
    for name, t in targets.items():
        if t.numel() == 0:
            continue
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        by_key.setdefault(key, []).append(name)
    return [names for names in by_key.values() if len(names) > 1]
