"""The report's figures (matplotlib, no pyplot state: every function returns a new Figure).

Each figure adapts to the data present: DDTree panels appear only when the tau table has
``tau_ddtree_<budget>`` columns, per-slot and per-position curves only with ``accept_slot_<k>`` /
``tau_pos_<lo>_<hi>`` columns,
speedup figures only when target costs were measured. :func:`png` renders a figure to PNG
bytes (embedded as base64 in ``report.html`` and written to ``figures/`` for Snakemake's
report).
"""

from __future__ import annotations

import io
import math

import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, ScalarFormatter

from dflash_eval.report.context import Z95 as CONTEXT_Z95, context_frame
from dflash_eval.report.tau_table import (
    checkpoint_order,
    method_columns,
    variant_label,
    variant_order,
)
from dflash_eval.target.cost_context import interpolate

DPI = 100
PANEL_W, PANEL_H = 4.2, 3.0


def png(fig: Figure) -> bytes:
    """PNG bytes of ``fig`` (no timestamp metadata, so equal figures give equal bytes)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


def _grid(n: int, ncols: int = 4, sharey: bool = True, w: float = PANEL_W, h: float = PANEL_H):
    ncols = max(1, min(ncols, n))
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(w * ncols, h * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, sharey=sharey, squeeze=False).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _x(frame: pd.DataFrame) -> tuple[pd.Series, str, list[str] | None]:
    """x values: the training step when every row has one, else the checkpoint's rank (ticks = names)."""
    if frame["step"].notna().all():
        return frame["step"].astype(float), "training step", None
    order = checkpoint_order(frame)
    return frame["checkpoint"].map({c: i for i, c in enumerate(order)}).astype(float), "checkpoint", order


def set_label(frame: pd.DataFrame, prompt_set: str) -> str:
    """A prompt set's legend entry: its name, with its sampling label when its rows are not the greedy replay
    (``sharegpt-t1 (T1_p0.95_k20)``); ``frame`` without a ``sampling`` column: the name."""
    if "sampling" not in frame:
        return prompt_set
    labels = list(dict.fromkeys(frame.loc[frame["prompt_set"] == prompt_set, "sampling"]))
    return prompt_set if labels in ([], ["T0"]) else f"{prompt_set} ({', '.join(labels)})"


_VARIANT_STYLES = ["-", "--", ":", "-."]  #: line style per variant when several share a panel


def tau_vs_step(frame: pd.DataFrame) -> Figure:
    """tau against training step: one panel per method (chain, each DDTree budget), one line per prompt set.

    With several drafter variants (``variant``: DFlash 1 and DFlash 2 runs side by side), one line per
    (variant, prompt set): the colour is the prompt set's, the line style the variant's (solid DFlash 1,
    dashed DFlash 2), the legend names both; a variant without any value in a panel (DFlash 2's NaN DDTree
    columns) draws no line there."""
    methods = method_columns(frame)
    sets = sorted(frame["prompt_set"].unique())
    variants = variant_order(frame) or [None]
    several = len(variants) > 1
    fig, axes = _grid(len(methods), h=PANEL_H + (0.3 * len(sets) + 0.6 if several else 0))  # room for the legend
    x, xlabel, ticks = _x(frame)
    for ax, (col, label) in zip(axes, methods):
        for j, variant in enumerate(variants):
            for i, ps in enumerate(sets):
                sel = ((frame["prompt_set"] == ps) & ((frame["variant"] == variant) if several else True)).to_numpy()
                pts = pd.DataFrame({"x": x[sel].to_numpy(), "y": frame.loc[sel, col].to_numpy(dtype=float)}).sort_values("x")
                if several and pts["y"].isna().all():
                    continue
                name = set_label(frame, ps) + (f" [{variant_label(variant)}]" if several else "")
                ax.plot(pts["x"], pts["y"], marker="o", color=f"C{i}", label=name,
                        linestyle=_VARIANT_STYLES[j % len(_VARIANT_STYLES)])
        ax.set_title(label)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if ticks is not None:
            ax.set_xticks(range(len(ticks)), ticks, rotation=30, ha="right", fontsize=7)
    axes[0].set_ylabel("tau (tokens per verify step)")
    if several:  # below the panels, one column per variant: the lines stay visible
        fig.legend(*axes[0].get_legend_handles_labels(), title="prompt set [variant]", fontsize=8,
                   loc="outside lower center", ncols=len(variants))
    else:
        axes[0].legend(title="prompt set", fontsize=8)
    fig.suptitle("Acceptance length tau against training step")
    return fig


def _slot_axis(ax) -> None:
    """x: draft slot k (integer ticks); y: a rate in [0, 1]."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft slot k")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def selector_slots(frame: pd.DataFrame) -> Figure:
    """DFlash 2 selector diagnostics by draft slot: per prompt set (one row of panels) the top-K recall
    ``topk_recall_slot_<k>`` and the pick rate ``pick_rate_slot_<k>`` against slot k, one line per checkpoint
    (colour = training order). ``frame``: the DFlash 2 rows to draw (one per checkpoint and prompt set); slots
    without a value (a smaller block size, a slot never compared) are left out of a line."""
    sets = sorted(frame["prompt_set"].unique())
    kinds = [("topk_recall", "top-K recall: target token among the candidates"),
             ("pick_rate", "pick rate: selector picks it, earlier picks right")]
    fig, axes = _grid(2 * len(sets), ncols=2, w=4.6, h=3.0)
    order = checkpoint_order(frame)
    cmap = _cmap()
    for r, ps in enumerate(sets):
        sub = frame[frame["prompt_set"] == ps].drop_duplicates("checkpoint").set_index("checkpoint")
        for ax, (kind, title) in zip(axes[2 * r:2 * r + 2], kinds):
            cols = sorted((int(c[len(kind) + 6:]), c) for c in frame.columns
                          if c.startswith(f"{kind}_slot_") and c[len(kind) + 6:].isdigit())
            for i, ck in enumerate(order):
                if ck not in sub.index:
                    continue
                pts = [(k, float(sub.at[ck, c])) for k, c in cols if pd.notna(sub.at[ck, c])]
                if pts:
                    ax.plot(*zip(*pts), marker=".", color=cmap(0.85 * i / max(1, len(order) - 1)), label=ck)
            ax.set_title(f"{ps}: {title}", fontsize=9)
            _slot_axis(ax)
    axes[0].set_ylabel("rate")
    axes[0].legend(fontsize=7)
    fig.suptitle("DFlash 2 candidate selector by draft slot")
    return fig


def histograms(prompt_set: str, checkpoints: list[str], hists: dict) -> Figure:
    """Acceptance-length histograms of one prompt set, one panel per checkpoint (training order).

    ``hists[(checkpoint, prompt_set)] = (block_size, {k: verify steps that committed k tokens})``.
    """
    fig, axes = _grid(len(checkpoints), ncols=4, w=3.4, h=2.6)
    for ax, ck in zip(axes, checkpoints):
        B, h = hists[(ck, prompt_set)]
        total = sum(h.values()) or 1
        ks = list(range(1, B + 1))
        ax.bar(ks, [h.get(k, 0) / total for k in ks], color="C0")
        ax.set_title(ck, fontsize=8)
        ax.set_xticks(ks if B <= 16 else ks[::max(1, B // 8)])
        ax.set_xlabel("tokens committed per verify step")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("fraction of verify steps")
    fig.suptitle(f"Acceptance-length histograms: {prompt_set}")
    return fig


def slot_curves(prompt_set: str, checkpoints: list[str], curves: dict) -> Figure:
    """Per-slot conditional acceptance P(slot k accepted | slots < k accepted) of one prompt set.

    ``curves[(checkpoint, prompt_set)] = {method: [p_1, p_2, ...]}``; one panel per method,
    one line per checkpoint (colour = training order).
    """
    methods = sorted({m for ck in checkpoints for m in curves.get((ck, prompt_set), {})},
                     key=lambda m: (m != "chain", len(m), m))
    fig, axes = _grid(len(methods))
    cmap = _cmap()
    for ax, m in zip(axes, methods):
        for i, ck in enumerate(checkpoints):
            ys = curves.get((ck, prompt_set), {}).get(m)
            if ys:
                ax.plot(range(1, len(ys) + 1), ys, marker=".", color=cmap(0.85 * i / max(1, len(checkpoints) - 1)), label=ck)
        ax.set_title(m)
        _slot_axis(ax)
    axes[0].set_ylabel("P(slot k accepted | slots < k accepted)")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Per-slot conditional acceptance: {prompt_set}")
    return fig


def position_tau(frame: pd.DataFrame, positions: list[tuple[str, str]]) -> Figure:
    """Tokens per verify step by position bin of the anchor, one panel per prompt set, one line per checkpoint."""
    sets = sorted(frame["prompt_set"].unique())
    fig, axes = _grid(len(sets), ncols=3, w=4.6, h=3.2)
    order = checkpoint_order(frame)
    cmap = _cmap()
    labels = [lab for lab, _ in positions]
    for ax, ps in zip(axes, sets):
        sub = frame[frame["prompt_set"] == ps].set_index("checkpoint")
        for i, ck in enumerate(order):
            if ck in sub.index:
                ys = [float(sub.at[ck, c]) if pd.notna(sub.at[ck, c]) else math.nan for _, c in positions]
                ax.plot(range(len(labels)), ys, marker="o", color=cmap(0.85 * i / max(1, len(order) - 1)), label=ck)
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_xlabel("anchor position in the completion (tokens)")
        ax.set_title(ps)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tokens per verify step")
    axes[0].legend(fontsize=7)
    fig.suptitle("Acceptance by position in the response")
    return fig


def context_dodge(i: int, n: int) -> float:
    """The x factor of the ``i``-th of ``n`` checkpoints in :func:`tau_vs_context`: a small shift on the log axis
    (``2 ** (0.05 (i - (n - 1) / 2))``) so that equal bins do not hide each other's points and bars."""
    return 2 ** (0.05 * (i - (n - 1) / 2))


def tau_vs_context(frame: pd.DataFrame, prompt_set: str) -> Figure:
    """tau against the bin's context for one prompt set (:func:`dflash_eval.report.context.context_frame`): log-2 x
    axis, one line per checkpoint with +-1.96 SE error bars, bins past the checkpoint's trained length hollow, the
    region past each trained length shaded and labelled."""
    long = context_frame(frame)
    long = long[long["prompt_set"] == prompt_set]
    fig = Figure(figsize=(6.4, 3.8), layout="constrained")
    ax = fig.subplots()
    order = [c for c in checkpoint_order(frame) if c in set(long["checkpoint"])]
    cmap = _cmap()
    for i, ck in enumerate(order):
        sub = long[long["checkpoint"] == ck].sort_values("lo")
        x = sub["context"] * context_dodge(i, len(order))
        color = cmap(0.85 * i / max(1, len(order) - 1))
        yerr = (CONTEXT_Z95 * sub["se"]).fillna(0.0)
        trained = sub["trained_max_len"].iloc[0]
        label = f"{ck} (trained length {'unknown' if pd.isna(trained) else int(trained)})"
        ax.errorbar(x, sub["tau"], yerr=yerr, color=color, marker="none", capsize=3, label=label)
        for beyond, face in ((False, color), (True, "white")):
            part = sub["beyond"] == beyond
            ax.plot(x[part], sub["tau"][part], linestyle="none", marker="o", color=color, markerfacecolor=face,
                    markeredgewidth=1.5)
    right = long["context"].max() * 1.6
    left = long["context"].min() / 1.6
    for trained in sorted(long["trained_max_len"].dropna().unique()):
        ax.axvspan(int(trained), max(right, 2 * int(trained)), color="grey", alpha=0.12, linewidth=0)
        ax.axvline(int(trained), color="grey", linestyle="--", linewidth=0.8)
        ax.annotate(f"past trained length {int(trained)}", (max(int(trained), left), 0.0), xycoords=("data", "axes fraction"),
                    xytext=(3, 3), textcoords="offset points", ha="left", va="bottom", fontsize=7, color="dimgrey")
    _log2_axis(ax)
    ax.set_xlim(left, right)
    ax.set_xlabel("prompt tokens at request start (bin midpoint)")
    ax.set_ylabel("tau (tokens per verify step)")
    ax.set_title(f"tau against context, {prompt_set} (bars: 95 % interval, +-1.96 SE)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def _log2_axis(ax) -> None:
    """Log-2 x axis labelled with plain numbers (8, 16, 32 rather than 2^3 ...)."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ScalarFormatter())


def _cmap():
    return colormaps["viridis"]


def speedup_vs_budget(speedups: pd.DataFrame, label: str) -> Figure:
    """Estimated speedup against verify size n, one panel per prompt set, one line per checkpoint.

    The chain is drawn as a square at n = block size, DDTree budgets as a line at n = budget + 1.
    """
    sets = sorted(speedups["prompt_set"].unique())
    fig, axes = _grid(len(sets), ncols=3, w=4.6, h=3.3)
    order = checkpoint_order(speedups)
    cmap = _cmap()
    for ax, ps in zip(axes, sets):
        sub = speedups[speedups["prompt_set"] == ps]
        for i, ck in enumerate(order):
            c = cmap(0.85 * i / max(1, len(order) - 1))  # viridis without its pale yellow end
            rows = sub[sub["checkpoint"] == ck]
            tree = rows[rows["method"] != "chain"].sort_values("verify_tokens")
            if len(tree):
                ax.plot(tree["verify_tokens"], tree["speedup"], marker="o", color=c, label=ck)
            chain = rows[rows["method"] == "chain"]
            ax.plot(chain["verify_tokens"], chain["speedup"], marker="s", linestyle="none", color=c,
                    markeredgecolor="black", label=None if len(tree) else ck)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        _log2_axis(ax)
        ax.set_xlabel("tokens per verify forward n (square: chain)")
        ax.set_title(ps)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("estimated speedup vs autoregressive")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Estimated decode speedup, {label}")
    return fig


def verify_costs(costs: dict, label: str) -> Figure:
    """Measured verify-forward time over decode-step time against n (the device's cost curve)."""
    fig = Figure(figsize=(5.5, 3.4), layout="constrained")
    ax = fig.subplots()
    t_dec = costs["decode_s"]
    for i, mask in enumerate(("causal", "tree")):
        pts = sorted((v["n"], v.get("fit_s", v["median_s"]) / t_dec) for v in costs["verify"] if v["mask"] == mask)
        if pts:
            ax.plot(*zip(*pts), marker="o", color=f"C{i}", label=f"{mask} mask")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    _log2_axis(ax)
    ax.set_xlabel("tokens per verify forward n")
    ax.set_ylabel("t_verify(n) / t_decode")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Target forward cost, {label}", fontsize=9)
    return fig


def break_even_vs_context(curves: pd.DataFrame) -> Figure:
    """Chain tau per prompt-length bin against the break-even tau over context, one panel per prompt set.

    ``curves``: :func:`dflash_eval.report.speed.curve_frame` (``kind`` ``tau``: one line per checkpoint, points at
    the bins' representative contexts; ``break_even``: one black/grey curve per (drafter configuration, batch),
    linear in context between the timed contexts and flat outside, as the model interpolates; markers at the
    timed contexts). x: context in tokens, log2 axis.
    """
    tau = curves[curves["kind"] == "tau"]
    be = curves[curves["kind"] == "break_even"]
    sets = sorted(tau["prompt_set"].unique()) or [""]
    fig, axes = _grid(len(sets), ncols=3, w=4.6, h=3.3)
    lo, hi = curves["context"].min(), curves["context"].max()
    xs = [lo * (hi / lo) ** (i / 63) for i in range(64)]
    order = list(dict.fromkeys(tau["series"]))  # the tau table's order (curve_frame walks its rows)
    cmap = _cmap()
    styles = ["-", "--", ":", "-."]
    batches, configs = sorted(be["batch"].unique()), list(dict.fromkeys(be["series"]))
    for ax, ps in zip(axes, sets):
        sub = tau[tau["prompt_set"] == ps]
        for i, ck in enumerate(order):
            pts = sub[sub["series"] == ck].sort_values("context")
            if len(pts):
                ax.plot(pts["context"], pts["value"], marker="o", color=cmap(0.85 * i / max(1, len(order) - 1)), label=ck)
        for (name, batch), g in be.groupby(["series", "batch"], sort=False):
            style = styles[batches.index(batch) % len(styles)]
            grey = str(0.5 * configs.index(name) / max(1, len(configs) - 1))  # black, then lighter per drafter config
            ax.plot(xs, [interpolate(g["context"], g["value"], x) for x in xs], color=grey, linestyle=style,
                    label=f"break-even, batch {batch}" + (f" ({name})" if len(configs) > 1 else ""))
            ax.plot(g["context"], g["value"], linestyle="none", marker="x", color=grey)
        _log2_axis(ax)
        ax.set_xlabel("context (tokens)")
        ax.set_title(ps)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tau (chain) / break-even tau")
    handles = {lab: h for ax in axes for h, lab in zip(*ax.get_legend_handles_labels())}  # every panel's, once
    fig.legend(handles.values(), handles.keys(), loc="outside right upper", fontsize=7)
    fig.suptitle("Speedup against context: tau above the break-even curve pays")
    return fig
