"""The run's two plots: loss.png (training loss and learning rate over updates, validation loss of
every weight set) and val_loss.png (validation loss and held-out exact match after each stage).

One look per weight set across both: raw solid, each EMA rate dashed in a colour of its own, the
base model black. matplotlib is imported when a plot is drawn (Agg backend: no display).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from pipeline.evaluate.skipped import NO_TEST, NO_VAL


# One look per weight set across both plots: raw solid, EMA dashed, base black.
BASE_STYLE = dict(color="black", marker="*", ms=11, ls="none")


EMA_COLORS = ["tab:green", "tab:red", "tab:purple", "tab:brown", "tab:olive", "tab:cyan"]


def weights_style(weights: str, order: list[str]) -> dict:
    if weights == "raw":
        return dict(color="tab:orange", marker="o", ls="-")
    emas = [w for w in order if w.startswith("ema")]
    i = emas.index(weights) if weights in emas else len(emas)
    return dict(color=EMA_COLORS[i % len(EMA_COLORS)], marker="s", ls="--")


def _shade_stages(ax, bounds, label: bool) -> None:
    if not bounds:
        return
    span = max(end for _, _, end in bounds) - min(start for _, start, _ in bounds) or 1
    for i, (stage, start, end) in enumerate(bounds):
        if i % 2:
            ax.axvspan(start, end, color="0.93", lw=0, zorder=0)
        ax.axvline(end, color="0.55", ls=":", lw=0.9, zorder=1)
        if label:
            # A stage narrower than ~4% of the run is labelled at its right edge, rotated.
            wide = (end - start) / span > 0.04
            ax.text((start + end) / 2 if wide else end, 0.985, stage, transform=ax.get_xaxis_transform(),
                    ha="center" if wide else "right", va="top", rotation=0 if wide else 90,
                    fontsize=8, color="0.35")


def _log_axis(ax) -> None:
    """Log scale with plain tick labels at 1, 2, 5 x 10^k (not 2 x 10^-1)."""
    from matplotlib import ticker

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_minor_locator(ticker.LogLocator(subs=(3.0, 4.0, 6.0, 7.0, 8.0, 9.0)))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())


def plot_loss(curve: pd.DataFrame, bounds, table: pd.DataFrame, out: Path, title: str = "",
              in_stage: pd.DataFrame | None = None) -> None:
    """Training loss per update; the validation loss of the raw weights and each EMA rate as one
    line each through the in-stage evaluations (small dots) and the stage-end evaluations (large
    markers); the base model as a star; the learning rate below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_lr = not curve.empty and "lr" in curve
    fig, axes = plt.subplots(2 if has_lr else 1, 1, figsize=(10, 6.2 if has_lr else 4.8), dpi=110, sharex=True,
                             squeeze=False, gridspec_kw={"height_ratios": [3.2, 1] if has_lr else [1]})
    ax = axes[0][0]
    _shade_stages(ax, bounds, label=True)
    if not curve.empty:
        ax.plot(curve["step"], curve["loss"], lw=0.7, alpha=0.35, color="tab:blue", label="train loss (per update)")
        smooth = curve["loss"].rolling(max(1, len(curve) // 40), min_periods=1, center=True).mean()
        ax.plot(curve["step"], smooth, lw=1.8, color="tab:blue", label="train loss (smoothed)")
    evals = table[table["loss"].notna() & (table["stage"] != "export")]
    order = list(dict.fromkeys(evals["weights"]))
    base = evals[evals["weights"] == "base"]
    if not base.empty:
        ax.plot(base["step"], base["loss"], **BASE_STYLE, label="val loss, base model")
    in_stage = in_stage if in_stage is not None else pd.DataFrame(columns=["step", "weights", "loss"])
    order += [w for w in dict.fromkeys(in_stage["weights"]) if w not in order]
    for weights in [w for w in order if w != "base"]:
        style = weights_style(weights, order)
        ends = evals[evals["weights"] == weights][["step", "loss"]]
        inside = in_stage[in_stage["weights"] == weights][["step", "loss"]]
        line = pd.concat([inside, ends]).drop_duplicates("step", keep="last").sort_values("step")
        ax.plot(line["step"], line["loss"], lw=1.3, color=style["color"], ls=style["ls"],
                label=f"val loss, {weights} weights")
        if not inside.empty:
            ax.plot(inside["step"], inside["loss"], ls="none", marker=".", ms=6, color=style["color"])
        if not ends.empty:
            ax.plot(ends["step"], ends["loss"], ls="none", marker=style["marker"], ms=6, mfc="white",
                    mew=1.5, color=style["color"])
    if not in_stage.empty:
        ax.plot([], [], ls="none", marker=".", ms=6, color="0.3", label="in-stage evaluation (every validation.every)")
        ax.plot([], [], ls="none", marker="o", ms=6, mfc="white", color="0.3", label="stage-end evaluation (raw o, EMA squares)")
    ax.set_ylabel("loss (nats / supervised token, log)")
    _log_axis(ax)
    ax.grid(True, which="major", axis="y", alpha=0.3)
    ax.set_title(title or "Training and validation loss across stages")
    ax.legend(fontsize=8, loc="upper right", bbox_to_anchor=(1.0, 0.92), framealpha=0.9)
    if has_lr:
        lax = axes[1][0]
        _shade_stages(lax, bounds, label=False)
        lax.plot(curve["step"], curve["lr"], color="0.25", lw=1.2)
        lax.set_ylabel("learning rate")
        lax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        lax.grid(True, axis="y", alpha=0.3)
    axes[-1][0].set_xlabel("update (global, across stages)")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def plot_eval(table: pd.DataFrame, out: Path, title: str = "", skipped: list[str] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = table["loss"].notna() | table["exact_match"].notna()
    evals = table[measured & ~table["weights"].isin(["base", "merged"])]
    order = list(dict.fromkeys(evals["weights"]))
    stages = list(dict.fromkeys(evals["stage"]))
    steps = evals.drop_duplicates("stage").set_index("stage")["step"]
    x = {stage: i for i, stage in enumerate(stages)}
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), dpi=110)
    for weights, group in evals.groupby("weights", sort=False):
        style = dict(weights_style(weights, order), lw=1.3, ms=5, label=f"{weights} weights")
        for ax, col in zip(axes, ("loss", "exact_match")):
            points = group[group[col].notna()]
            if not points.empty:
                ax.plot([x[s] for s in points["stage"]], points[col], **style)
    base = table[table["weights"] == "base"]
    for ax, col in zip(axes, ("loss", "exact_match")):
        if not base.empty and base[col].notna().any():
            ax.axhline(float(base[col].iloc[0]), color="black", ls=":", lw=1.2, label="base model")
    merged = table[table["weights"] == "merged"]
    if not merged.empty and merged["exact_match"].notna().any() and stages:
        axes[1].plot([x[stages[-1]]], [float(merged["exact_match"].iloc[0])], marker="D", ms=8, ls="none",
                     mfc="none", color="black", label="merged export")
    axes[0].set_title("validation loss after each stage")
    axes[0].set_ylabel("loss (nats / supervised token, log)")
    _log_axis(axes[0])
    axes[1].set_title("held-out exact match after each stage")
    axes[1].set_ylabel("exact match (fraction of test prompts)")
    axes[1].set_ylim(-0.03, 1.03)
    for ax, phrase in zip(axes, (NO_VAL, NO_TEST)):
        ax.set_xticks(range(len(stages)), [f"{s}\n(update {int(steps[s])})" for s in stages], fontsize=8)
        ax.set_xlabel("stage")
        ax.grid(True, axis="y", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, phrase if phrase in skipped else "not measured", transform=ax.transAxes,
                    ha="center", color="0.5")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
