"""Plot heal curves: the out-of-domain geometric mean of the perplexity ratio against heal tokens.

Reads bench/heal_curve.py outputs (one JSON object, or JSON lines with --append: one run per line) and draws one
line per run (its points in token order), labelled by its ``choice`` (the tlm-convert options), its ``label`` or else
its student folder's name and its recipe overrides; one panel per source model (the run's ``teacher``), the default's
curve in black, the conversion's targets in red:

    python bench/plot_heal_curve.py bench/results/quality/heal_*.json runs/heal_sweep.jsonl --out runs/heal_curves.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def runs(path: Path) -> list[dict]:
    """The heal_curve.py runs in ``path`` (a JSON object or JSON lines)."""
    text = path.read_text()
    try:
        return [json.loads(text)]
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def label(run: dict) -> str:
    if "choice" in run:
        return run["choice"] or "the default"
    if run.get("label"):
        return run["label"]
    settings = [o.split(".", 1)[1] for o in run.get("overrides", []) if "." in o]
    return f"{Path(run['converted']).name}: {', '.join(settings) or 'the heal defaults of its day'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--out", default="runs/heal_curves.png")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {}  # teacher -> its runs: one panel per source model
    for path in args.files:
        for run in runs(path):
            panels.setdefault(run.get("teacher", "smollm2-135m"), []).append(run)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 8), squeeze=False, sharey=True)
    for ax, (teacher, group) in zip(axes[0], sorted(panels.items(), key=lambda kv: kv[0] != "smollm2-135m")):
        colors = iter(plt.get_cmap("tab20").colors)
        for run in group:
            points = sorted(run["points"], key=lambda p: p["tokens"])
            tokens = [max(p["tokens"], 1e4) for p in points]  # the 0 point drawn at the axis' left edge
            style = dict(color="black", linewidth=2.5, zorder=3) if run.get("default") else dict(color=next(colors))
            ax.plot(tokens, [p["ood_geomean"] for p in points], marker="o", label=label(run), **style)
        ax.plot([1e4, 24576], [1.30, 1.25], linestyle="none", marker="*", markersize=12, color="red",
                label="targets: x1.30 converted, x1.25 at 25k tokens")
        ax.axhline(1.15, color="red", linestyle="--", linewidth=1, label="target: x1.15 within 1 h of CPU")
        ax.set_xscale("log")
        ax.set_xlabel("heal tokens (the first point, drawn at 10^4, is 0: right after conversion)")
        ax.set_title(f"{teacher}: healing by distillation\n(--ratio 1.5/0.5 unless a label names another)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=1)
    axes[0][0].set_ylabel("perplexity / source's, OOD geometric mean\n(the default: black)")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120, bbox_inches="tight")  # the legends below the panels included
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
