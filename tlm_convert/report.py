"""Human-readable outputs of a conversion: report.md and a PNG of the widths with the importance profile."""

from __future__ import annotations

from pathlib import Path

from .accuracy import accuracy_lines
from .evalsets import perplexity_lines


def write_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    before, after = report["widths_before"], report["widths_after"]
    layers = list(range(len(before)))
    fig, ax = plt.subplots(figsize=(8, 4), dpi=110)
    ax.bar([i - 0.2 for i in layers], before, width=0.4, label="before (uniform)", color="#9aa7b1")
    ax.bar([i + 0.2 for i in layers], after, width=0.4, label=f"after ({report['schedule']})", color="#2b6cb0")
    if "widths_cosine" in report:  # a measured schedule, beside the cosine schedule of the same ratio
        ax.plot(layers, report["widths_cosine"], color="#2f855a", marker="_", ms=14, lw=1, label="cosine (reference)")
    ax.set_xlabel("layer")
    ax.set_ylabel("MLP width")
    profile = report.get("importance_profile")
    if profile:
        twin = ax.twinx()
        ranked = [float("nan") if x is None else x for x in profile]  # None: a growing layer not ranked
        twin.plot(layers, ranked, color="#c05621", marker="o", ms=3, label=f"mean {report['importance']} score")
        twin.set_ylabel(f"mean neuron importance ({report['importance']})", color="#c05621")
        twin.legend(loc="upper center", fontsize=8)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(f"{Path(report['source']).name}: {report['params_before']:,} -> {report['params_after']:,} params")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _prefix(report: dict) -> str:
    """Words for the start-of-text tokens every block begins with (Gemma's <bos>), or "" when there are none."""
    prefix = report.get("block_prefix") or []
    return f", each beginning with the tokenizer's start of text (ids {prefix})" if prefix else ""


def _heal_rate(heal: dict) -> str:
    """Words for the heal's learning rate (relative: the recipe's rate times the weights' RMS), or ""."""
    lr, optim = heal.get("lr"), heal.get("recipe", {}).get("optim", {})
    if lr is None:
        return ""
    return f", lr {lr:.3g}" + (f" = {optim['lr']:g} x the weights' RMS" if optim.get("lr_relative") else "")


def _sources(report: dict) -> str:
    """The calibration sources in words (equal shares; ``self``: samples of the source model, in the file named)."""
    data = report["calibration_data"]
    names = [data] if isinstance(data, str) else data
    samples = report.get("calibration_samples")
    words = [f"`{n}`" + (f" (text sampled from the source, {samples['file']})" if n == "self" and samples else "")
             for n in names]
    return " and ".join(words) + (" in equal shares" if len(names) > 1 else "")


def write_markdown(report: dict, path: Path) -> None:
    lines = [
        "# Conversion report",
        "",
        f"- source: `{report['source']}` ({report['source_kind']}, family {report['family']})",
        f"- schedule: {report['schedule']} {'/'.join(map(str, report['ratio']))}, importance {report['importance']}, "
        f"grow init {report['grow_init']}, least-squares refit {'on' if report['refit'] else 'off'}, "
        f"mixer {report['mixer']}, export {report['export']}",
        f"- parameters: {report['params_before']:,} before, {report['params_after']:,} after",
        f"- calibration: {report['calibration_tokens']:,} tokens of {_sources(report)} "
        f"in blocks of {report['seq_len']}{_prefix(report)}" if report["calibration_tokens"] else
        "- calibration: none (an exact import: no layer resized, no neuron scores needed)",
    ]
    if "perplexity_before" in report:
        lines.append("- perplexity before and after conversion, no training (quality returns with continued "
                     "pretraining):" if "heal" not in report else
                     f"- perplexity before and after conversion, and after healing ({report['heal']['tokens']:,} "
                     f"tokens of logit distillation from the source{_heal_rate(report['heal'])}):")
        lines += [f"  - {line}" for line in perplexity_lines(report)]
    if report.get("accuracy"):
        lines.append("- zero-shot accuracy (lm-evaluation-harness, acc ± stderr; "
                     f"{report['accuracy']['data']}):")
        lines += [f"  - {line}" for line in accuracy_lines(report)]
    if "taper_stages" in report:
        stages = report["taper_stages"]
        lines.append(f"- reached in {len(stages)} stages (--set taper_stages), each converting the previous stage's healed "
                     "model and healing it from the source: ratios " + ", ".join(s["ratio"] for s in stages)
                     + "; heal tokens " + ", ".join(f"{s['heal_tokens']:,}" for s in stages)
                     + " (the perplexities above: the last stage's, against the source)")
    if "widths_cosine" in report:
        lines.append("- measured widths: each layer's count of MLP neurons among the source's top half by Fisher "
                     "removal cost on the calibration text (" + ", ".join(f"{x:g}" for x in report["measured_profile"])
                     + "), widths proportional to it within the ratio's bounds"
                     + (", non-increasing with depth" if report["schedule"] == "measured-taper" else "")
                     + "; the cosine schedule of the same ratio beside them")
    lines += ["", "| phase | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in report["seconds"].items()]
    lines += ["", f"Peak memory (RSS): {report['peak_rss_mb']:.0f} MB", ""]
    if "widths_cosine" in report:
        lines += ["| layer | width before | width after | cosine (reference) |", "|---|---|---|---|"]
        lines += [f"| {i} | {b} | {a} | {c} |" for i, (b, a, c) in
                  enumerate(zip(report["widths_before"], report["widths_after"], report["widths_cosine"]))]
    else:
        lines += ["| layer | width before | width after |", "|---|---|---|"]
        lines += [f"| {i} | {b} | {a} |" for i, (b, a) in
                  enumerate(zip(report["widths_before"], report["widths_after"]))]
    lines += ["", "![widths](widths.png)", ""]
    path.write_text("\n".join(lines))


__all__ = ["write_plot", "write_markdown"]
