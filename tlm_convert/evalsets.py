"""Several evaluation sets in one conversion: their blocks, and the report's perplexity before/after per set.

``--eval-data`` names one or more sets (tlm_io.text.eval_sources). The report keeps, per set, the perplexity
before and after conversion and their ratio, whether the set shares the calibration sample's domain (it is the
calibration source itself, or in ``data.IN_DOMAIN`` with the bundled calibration sample), and the geometric mean of
the ratios over the out-of-domain sets: the figure that says how the conversion holds up on text the calibration
never saw. ``perplexity_before/after/ratio`` are those of the first set.
"""

from __future__ import annotations

import math

import torch

from tlm_io.text import IN_DOMAIN, eval_sources, load_text, token_blocks


def eval_set_blocks(tokenizer, data, seq_len: int, max_tokens: int) -> dict[str, torch.Tensor] | None:
    """{set name: (n, seq_len) blocks, at most ``max_tokens`` tokens each} of ``data`` (None when it names none)."""
    names = eval_sources(data)
    if not names:
        return None
    return {name: token_blocks(tokenizer, load_text(name), seq_len, max_tokens, what=f"evaluation ({name})")
            for name in names}


def perplexity_entries(before: dict[str, float], after: dict[str, float],
                       calibration_data: str | tuple[str, ...] | list[str] = "default") -> dict:
    """The report's perplexity keys from {set: perplexity} before and after conversion; a set is in the calibration
    domain when it is a calibration source itself, or a bundled in-domain set with the bundled calibration among
    the sources."""
    sources = {calibration_data} if isinstance(calibration_data, str) else set(calibration_data)

    def in_domain(name: str) -> bool:
        return name in sources or ("default" in sources and name in IN_DOMAIN)

    sets = [{"data": name, "before": before[name], "after": after[name], "ratio": after[name] / before[name],
             "in_domain": in_domain(name)} for name in before]
    first = sets[0]
    out = {"perplexity_before": first["before"], "perplexity_after": first["after"],
           "perplexity_ratio": first["ratio"], "perplexity_sets": sets}
    ood = [s["ratio"] for s in sets if not s["in_domain"]]
    if ood:
        out["perplexity_ratio_ood_geomean"] = geomean(ood)
    return out


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def perplexity_lines(report: dict) -> list[str]:
    """One line per evaluation set and one for the out-of-domain geometric mean (CLI summary and report.md)."""
    sets = report.get("perplexity_sets") or []
    lines = [f"on {s['data']}{' (calibration domain)' if s['in_domain'] else ''}: {s['before']:.3f} before, "
             f"{s['after']:.3f} after (x{s['ratio']:.3f})"
             + (f", {s['healed']:.3f} healed (x{s['healed_ratio']:.3f})" if "healed" in s else "") for s in sets]
    if "perplexity_ratio_ood_geomean" in report:
        n = sum(not s["in_domain"] for s in sets)
        healed = report.get("perplexity_ratio_ood_geomean_healed")
        lines.append(f"ratio x{report['perplexity_ratio_ood_geomean']:.3f}"
                     + (f" after conversion, x{healed:.3f} healed" if healed is not None else "")
                     + f", geometric mean over the {n} out-of-domain set{'s' if n > 1 else ''}")
    return lines


__all__ = ["eval_set_blocks", "perplexity_entries", "perplexity_lines"]
