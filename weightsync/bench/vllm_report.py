"""Output of ``weightsync.bench.vllm_sync``: the one table (rows, references, stage split) and
an optional PNG (``plot`` returns False when matplotlib is missing, so CPU runs need none).
Pure functions over the result dict ``{meta, references, rows, stages}``."""

from __future__ import annotations

from typing import Any

MB = 1e6


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None or v != v else format(v, spec)


def format_table(result: dict[str, Any]) -> str:
    refs = result["references"]
    lines = [
        f"{'row':18} {'engine':7} {'ms':>9} {'GB/s':>7} {'x ref':>6} {'x native':>8} "
        f"{'exact':>5} {'send MB':>8} {'eng MB':>8} {'chunks':>6}  note",
    ]
    for name, ref in refs.items():
        lines.append(f"{name:18} {'-':7} {_fmt((ref.get('seconds') or 0) * 1e3, '9.2f'):>9} "
                     f"{_fmt(ref.get('gbps'), '7.1f'):>7} {'1.00':>6} {'-':>8} {'-':>5} "
                     f"{'-':>8} {'-':>8} {'-':>6}  reference: {ref.get('note', ref.get('error'))}")
    for r in result["rows"]:
        secs = r.get("seconds")
        note = r.get("error") or r.get("note") or ""
        lp = r.get("logprobs")
        if lp:
            note = (note + f" logprobs max err {lp['max_abs_err']:.1e}").strip()
        if (r.get("check") or {}).get("num_unreadable"):
            note = (note + f" ({r['check']['num_unreadable']} params unreadable on this "
                    f"device)").strip()
        mark = "yes" if r.get("verified") else ("ERR" if r.get("error") else "NO")
        lines.append(
            f"{r['row']:18} {r.get('engine_device', '-'):7} "
            f"{_fmt(secs * 1e3 if secs else None, '9.2f'):>9} {_fmt(r.get('gbps'), '7.1f'):>7} "
            f"{_fmt(r.get('x_reference'), '6.2f'):>6} {_fmt(r.get('x_native'), '8.2f'):>8} "
            f"{mark:>5} {_fmt(_mb(r.get('sender_extra_bytes')), '8.0f'):>8} "
            f"{_fmt(_mb(r.get('engine_extra_bytes')), '8.0f'):>8} "
            f"{_fmt(r.get('num_chunks'), 'd'):>6}  {note[:160]}"
        )
    stages = result.get("stages") or {}
    if stages:
        keys = ["total_s", "extract_s", "pack_s", "send_data_s", "start_rpc_s", "chunk_rpc_s",
                "finish_rpc_s", "apply_rpc_s", "engine_start_s", "engine_receive_s",
                "engine_load_s", "engine_finish_s", "control_overhead_s", "noop_rpc_s",
                "prefix_reset_s"]
        lines += ["", "stage split of one profiled sync (ms; sums over chunks; every stage "
                      "synchronised):",
                  f"{'row':18} " + " ".join(f"{k.removesuffix('_s')[:10]:>10}" for k in keys)]
        for row, st in stages.items():
            lines.append(f"{row:18} " + " ".join(
                f"{_fmt(st[k] * 1e3 if k in st else None, '10.2f'):>10}" for k in keys))
    fronts = [r for r in result["rows"] if r.get("front_ms")]
    if fronts:
        lines += ["", "the front door's split of the timed pushes (ms, median; SyncStats.front_ms):"]
        for r in fronts:
            lines.append(f"{r['row']:18} " + ", ".join(
                f"{k} {v:.2f}" for k, v in r["front_ms"].items()))
    return "\n".join(lines)


def _mb(b: Any) -> float | None:
    return None if b is None else b / MB


def plot(result: dict[str, Any], path: str) -> bool:
    """Bars of seconds per row (and references) plus the stage split; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels, secs, colors = [], [], []
    for name, ref in result["references"].items():
        if ref.get("seconds"):
            labels.append(name)
            secs.append(ref["seconds"] * 1e3)
            colors.append("grey")
    for r in result["rows"]:
        if r.get("seconds"):
            labels.append(r["row"])
            secs.append(r["seconds"] * 1e3)
            colors.append({"ours": "tab:blue", "native": "tab:orange",
                           "ludic": "tab:green"}.get(r.get("kind"), "tab:red"))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    ax = axes[0]
    ax.barh(labels, secs, color=colors)
    ax.set_xscale("log")
    ax.set_xlabel("ms per sync (median)")
    meta = result["meta"]
    ax.set_title(f"{meta['config']['shape']} {meta['config']['dtype']}, "
                 f"{(meta.get('bytes') or 0) / 1e9:.2f} GB")
    ax.invert_yaxis()
    ax = axes[1]
    stages = result.get("stages") or {}
    parts = ["extract_s", "pack_s", "engine_start_s", "engine_receive_s", "engine_load_s",
             "engine_finish_s", "control_overhead_s"]
    left = [0.0] * len(stages)
    for p in parts:
        vals = [st.get(p, 0.0) * 1e3 for st in stages.values()]
        ax.barh(list(stages), vals, left=left, label=p.removesuffix("_s"))
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax.set_xlabel("ms (one profiled sync)")
    ax.set_title("ours: stage split")
    ax.legend(fontsize=7)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

