"""Mismatch figures, the printed tables, the JSON document and the log-ratio histogram.

Every figure comes from :func:`replay_plugin.metrics.mismatch_metrics`, the function a trainer
calls every step: :func:`measure` calls it once per precision and setting, :func:`figures`
reads the demo table's columns from its result, :func:`metrics_table` prints all of it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

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

#: The importance-ratio band of the table's "outside" column (``is_threshold`` of the metrics).
BAND = (0.9, 1.1)


@dataclass
class Scored:
    """One setting's trainer logprobs on a ``[B, T]`` grid and what they are compared with.

    Position ``t`` holds a token's logprob (``logprobs`` the trainer's, ``rollout`` the
    engine's) and the routes of the token whose output scored it (``routes[:, :-1]`` of the
    ``[B, S]`` batch for the ``[B, S - 1]`` next-token grid)."""

    logprobs: np.ndarray  # float [B, T]
    rollout: np.ndarray  # float [B, T]
    mask: np.ndarray  # bool [B, T]: the scored (response) tokens
    trainer_routes: np.ndarray | None = None  # int [B, T, L, K]: what the trainer's routers did
    rollout_routes: np.ndarray | None = None  # int [B, T, L, K]: the engine's experts
    route_mask: np.ndarray | None = None  # bool [B, T]: True where the engine recorded a route
    route_layers: list[int] | None = None  # the L layers' indices (vLLM's, 0-based)

    def log_ratios(self) -> np.ndarray:
        """``log(pi_train / pi_rollout)`` per scored token, row-major, float64."""
        return self.logprobs.astype(np.float64)[self.mask] - self.rollout.astype(np.float64)[self.mask]


def measure(scored: Scored) -> dict[str, float]:
    """:func:`replay_plugin.metrics.mismatch_metrics` of one setting, as Python floats.

    The logprobs go in as float64 (the demo's are float32 numpy arrays; the recorded runs in
    docs/demo/ were computed in float64), so the function computes in float64."""
    import torch

    from ..metrics import mismatch_metrics

    def tensor(x):
        return None if x is None else torch.from_numpy(np.ascontiguousarray(x))

    out = mismatch_metrics(
        torch.from_numpy(scored.logprobs.astype(np.float64)),
        torch.from_numpy(scored.rollout.astype(np.float64)),
        torch.from_numpy(np.ascontiguousarray(scored.mask, dtype=bool)),
        trainer_routes=tensor(scored.trainer_routes),
        rollout_routes=tensor(scored.rollout_routes),
        route_mask=tensor(scored.route_mask),
        route_layers=scored.route_layers,
        is_threshold=BAND,
    )
    return {k: v.item() for k, v in out.items()}


def figures(metrics: dict[str, float]) -> dict:
    """The table's columns, read from :func:`measure`'s metrics.

    ``mean_abs_delta`` / ``max_abs_delta``: mean / max of ``|log_ratio|`` over the scored tokens,
    ``log_ratio = trainer - rollout`` (the importance ratio ``pi_train / pi_rollout`` in log);
    ``k3_kl``: Schulman's k3 estimator of KL(rollout || trainer), ``mean(exp(r) - 1 - r)``;
    ``mean_ratio``: the untruncated mean ratio; ``frac_ratio_outside``: share of ratios outside
    :data:`BAND`; ``route_agreement``: share of scored tokens whose trainer experts equal the
    rollout's in every layer (None without routes).
    """
    from ..metrics import ROUTE_KEY

    return {
        "mean_abs_delta": metrics["rollout_corr/log_ratio_abs_mean"],
        "max_abs_delta": metrics["rollout_corr/log_ratio_abs_max"],
        "k3_kl": metrics["rollout_corr/k3_kl"],
        "mean_ratio": metrics["rollout_corr/ratio_mean"],
        "frac_ratio_outside": metrics["rollout_corr/rollout_is_ratio_fraction_high"]
        + metrics["rollout_corr/rollout_is_ratio_fraction_low"],
        "route_agreement": metrics.get(ROUTE_KEY),
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


def metrics_table(metric_rows: list[dict]) -> str:
    """Every metric (one line each) of every precision and setting (one column each)."""
    keys = list(dict.fromkeys(k for r in metric_rows for k in r if k not in ("precision", "replay")))
    head = [f"replay_plugin.metrics (is_threshold={BAND})"] + [f"{r['precision']}/{r['replay']}" for r in metric_rows]

    def cell(v: float | None) -> str:
        return "-" if v is None else f"{v:.3g}"

    cells = [head] + [[k] + [cell(r.get(k)) for r in metric_rows] for k in keys]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str, rows: list[dict], meta: dict, metric_rows: list[dict] | None = None) -> None:
    """``{"rows": the table, "meta": ..., "metrics": every metric per row}`` (NaN as null)."""
    doc: dict = {"rows": [{k: r[k] for k in COLUMNS} for r in rows], "meta": meta}
    if metric_rows is not None:
        doc["metrics"] = [
            {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()} for r in metric_rows
        ]
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)


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
