"""Mismatch figures, the printed table, the JSON document and the log-ratio histogram."""

from __future__ import annotations

import json

import numpy as np

COLUMNS = (
    "precision",
    "replay",
    "mean_abs_delta",
    "max_abs_delta",
    "k3_kl",
    "mean_ratio",
    "frac_ratio_outside",
    "route_agreement",
)


def figures(trainer: np.ndarray, rollout: np.ndarray, route_match: np.ndarray | None) -> dict:
    """Mismatch between the trainer's and the rollout's logprobs of the same tokens.

    ``log_ratio = trainer - rollout`` (the importance ratio ``pi_train / pi_rollout`` in log);
    ``k3_kl`` is Schulman's k3 estimator of KL(rollout || trainer) on rollout samples,
    ``mean(exp(r) - 1 - r)``; ``frac_ratio_outside``: share of ratios outside [0.9, 1.1];
    ``route_agreement``: share of scored tokens whose trainer experts equal the rollout's in
    every layer (None without routes).
    """
    r = trainer.astype(np.float64) - rollout.astype(np.float64)
    ratio = np.exp(r)
    return {
        "mean_abs_delta": float(np.mean(np.abs(r))),
        "max_abs_delta": float(np.max(np.abs(r))),
        "k3_kl": float(np.mean(ratio - 1.0 - r)),
        "mean_ratio": float(np.mean(ratio)),
        "frac_ratio_outside": float(np.mean((ratio < 0.9) | (ratio > 1.1))),
        "route_agreement": None if route_match is None else float(np.mean(route_match)),
    }


def table(rows: list[dict]) -> str:
    head = ("precision", "replay", "mean|d|", "max|d|", "k3 KL", "mean ratio", "outside[0.9,1.1]", "routes agree")
    cells = [head]
    for r in rows:
        agree = "-" if r["route_agreement"] is None else f"{100 * r['route_agreement']:.1f}%"
        cells.append(
            (
                r["precision"],
                r["replay"],
                f"{r['mean_abs_delta']:.2e}",
                f"{r['max_abs_delta']:.2e}",
                f"{r['k3_kl']:.2e}",
                f"{r['mean_ratio']:.5f}",
                f"{100 * r['frac_ratio_outside']:.1f}%",
                agree,
            )
        )
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = [
        "  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str, rows: list[dict], meta: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"rows": [{k: r[k] for k in COLUMNS} for r in rows], "meta": meta}, fh, indent=1)


def write_plot(path: str, rows: list[dict], log_ratios: dict) -> None:
    """One histogram panel per precision, one curve per replay setting."""
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    precisions = list(dict.fromkeys(r["precision"] for r in rows))
    fig, axes = plt.subplots(1, len(precisions), figsize=(6 * len(precisions), 4), squeeze=False)
    for ax, precision in zip(axes[0], precisions):
        values = [log_ratios[(precision, r["replay"])] for r in rows if r["precision"] == precision]
        lo = min(float(v.min()) for v in values)
        hi = max(float(v.max()) for v in values)
        bins = np.linspace(min(lo, -1e-3), max(hi, 1e-3), 60)
        for r in rows:
            if r["precision"] == precision:
                ax.hist(
                    log_ratios[(precision, r["replay"])],
                    bins=bins,
                    histtype="step",
                    linewidth=1.5,
                    label=f"{r['replay']} (mean ratio {r['mean_ratio']:.4f})",
                )
        ax.set_yscale("log")
        ax.set_title(f"trainer {precision}: log(pi_train / pi_rollout) per token")
        ax.set_xlabel("log ratio")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
