"""vLLM as the receiving engine: the loader (this module) and, in ``vllm_worker.py``, the worker
extension that hosts it.

* ``VLLMWeightLoader`` (registered as loader ``vllm``) runs inside each vLLM worker and loads
  through vLLM's own machinery: ``model.load_weights`` on GPU (QKV fusion, TP slicing), the
  layer-wise reload on CPU and for quantized models (see ``weightsync._runtime.vllm_compat``).
  ``expected_metadata()`` is the served checkpoint (safetensors headers, dtype = served dtype),
  or, for an engine started without one (``load_format="dummy"``), the names and shapes its HF
  config implies; so bad names / shapes / dtypes are refused before any byte moves.
* ``weightsync.loaders.vllm_worker.WeightSyncWorkerExtension`` (pass it as vLLM's
  ``worker_extension_cls``) owns one ``WeightUpdateEndpoint`` with this loader inside and
  answers ``collective_rpc`` calls.

vLLM's own weight-transfer engine (``vllm.distributed.weight_transfer``, 0.26 and 0.32; worker
methods ``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``) is the closest relative. Its backends are NCCL and CUDA IPC only (on
CPU its routes answer 500); it puts the whole model into layer-wise reload at start and
finalizes at finish, so between those calls, and after a sender that dies half-way, the model
holds meta tensors and cannot serve; it checks names/shapes only when ``load_weights`` meets
them (after the bytes moved) and keeps no version. Ours validates the manifest before any byte
moves, keeps the model servable between chunks (each chunk is reloaded whole-layer by
whole-layer), marks a half-applied update torn, and publishes a version only on a complete
update; its transports are our strategies (gloo/NCCL broadcast, CUDA IPC or shared memory).
The loader reuses vLLM's machinery underneath (``load_weights``, ``reload_weights``). Code
written to vLLM's API gets all of this through the ``weightsync`` backend of that API
(``weightsync.loaders.vllm_transfer_engine``, ``weightsync.vllm_backend``), which runs this
loader behind the same endpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightsync._runtime import trace
from weightsync._runtime import vllm_compat as compat
from weightsync.config import LoaderConfig
from weightsync.errors import WeightMismatchError
from weightsync.interfaces import WeightLoader
from weightsync.loaders.vllm_lora_install import AdapterMemory
from weightsync.types import TensorMeta, WeightUpdateFinish, WeightUpdateStart

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger(__name__)

_FLOAT_DTYPES = {"float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2"}
_TIED_ALIASES = {"lm_head.weight": "model.embed_tokens.weight"}
_FP8_DTYPES = {"float8_e4m3fn", "float8_e5m2"}
#: what a quantised checkpoint keeps beside an FP8 ``<module>.weight`` (float32, as stored)
_FP8_COMPANIONS = ("weight_scale", "weight_scale_inv", "input_scale")


def fp8_checkpoint_tensors(ckpt: Mapping[str, tuple[str, Any]]) -> set[str]:
    """The checkpoint tensors that keep their stored dtype instead of the served one: FP8
    weights and their scales (an FP8 checkpoint, ``weightsync.fp8``)."""
    kept = set()
    for name, (dtype, _shape) in ckpt.items():
        if dtype in _FP8_DTYPES and name.endswith("weight"):
            kept.add(name)
            stem = name[: -len("weight")]
            kept.update(stem + c for c in _FP8_COMPANIONS if stem + c in ckpt)
    return kept


@dataclass(kw_only=True)
class VLLMLoaderConfig(LoaderConfig):
    """``load_mode``: ``auto`` (reload on CPU / quantized, direct otherwise), ``direct``
    (``model.load_weights``), ``reload`` (layer-wise reload). ``strict_dtype``: refuse tensors
    whose dtype differs from the served dtype (otherwise vLLM casts on copy). ``copy_plan``
    (direct mode): replay the copies ``model.load_weights`` made the first time it loaded a
    name, instead of running it again (``weightsync.loaders.copy_plan``); False runs
    ``model.load_weights`` for every chunk. ``swap_staged`` (direct mode with a copy plan, an
    eager engine): a staged update lands in shadows of the parameters and its finish swaps
    them in by pointer instead of copying (``CopyPlan.stage``); an engine that captured CUDA
    graphs copies from the shadows (the graphs hold the old addresses). ``copy_alone_mb``
    (copy plan): a replayed copy of at least this many MiB runs as its own ``copy_`` (a
    device memcpy) instead of inside the batched ``_foreach_copy_``; 0 batches every copy."""

    type: str = "vllm"
    load_mode: str = "auto"
    strict_dtype: bool = True
    copy_plan: bool = True
    swap_staged: bool = True
    copy_alone_mb: float = 16.0


class VLLMWeightLoader(WeightLoader):
    """Loads checkpoint-format tensors into the model of the vLLM ``worker`` it lives in.

    Reload mode keeps every vLLM layer whole: a chunk that carries only some parts of a layer
    (``q_proj`` of ``qkv_proj``, ``gate_proj`` of ``gate_up_proj``, a weight without its bias) has
    those parts copied and held until the rest arrives in a later chunk of the same update; an
    update whose manifest leaves a touched layer incomplete is refused at start, before any byte
    moves. Direct mode loads every chunk as it comes (copies, never keeps the tensors).
    """

    config_cls = VLLMLoaderConfig
    #: where ``expected_metadata()`` came from: "checkpoint", "config" or "none"
    metadata_source: str = "none"

    def __init__(self, cfg: Any = None, *, worker: Any) -> None:
        self.cfg = cfg if cfg is not None else VLLMLoaderConfig()
        self.worker = worker
        self.mode = compat.resolve_load_mode(worker, self.cfg.load_mode)
        self.model_name = str(getattr(worker.model_config, "served_model_name", None)
                              or worker.model_config.model)
        self._meta = self._build_expected(worker)
        self._packed = compat.packed_modules_mapping(worker)
        self._groups = compat.layer_groups(
            [n for n in (self._meta or {}) if n not in self._aliases], self._packed
        )
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._ties = compat.tied_parameter_groups(worker)  # e.g. lm_head.weight = embed_tokens'
        self.plan = None  # direct mode: the copies load_weights makes, replayed (copy_plan)
        if self.mode == "direct" and self.cfg.copy_plan:
            from weightsync.loaders.copy_plan import CopyPlan

            self.plan = CopyPlan(compat.get_model(worker),
                                 lambda items: compat.load_direct(worker, items),
                                 alone_mb=self.cfg.copy_alone_mb)
        self.loads = 0
        self.adapter_memory = AdapterMemory()  # LoRA adapters between their updates (vllm_lora)

    # -- metadata ----------------------------------------------------------------------------
    def _build_expected(self, worker: Any) -> dict[str, TensorMeta] | None:
        self._aliases: dict[str, str] = {}
        ckpt, self.metadata_source = compat.expected_checkpoint_metadata(worker)
        if ckpt is None:
            log.warning(
                "weightsync: no safetensors checkpoint found for %s and its config names no "
                "transformers class; update metadata cannot be checked before loading",
                self.model_name,
            )
            return None
        if self.metadata_source == "config":
            log.info("weightsync: %s has no checkpoint (dummy weights?); expected names and "
                     "shapes come from its config", self.model_name)
        served = compat.served_dtype(worker)
        kept = fp8_checkpoint_tensors(ckpt)
        meta = {
            n: TensorMeta(n, served if dt in _FLOAT_DTYPES and n not in kept else dt, shape)
            for n, (dt, shape) in ckpt.items()
        }
        hf_cfg = getattr(worker.model_config, "hf_config", None)
        if getattr(hf_cfg, "tie_word_embeddings", False):
            for alias, target in _TIED_ALIASES.items():
                if alias not in meta and target in meta:
                    meta[alias] = TensorMeta(alias, meta[target].dtype, meta[target].shape)
                    self._aliases[alias] = target
        return meta

    def expected_metadata(self) -> Mapping[str, TensorMeta] | None:
        return self._meta

    def validate(self, metas) -> None:  # type: ignore[override]
        """Names, shapes and (with ``strict_dtype``) dtypes against the served checkpoint; every
        offender listed. The endpoint adds the update's training-mode policy."""
        from collections import Counter

        from weightsync.validation import find_mismatches

        metas = list(metas)
        counts = Counter(m.name for m in metas)
        offenders = [f"{n}: sent more than once in one update"
                     for n in sorted(n for n, c in counts.items() if c > 1)]
        if self._meta is not None:
            offenders += find_mismatches(metas, self._meta, check_dtype=self.cfg.strict_dtype)
        if offenders:
            raise WeightMismatchError(offenders, target=f"vLLM model {self.model_name}")

    # -- update lifecycle ----------------------------------------------------------------------
    async def start_update(self, start: WeightUpdateStart) -> None:
        """The endpoint validated the manifest already; reload mode also refuses an update that
        would leave a touched layer incomplete."""
        self._pending.clear()
        if self.plan is not None:
            # relearns if vLLM replaced a parameter since; checked at the plan's first use in
            # this update (a streamed receiver's falls while its vote is out)
            self.plan.defer_check()
        if start.manifest is None:
            return
        if self.mode == "reload":
            offenders = self.incomplete_layers([m.name for m in start.manifest])
            if offenders:
                raise WeightMismatchError(offenders, target=f"vLLM model {self.model_name}")

    def incomplete_layers(self, names: Sequence[str]) -> list[str]:
        """One line per vLLM layer that ``names`` touch but do not cover (reload mode)."""
        given = {self._aliases.get(n, n) for n in names}
        out = []
        for layer, members in self._groups.items():
            have = members & given
            if have and have != members:
                out.append(
                    f"{layer}: the update carries {sorted(have)} but not {sorted(members - have)}; "
                    f"this engine loads a layer whole ({self.mode} mode), send all of its parts "
                    f"in one update"
                )
        return out

    def direct_target(self, meta: TensorMeta) -> torch.Tensor | None:
        """Direct mode with a copy plan that learned ``meta.name``: the parameter view its bytes
        are copied into whole, if that is all loading it does (``CopyPlan.direct_target``)."""
        if self.plan is None or meta.name in self._aliases:
            return None
        from weightsync.types import str_to_dtype

        return self.plan.direct_target(meta.name, str_to_dtype(meta.dtype), meta.shape)

    def adapter_loader(self, spec: Any) -> WeightLoader:
        """A LoRA adapter-only update into this worker's LoRA runtime
        (``weightsync.loaders.vllm_lora``; refused if the engine was started without LoRA)."""
        from weightsync.loaders.vllm_lora import VLLMLoRAAdapterLoader

        return VLLMLoRAAdapterLoader(self.worker, spec, base_meta=self._meta,
                                     model_name=self.model_name, memory=self.adapter_memory)

    def stage_weights(self, named_tensors: dict[str, torch.Tensor]) -> bool:
        """Direct mode with a copy plan: the chunk into shadows of the parameters it writes
        (``CopyPlan.stage``) when every tensor replays; else False (the endpoint keeps a copy)."""
        if self.plan is None:
            return False
        trace.mark("vllm.stage.begin", tensors=len(named_tensors))
        if not self.plan.stage(self._resolve_aliases(named_tensors)):
            return False
        compat.wait_for_copies(self.worker)
        trace.mark("vllm.stage.end")
        return True

    def commit_staged(self) -> None:
        """The staged update's finish: swap fully written parameters in by pointer (an eager
        engine with ``swap_staged``), copy the rest from their shadows."""
        if self.plan is None:
            return
        trace.mark("vllm.commit.begin")
        swap = bool(self.cfg.swap_staged) and compat.runs_eagerly(self.worker)
        self.plan.commit_staged(swap=swap)
        compat.wait_for_copies(self.worker)
        trace.mark("vllm.commit.end", swapped=self.plan.swapped)

    def discard_staged(self) -> None:
        if self.plan is not None:
            self.plan.discard_staged()

    def release_staging(self) -> int:
        """Free the shadows staged updates keep between updates and the buffers LoRA adapter
        updates arrive in (before vLLM's sleep frees the weights: neither is vLLM's memory);
        returns the bytes freed. An adapter's next version is then built by vLLM again."""
        freed = self.plan.release_shadows() if self.plan is not None else 0
        return freed + self.adapter_memory.release_inboxes()

    def loaded_in_place(self, names: Sequence[str]) -> None:
        if self.plan is not None:
            self.plan.direct += len(names)

    async def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """Load and wait for the copies: the tensors may be views of transfer buffers the
        sender reuses as soon as this returns."""
        trace.mark("vllm.load.begin", tensors=len(named_tensors), mode=self.mode)
        items = self._resolve_aliases(named_tensors)
        if self.mode == "direct":
            if self.plan is not None:
                self.plan.load(items)
                trace.mark("vllm.load.plan_done")  # the copy plan replayed (or learned)
            else:
                compat.load_direct(self.worker, items)
        else:
            ready = self._collect_whole_layers(items)
            if ready:
                compat.load_reload(self.worker, ready)
                compat.retie(self.worker, self._ties, (n for n, _ in ready))
        compat.wait_for_copies(self.worker)
        trace.mark("vllm.load.end")
        self.loads += 1

    async def finish_update(self, finish: WeightUpdateFinish) -> None:
        if self._pending:
            missing = [
                f"{layer}: only {sorted(parts)} arrived; the rest of the layer never came"
                for layer, parts in self._pending.items()
            ]
            self._pending.clear()
            raise WeightMismatchError(missing, target=f"vLLM model {self.model_name}")
        compat.after_load(self.worker)

    def _resolve_aliases(self, named: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        out = []
        for name, t in named.items():
            target = self._aliases.get(name)
            if target is None:
                out.append((name, t))
            elif target not in named:  # a tied weight sent under its other name
                out.append((target, t))
        return out

    def _collect_whole_layers(
        self, items: list[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor]]:
        by_layer: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for name, t in items:
            by_layer.setdefault(compat.fused_layer_key(name, self._packed), []).append((name, t))
        ready: list[tuple[str, torch.Tensor]] = []
        for layer, parts in by_layer.items():
            held = self._pending.get(layer, {})
            members = self._groups.get(layer)
            have = set(held) | {n for n, _ in parts}
            if members is None or have >= members:
                ready.extend(held.items())
                ready.extend(parts)
                self._pending.pop(layer, None)
            else:  # keep a copy: the received tensors may be views of reused transfer buffers
                held.update({n: t.detach().clone() for n, t in parts})
                self._pending[layer] = held
        return ready
