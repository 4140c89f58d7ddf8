"""Stacked bars of the predicted per-GPU memory components for each candidate strategy."""

from __future__ import annotations


def plot_candidates(rows: list[dict], path: str, title: str, gpu_mem: int, limit: int = 16) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # one bar per strategy: its cheapest fitting micro batch, else its smallest; fitting ones first
    best: dict = {}
    for r in rows:
        key = (r["zero"], r["offload"], r["checkpointing"])
        cur = best.get(key)
        if cur is None or (r["fits"] and not cur["fits"]) or (not r["fits"] and not cur["fits"] and r["peak_bytes"] < cur["peak_bytes"]):
            best[key] = r
    picked = sorted(best.values(), key=lambda r: (not r["fits"], r["cost"] if r["fits"] else r["peak_bytes"]))[:limit]
    parts = ["weights", "gradients", "optimizer", "zero3_live", "activations", "recompute_working"]
    fig, ax = plt.subplots(figsize=(max(8, len(picked) * 0.7), 5))
    bottom = [0.0] * len(picked)
    for part in parts:
        vals = [r["prediction"][part] / 1e9 for r in picked]
        ax.bar(range(len(picked)), vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(gpu_mem / 1e9, color="red", linestyle="--", label="GPU memory")
    ax.set_xticks(range(len(picked)))
    ax.set_xticklabels([f"{r['strategy']}{' *' if r['fits'] else ''}" for r in picked], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("GB per GPU (before context/fragmentation)")
    ax.set_title(title + "  (* fits)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    from ..atomic import staged

    try:
        with staged(path) as stage:
            fig.savefig(stage, format="png", dpi=110)
    finally:
        plt.close(fig)
