"""Training-side parameter names -> engine (checkpoint-format) names. The one place that does it.

Callers: every extractor (``hf``, ``hf_head``, ``lora_merge``, ``fsdp``, ``deepspeed``) and the
``RewardModelPublisher``, in the training process, before a name reaches a request. Engines
(vLLM's ``load_weights``, a torch module's state dict) expect the names of an HF checkpoint:
``model.layers.0.self_attn.q_proj.weight``, ``score.weight``. Training wrappers add noise:

==============================  ==================================================  =========
source                          example                                             action
==============================  ==================================================  =========
PEFT model wrapper              ``base_model.model.`` + name                        strip
PEFT LoRA base weight           ``...q_proj.base_layer.weight``                     drop part
PEFT ``modules_to_save``        ``score.modules_to_save.default.weight``            drop part
PEFT copy of the original head  ``score.original_module.weight``                    skip
LoRA / DoRA adapter tensors     ``...lora_A.default.weight``, ``lora_magnitude..``  refuse
FSDP1 / activation checkpoint   ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped..``  drop part
torch.compile                   ``_orig_mod.``                                      drop part
DDP / DeepSpeed engine          leading ``module.``                                 strip
==============================  ==================================================  =========

Tied weights (``lm_head.weight`` sharing storage with ``model.embed_tokens.weight``) are sent
once, under the embedding name: that is what an HF checkpoint with ``tie_word_embeddings`` holds
and what vLLM loads (it ignores ``lm_head.weight`` for tied models).

Pure string functions, plus two helpers over ``(name, tensor)`` streams; no heavy imports.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: Path components that wrappers insert anywhere in a name; dropped wherever they appear.
WRAPPER_COMPONENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
#: Components that wrappers insert only at the front (DDP, DeepSpeed engine, accelerate).
LEADING_WRAPPERS = ("module",)
#: The PEFT model prefix (``PeftModel.base_model`` is the tuner, its ``.model`` the HF model).
PEFT_PREFIX = "base_model.model."

_LORA_RE = re.compile(
    r"(?:^|\.)(?:lora_[AB]|lora_embedding_[AB]|lora_magnitude_vector|hada_w\d_[ab]|"
    r"lokr_w\d(?:_[ab])?|oft_r|ia3_l)(?:\.|$)"
)

#: Names that are the output projection of a model whose input embedding it may be tied to.
_TIED_OUTPUT_NAMES = ("lm_head.weight", "embed_out.weight", "output.weight")


class NamingError(ValueError):
    """A name cannot be turned into an engine name (e.g. an unmerged LoRA tensor)."""


def is_lora_param(name: str) -> bool:
    """True for adapter tensors that an engine cannot load (``lora_A``/``lora_B``, DoRA
    magnitudes, LoHa/LoKr/OFT/IA3 factors). Merge them first (``lora_merge`` extractor)."""
    return _LORA_RE.search(name) is not None


#: Names of reward-head parameters (substring match; ``re:...`` for a regular expression): what a
#: ``head_only`` update may carry when it names no patterns of its own.
DEFAULT_HEAD_NAME_PATTERNS: tuple[str, ...] = ("score.", "classifier.", "lm_head.", "v_head.")


def compile_patterns(patterns: Iterable[str]) -> list[re.Pattern[str]]:
    """Name patterns: a plain string matches as a substring; ``re:...`` is a regular expression."""
    return [re.compile(p[3:]) if p.startswith("re:") else re.compile(re.escape(p)) for p in patterns]


def is_head_param(name: str, patterns: Iterable[str] | None = None) -> bool:
    """True when ``name`` matches one of the head patterns (default: score./classifier./lm_head./v_head.)."""
    compiled = compile_patterns(DEFAULT_HEAD_NAME_PATTERNS if patterns is None else patterns)
    return any(p.search(name) for p in compiled)


def non_head_params(names: Iterable[str], patterns: Iterable[str] | None = None) -> list[str]:
    """The names that are not head parameters (what a HEAD_ONLY update must not carry)."""
    compiled = compile_patterns(DEFAULT_HEAD_NAME_PATTERNS if patterns is None else patterns)
    return [n for n in names if not any(p.search(n) for p in compiled)]


def is_peft_original_copy(name: str) -> bool:
    """True for PEFT's frozen copy of a ``modules_to_save`` module (never sent: the trained copy
    under ``modules_to_save.<adapter>`` is)."""
    return ".original_module." in f".{name}"


def strip_wrappers(name: str) -> str:
    """Drop FSDP / checkpoint / compile components anywhere and leading DDP ``module.``."""
    parts = [p for p in name.split(".") if p not in WRAPPER_COMPONENTS]
    while len(parts) > 1 and parts[0] in LEADING_WRAPPERS:
        parts.pop(0)
    return ".".join(parts)


def to_engine_name(name: str, *, adapter_name: str = "default") -> str | None:
    """Engine name of a training parameter, or None when it must not be sent at all.

    Raises ``NamingError`` for unmerged adapter tensors (they have no engine name).
    ``adapter_name`` is the PEFT adapter whose ``modules_to_save`` copy is the trained one.
    A pure function of its arguments, cached (extractors call it for every tensor of every
    sync).
    """
    return _engine_name(name, adapter_name)


@functools.lru_cache(maxsize=1 << 16)
def _engine_name(name: str, adapter_name: str) -> str | None:
    name = strip_wrappers(name)
    if is_lora_param(name):
        raise NamingError(
            f"{name!r} is an unmerged adapter tensor; engines load merged weights only: use the "
            f"'lora_merge' extractor (or peft's merge) before syncing"
        )
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX):]
    if is_peft_original_copy(name):
        return None
    parts = name.split(".")
    out: list[str] = []
    i = 0
    while i < len(parts):
        p = parts[i]
        if p == "base_layer":
            i += 1
            continue
        if p == "modules_to_save" and i + 1 < len(parts):
            if parts[i + 1] != adapter_name:
                return None  # another adapter's copy: not the trained head of this adapter
            i += 2
            continue
        out.append(p)
        i += 1
    return ".".join(out)


def engine_names(names: Iterable[str], *, adapter_name: str = "default") -> dict[str, str]:
    """Map many source names at once -> ``{source: engine}`` (skipped names left out).

    Raises ``NamingError`` listing every unmerged adapter tensor, and every engine name that two
    sources would both produce (e.g. a ``base_layer`` weight next to a plain one).
    """
    mapping: dict[str, str] = {}
    lora: list[str] = []
    seen: dict[str, str] = {}
    clashes: list[str] = []
    for src in names:
        try:
            dst = to_engine_name(src, adapter_name=adapter_name)
        except NamingError:
            lora.append(src)
            continue
        if dst is None:
            continue
        if dst in seen:
            clashes.append(f"{seen[dst]!r} and {src!r} both map to {dst!r}")
            continue
        seen[dst] = src
        mapping[src] = dst
    problems = []
    if lora:
        shown = ", ".join(lora[:8]) + (f" ... ({len(lora)} in all)" if len(lora) > 8 else "")
        problems.append(
            f"unmerged LoRA/adapter tensors cannot be synced (merge them first, e.g. with the "
            f"'lora_merge' extractor): {shown}"
        )
    if clashes:
        problems.append("name clashes after normalisation: " + "; ".join(clashes[:8]))
    if problems:
        raise NamingError("; ".join(problems))
    return mapping


# --------------------------------------------------------------------------------------------
# Tied weights
# --------------------------------------------------------------------------------------------


def alias_key(t: Any) -> Any:
    """Identity of a tensor's memory, equal for two names of one tied weight.

    Sharded (DTensor) and meta tensors are keyed by the Python object (tied parameters are one
    ``nn.Parameter``); ordinary tensors by storage pointer, offset, shape, stride and dtype.
    """
    if type(t).__name__ == "DTensor" or getattr(t, "device", None) is None or t.device.type == "meta":
        return ("obj", id(t))
    if hasattr(t, "ds_id"):  # DeepSpeed ZeRO-3 parameter: local data is a placeholder
        return ("ds", t.ds_id)
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return ("obj", id(t))
    if ptr == 0:
        return ("obj", id(t))
    return ("mem", ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def preferred_tied_name(names: list[str]) -> str:
    """Of several names of one tied weight, the one an engine expects: the input embedding
    rather than ``lm_head.weight``; otherwise the first."""
    for n in names:
        if not n.endswith(_TIED_OUTPUT_NAMES):
            return n
    return names[0]


def tied_aliases(named: Iterable[tuple[str, Any]]) -> dict[str, str]:
    """``{alias: kept_name}`` for every name that shares memory with another one.

    ``named`` is e.g. ``model.named_parameters(remove_duplicate=False)`` (or a state dict's
    items). The kept name of each group is ``preferred_tied_name``.
    """
    groups: dict[Any, list[str]] = {}
    for n, t in named:
        groups.setdefault(alias_key(t), []).append(n)
    out: dict[str, str] = {}
    for names in groups.values():
        if len(names) > 1:
            keep = preferred_tied_name(names)
            out.update({n: keep for n in names if n != keep})
    return out


def engine_named_tensors(
    named: Iterable[tuple[str, torch.Tensor]], *, adapter_name: str = "default"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(engine_name, tensor)`` from ``(source_name, tensor)``: normalise names, skip
    PEFT original copies, send each tied weight once under its preferred name, refuse unmerged
    adapter tensors and name clashes (``NamingError``).

    Lazy: a tensor is yielded when its turn comes, so a gathering extractor stays bounded. A tied
    pair is resolved by ``alias_key``; when the output alias comes first (unusual) it is still
    sent under the embedding's name.
    """
    items = list(named) if not isinstance(named, list) else named
    aliases = tied_aliases(items)
    mapping = engine_names((n for n, _ in items), adapter_name=adapter_name)
    emitted: set[str] = set()
    for src, t in items:
        keep = aliases.get(src, src)
        if keep != src and keep in mapping:
            src_out = mapping[keep]
        elif src in mapping:
            src_out = mapping[src]
        else:
            continue
        if src_out in emitted:
            continue
        emitted.add(src_out)
        yield src_out, t
