"""Stacked bars of the predicted per-GPU memory components for each candidate strategy."""

from __future__ import annotations


def plot_candidates(rows: list, path: str, title: str, gpu_mem: int, limit: int = 16) -> None:
    """One stacked bar per strategy (its cheapest fitting micro batch, else its smallest): the prediction's
    breakdown at its peak, by kind (traced) or by analytic term, whichever answered for the rows."""
    from dataclasses import replace

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best: dict = {}
    for r in rows:
        key = replace(r.strategy, micro_batch=1)
        cur = best.get(key)
        if cur is None or (r.fits and not cur.fits) or (not r.fits and not cur.fits and r.peak_bytes < cur.peak_bytes):
            best[key] = r
    picked = sorted(best.values(), key=lambda r: (not r.fits, r.cost if r.fits else r.peak_bytes))[:limit]
    parts = list(dict.fromkeys(k for r in picked for k, v in r.prediction.breakdown.items() if v > 0))
    fig, ax = plt.subplots(figsize=(max(8, len(picked) * 0.7), 5))
    bottom = [0.0] * len(picked)
    for part in parts:
        vals = [max(0, r.prediction.breakdown.get(part, 0)) / 1e9 for r in picked]
        ax.bar(range(len(picked)), vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(gpu_mem / 1e9, color="red", linestyle="--", label="GPU memory")
    ax.set_xticks(range(len(picked)))
    ax.set_xticklabels([f"{r.label}{' *' if r.fits else ''}" for r in picked], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("GB per GPU at the peak (before context/fragmentation)")
    ax.set_title(title + "  (* fits)")
    ax.legend(fontsize=7)
    save_png(fig, path, dpi=110)


def save_png(fig, path: str, dpi: int) -> None:
    """Write a matplotlib figure to `path` through a stage (hfscale.util.atomic), then close it."""
    import matplotlib.pyplot as plt

    from ..util.atomic import staged

    fig.tight_layout()
    try:
        with staged(path) as stage:
            fig.savefig(stage, format="png", dpi=dpi)
    finally:
        plt.close(fig)


KIND_ORDER = ("parameters", "buffers", "master_weights", "optimizer", "gradients", "activations", "temporaries")


def plot_timeline(ranks: list[dict], path: str, title: str, predicted: dict[int, int] | None = None) -> None:
    """Stacked live bytes by kind over the ops of the profiled steps (`hfscale.proofs.profile`), one panel per rank
    (at most 4), with a band per step phase and the plan's predicted steady peak for that rank as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = ranks[:4]
    fig, axes = plt.subplots(len(shown), 1, figsize=(11, 3.6 * len(shown)), squeeze=False)
    colors = dict(zip(KIND_ORDER, plt.get_cmap("tab10").colors))
    for ax, r in zip(axes[:, 0], shown):
        samples = r["samples"]
        xs = list(range(len(samples)))
        kinds = [k for k in KIND_ORDER if any(s[2].get(k) for s in samples)]
        ax.stackplot(xs, [[s[2].get(k, 0) / 2**20 for s in samples] for k in kinds],
                     labels=[k.replace("master_weights", "master weights / engine buffers") for k in kinds],
                     colors=[colors[k] for k in kinds], step="post")
        # a band per phase of each step, labelled once
        start, label = 0, samples[0][1] if samples else ""
        for i, s in enumerate(samples + [[0, None, {}]]):
            if s[1] != label:
                phase = label.split()[-1] if label else ""
                shade = {"forward": "#dde8f5", "backward": "#f5e6dd", "optimizer": "#e3f5dd"}.get(phase, "#eeeeee")
                ax.axvspan(start, i, color=shade, alpha=0.5, zorder=-1)
                ax.text((start + i) / 2, 1.0, label.replace("step ", "s").replace("forward", "fw").replace(
                    "backward", "bw").replace("optimizer", "opt"), transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=6)
                start, label = i, s[1]
        m = r["measured"]
        ax.axhline(m["peak"] / 2**20, color="black", lw=0.8, ls=":", label=f"measured steady peak {m['peak'] / 2**20:.1f} MiB")
        want = (predicted or {}).get(r["rank"])
        if want:
            ax.axhline(want / 2**20, color="red", lw=1, ls="--", label=f"plan's predicted peak {want / 2**20:.1f} MiB")
        ax.set_ylabel(f"rank {r['rank']}: MiB alive")
        ax.set_xlabel("ops that changed the live bytes (time order)")
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=10)
    save_png(fig, path, dpi=100)
