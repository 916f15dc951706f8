"""bench/STUDIES.md: the seeds, sweeps and ablations behind the defaults, one dated section a study, drawn from the
result files under bench/results/studies/STUDY/ (and the main page's files a study compares against).

A study is a :class:`Study` below: its question, its log (dated entries; a figure in them is a placeholder the
report fills from a result file, never typed) and the files it shows beside its own. Placeholders name a file by its
stem: ``{ood:STEM}`` (a conversion's OOD ratio), ``{ood:STEM@T}`` (a heal curve's after T tokens), ``{set:STEM:SET}``
and ``{set:STEM@T:SET}`` (one set's ratio), ``{cpu:STEM}`` (a conversion's CPU seconds; ``@T``: the heal's to T),
``{widths:STEM}`` (first .. last MLP width), ``{lr:STEM@T}`` (the heal's rate), ``{gmean:STEM,STEM,...}`` and
``{gmean:STEM,...@T}`` (the geometric mean of several OOD ratios), ``{pair:STEM:STUDY/SPLIT/ARM}`` (a compare
study's paired difference of ARM, its mean ± std and how many seeds it leads in).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.study_log import LOGS
from bench.suite import ROOT, STUDIES
from bench.tables import (DEFAULT_SOURCE, SET_LABELS, SOURCE_NAMES, ReportError, convert_cpu, f0, f3, geomean, heal_of, kind, markdown, point_ood,
                          provenance, result_files, short_machine, shown, widths, x3)

STUDIES_MD = ROOT / "bench" / "STUDIES.md"
HEAL_AT = 24_576  # a varied study's heal column
PLACEHOLDER = re.compile(r"\{(ood|set|cpu|widths|lr|gmean|pair):([\w,-]+)(?:@(\d+))?(?::([\w/+-]+))?\}")


@dataclass
class Study:
    name: str                 # its folder under bench/results/studies/
    title: str                # its heading on bench/STUDIES.md
    question: str             # what it asks, in a sentence or two
    also: list[str] = field(default_factory=list)  # stems of files elsewhere its tables show beside its own
    varied: str | None = None  # the ``study.name`` of rows whose ``study`` keys are its varied settings
    grown: bool = False        # show how far its heals moved the grown neurons


STUDY_LIST = [
    Study("ratio", "The taper ratio (`--ratio`)",
          "How far should the taper go? The ratio of the first layer's width to the source's, and the last layer's.",
          also=["fisher_token", "heal_fisher_token", "ratio_140", "heal_ratio_140", "ratio_125", "heal_ratio_125",
                "gemma_fisher_token", "heal_gemma_fisher_token", "gemma_ratio_140", "heal_gemma_ratio_140",
                "gemma_ratio_125", "heal_gemma_ratio_125"]),
    Study("measured-taper", "Widths from the source (`--schedule measured-taper`)",
          "Does a taper measured on the source itself lose less than the paper's cosine taper?",
          also=["measured_taper_fisher_token", "heal_measured_taper_fisher_token", "fisher_token", "heal_fisher_token",
                "gemma_measured_taper_fisher_token", "heal_gemma_measured_taper_fisher_token", "gemma_fisher_token",
                "heal_gemma_fisher_token",
                "gemma_fisher", "heal_gemma_fisher", "obs_default", "heal_obs"]),
    Study("calibration-size", "The calibration's size and draw (`--calibration-tokens`)",
          "How much does the calibration text's size move the conversion, and how much its draw alone?",
          also=["fisher_token_cal131k", "heal_fisher_token_cal131k", "fisher_token", "heal_fisher_token"],
          varied="calibration"),
    Study("neuron-ranking", "Neuron ranking: Fisher against OBS",
          "Which neurons should a shrinking layer keep: those its own output needs (OBS), or those the whole "
          "model's output needs (the Fisher pre-pass)?",
          also=["fisher_token", "heal_fisher_token", "gemma_fisher_token", "heal_gemma_fisher_token",
                "heal_gemma_relative"]),
    Study("fisher-estimate", "The Fisher estimate: its mask and its draws",
          "The Fisher scores are a sampled estimate; how much does its sampling move the conversion, and what "
          "estimates it best for the same CPU?",
          also=["fisher_token", "heal_fisher_token", "gemma_fisher_token", "heal_gemma_fisher_token"],
          varied="fisher_draw"),
    Study("grow-init", "New neurons of growing layers (`grow_init`)",
          "How should the neurons a growing layer adds start: small noise, zeros, or copies of its best neurons?",
          also=["gemma_fisher", "heal_gemma_fisher", "heal_obs", "heal_gemma_relative"], grown=True),
    Study("heal-recipe", "The heal's recipe: rate, schedule, loss, text",
          "What heals a conversion fastest per token: the rate and its schedule, a richer loss, other text?",
          also=["fisher_token", "heal_fisher_token"]),
    Study("gradual-taper", "A taper reached in stages (`--set taper_stages=K`)",
          "Does reaching the widths in several conversions, each healed, beat one conversion healed as long?",
          also=["heal_obs", "heal_gemma_relative"]),
    Study("fold", "Fold instead of drop (`--set shrink=fold`)",
          "Should a shrinking layer merge its neurons into clusters (model folding) instead of dropping the "
          "lowest-ranked ones?",
          also=["fisher_token", "heal_fisher_token", "fisher_token_seed1", "heal_fisher_token_seed1",
                "fisher_token_seed2", "heal_fisher_token_seed2", "gemma_fisher_token", "heal_gemma_fisher_token"],
          varied="fold"),
    Study("heal-step", "The heal step's loss and its chunk",
          "What does distillation cost a step, and how large a chunk of positions should the chunked loss take?"),
    Study("compare", "Converted then trained, against trained as it is",
          "At CPU scale, does a converted checkpoint trained on beat the same checkpoint trained on as it is?"),
    Study("evidence", "Tapered against uniform and reversed, from scratch",
          "Does the paper's taper beat a uniform model of the same size when both train from scratch?"),
]
STUDIES_BY_NAME = {s.name: s for s in STUDY_LIST}


# ------------------------------------------------------------------------------------------------- placeholders


def figure(match: re.Match, files: dict[str, tuple[Path, dict]]) -> str:
    """The text a placeholder stands for, from the file it names."""
    what, stems, tokens, set_name = match[1], match[2].split(","), match[3], match[4]
    found = []
    for stem in stems:
        if stem not in files:
            raise ReportError(f"{match[0]}: no result file {stem}.json under bench/results/")
        found.append(files[stem][1])
    if what == "gmean":
        return x3(geomean([value(d, "ood", tokens, None, match[0]) for d in found]))
    [data] = found
    if what == "pair":
        return pair(data, set_name or "", match[0])
    v = value(data, what, tokens, set_name, match[0])
    return {"ood": x3, "set": f3, "cpu": lambda c: f"{f0(c):,}", "widths": str,
            "lr": lambda r: re.sub(r"e-0?(\d)", r"e-\1", f"{r:.2e}")}[what](v)


def value(data: dict, what: str, tokens: str | None, set_name: str | None, where: str):
    if tokens is not None:
        at = {p["tokens"]: p for p in data.get("points", [])}
        if int(tokens) not in at:
            raise ReportError(f"{where}: the file has no heal point at {tokens} tokens")
        point = at[int(tokens)]
        found = {"ood": lambda: point_ood(data, point), "set": lambda: point["ratio"].get(set_name),
                 "cpu": lambda: point.get("cpu_seconds"), "lr": lambda: point.get("lr")}.get(what, lambda: None)()
    else:
        found = {"ood": lambda: data.get("ood_geomean"), "cpu": lambda: convert_cpu(data), "widths": lambda: widths(data),
                 "set": lambda: data.get("sets", {}).get(set_name, {}).get("ratio")}.get(what, lambda: None)()
    if found is None:
        raise ReportError(f"{where}: the file gives no such figure")
    return found


def pair(data: dict, key: str, where: str) -> str:
    study, split, arm = (key.split("/") + ["", ""])[:3]
    rows = [r for r in data.get("reading", []) if r[0] == study and r[2] == split and r[3].startswith(arm + " ")]
    if len(rows) != 1:
        raise ReportError(f"{where}: no single reading of {arm} in {study} at {split}")
    [r] = rows
    return f"{r[3]} {r[5]}, lower in {r[6]} seeds ({r[4]})"


def fill(text: str, files: dict[str, tuple[Path, dict]]) -> str:
    return PLACEHOLDER.sub(lambda m: figure(m, files), text)


# ------------------------------------------------------------------------------------------------- tables


def study_files(study: Study, files: dict[str, tuple[Path, dict]]) -> list[tuple[Path, dict]]:
    """A study's own files (its folder) and those it names from elsewhere."""
    own = [(p, d) for p, d in files.values() if p.parent == STUDIES / study.name]
    missing = [s for s in study.also if s not in files]
    if missing:
        raise ReportError(f"study {study.name}: no result files {missing} under bench/results/")
    return own + [files[s] for s in study.also]


def varied_table(rows: list[tuple[Path, dict]], curves) -> list[str]:
    """Rows whose ``study`` keys are the varied settings: each with its heal at HEAL_AT tokens and, per setting of
    every key but the last (the seed), the geometric means over the last."""
    keys = [k for k in rows[0][1]["study"] if k not in ("name", "title", "command", "heal_command", "machine",
                                                        "in_main_tables")]
    names = list(rows[0][1]["sets"])
    rows = sorted(rows, key=lambda item: [item[1]["study"][k] for k in keys])
    columns = [*keys, *(SET_LABELS.get(n, n) for n in names), "OOD", f"OOD after {HEAL_AT:,} heal tokens",
               "convert CPU s", "date", "file"]
    table, groups = [], {}
    for path, data in rows:
        heal = heal_of(path, data, curves)
        at = {p["tokens"]: p for p in heal[1]["points"]} if heal else {}
        after = point_ood(heal[1], at[HEAL_AT]) if HEAL_AT in at else None
        groups.setdefault(tuple(data["study"][k] for k in keys[:-1]), []).append((data["ood_geomean"], after))
        table.append([*(data["study"][k] for k in keys), *(f3(data["sets"][n]["ratio"]) for n in names),
                      x3(data["ood_geomean"]), x3(after), f0(convert_cpu(data)), data.get("date"), files_cell(path, heal)])
    for setting, got in groups.items():
        if len(got) > 1:
            healed = [a for _, a in got if a is not None]
            table.append([*setting, f"mean of {len(got)}", *([""] * len(names)),
                          f"**{x3(geomean([c for c, _ in got]))}**",
                          f"**{x3(geomean(healed))}**" if len(healed) == len(got) else None, None, None, ""])
    study = rows[0][1]["study"]
    return [*markdown({"columns": columns, "rows": table}),
            f"*command: `{study['command']}`, its heal `{study['heal_command']}`.*", ""]


def rows_table(rows: list[tuple[Path, dict]], curves) -> list[str]:
    """Conversion rows by label, each with its heal's OOD at every point it has."""
    names = list(dict.fromkeys(n for _, d in rows for n in d["sets"]))
    heals = [heal_of(p, d, curves) for p, d in rows]
    tokens = sorted({p["tokens"] for h in heals if h for p in h[1]["points"] if p["tokens"]})
    columns = ["conversion", "source", *(SET_LABELS.get(n, n) for n in names), "OOD",
               *(f"healed {t:,}" for t in tokens), "convert CPU s", "date", "file"]
    table = []
    for (path, data), heal in zip(rows, heals):
        at = {p["tokens"]: p for p in heal[1]["points"]} if heal else {}
        table.append([data.get("label", data["name"]), source_name(data), *(f3(data["sets"].get(n, {}).get("ratio")) for n in names),
                      f"**{x3(data['ood_geomean'])}**", *(x3(point_ood(heal[1], at[t])) if t in at else None
                                                         for t in tokens),
                      f0(convert_cpu(data)), data.get("date"), files_cell(path, heal)])
    return markdown({"columns": columns, "rows": table})


def files_cell(path: Path, heal: tuple[Path, dict] | None) -> str:
    """A row's file and its heal curve's."""
    return path.name + (f", {heal[0].name}" if heal else "")


def curves_table(curves: list[tuple[Path, dict]], shown_rows: set[str]) -> list[str]:
    """Heal curves no conversion row of the study holds: every point (point 0 only where no row shows it)."""
    names = list(dict.fromkeys(n for _, d in curves for n in d["source_perplexity"]))
    columns = ["heal", "source", "tokens", *(SET_LABELS.get(n, n) for n in names), "OOD", "CPU s", "date", "file"]
    table = []
    for path, data in curves:
        for p in sorted(data["points"], key=lambda p: p["tokens"]):
            if p["tokens"] == 0 and Path(data["converted"]).name in shown_rows:
                continue
            table.append([data.get("label", Path(data["converted"]).name), source_name(data), p["tokens"],
                          *(f3(p["ratio"].get(n)) for n in names), f"**{x3(point_ood(data, p))}**",
                          f0(p.get("cpu_seconds")), data.get("date"), path.name])
    return markdown({"columns": columns, "rows": table})


def source_name(data: dict) -> str:
    source = data.get("source") or data.get("teacher") or DEFAULT_SOURCE
    return SOURCE_NAMES.get(source, source)


def grown_neurons_table(curves: list[tuple[Path, dict]]) -> list[str]:
    """How far the heals moved the neurons the conversion grew (bench/grown_neurons.py --curve)."""
    grown = [(d.get("label", Path(d["converted"]).name), d["grown_neurons"]) for _, d in curves if "grown_neurons" in d]
    if not grown:
        return []
    columns = ["heal", "heal tokens", "grown neurons", "grown down-column norm before", "after", "source's",
               "grown gate/up rows moved", "source's"]
    rows = [[label, g.get("heal_tokens"), f"{g['neurons']:,} in {g['layers']} layers",
             f"{g['grown_down_norm_before']:.4f}", f"{g['grown_down_norm_after']:.4f}",
             f"{g['source_down_norm_after']:.3f}", f"{g['grown_gate_proj_moved']:.4f} / {g['grown_up_proj_moved']:.4f}",
             f"{g['source_gate_proj_moved']:.4f} / {g['source_up_proj_moved']:.4f}"] for label, g in grown]
    return ["How far each heal moved the MLP neurons the conversion grew (norms of down_proj columns, gate/up rows' "
            "movement relative to their start; means over the growing layers):", "",
            *markdown({"columns": columns, "rows": rows})]


def envelope_lines(path: Path, data: dict) -> list[str]:
    lines = [f"**{data['title']}** ({shown(path)})", ""]
    for t in data["tables"]:
        lines += markdown(t)
    pngs = ([data["png"]] if data.get("png") else []) + data.get("pictures", [])
    if pngs:
        lines += [" ".join(f"![{data['benchmark']}]({Path(png).relative_to('bench').as_posix()})" for png in pngs), ""]
    return lines + [f"*{provenance(data)}*", "", *(line for note in data.get("notes", []) for line in (note, ""))]


def dates(group: list[tuple[Path, dict]], log: list[tuple[str, str]]) -> str:
    got = sorted({d["date"] for _, d in group if d.get("date")} | {day for day, _ in log})
    return got[0] if len(got) == 1 else f"{got[0]} to {got[-1]}" if got else "undated"


def section(study: Study, files: dict[str, tuple[Path, dict]]) -> list[str]:
    group = study_files(study, files)
    own = [(p, d) for p, d in group if p.parent == STUDIES / study.name]
    if not own:
        raise ReportError(f"study {study.name}: no result files under {shown(STUDIES / study.name)}/")
    kinds = {id(d): kind(p, d) for p, d in group}
    rows = [(p, d) for p, d in group if kinds[id(d)] == "row"]
    curves = [(p, d) for p, d in group if kinds[id(d)] == "curve"]
    varied = [(p, d) for p, d in rows if study.varied and d.get("study", {}).get("name") == study.varied]
    plain = [(p, d) for p, d in rows if (p, d) not in varied]
    attached = {id(h[1]) for p, d in rows if (h := heal_of(p, d, curves))}
    log = LOGS.get(study.name, [])
    lines = [f"## {study.title}", "", f"*{dates(own, log)}; files: {shown(STUDIES / study.name)}/"
             + (f", and {', '.join(f'{s}.json' for s in study.also)}" if study.also else "") + ".*", "",
             study.question, ""]
    if log:
        lines += ["**Log**", ""]
        lines += [f"- **{day}**: {fill(text, files)}" for day, text in log] + [""]
    if varied:
        lines += varied_table(varied, curves)
    if plain:
        lines += rows_table(plain, curves)
    loose = [(p, d) for p, d in curves if id(d) not in attached]
    if loose:
        lines += curves_table(loose, {d["name"] for _, d in rows})
    if study.grown:
        lines += grown_neurons_table(curves)
    for path, data in group:
        if kinds[id(data)] == "envelope":
            lines += envelope_lines(path, data)
    machines = Counter(short_machine(d) for _, d in own)
    lines += ["Machines: " + "; ".join(f"{m} ({n} file{'s' * (n > 1)})" for m, n in machines.items())
              + ". Each file holds its full command and machine.", ""]
    return lines


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading (tests/test_docs.py checks links against it)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def index_lines(page: str) -> list[str]:
    return [f"- [{s.title}]({page}#{anchor(s.title)})" for s in STUDY_LIST]


def render() -> str:
    files = result_files()
    folders = {p.parent.name for p, _ in files.values() if p.parent.parent == STUDIES}
    unknown = folders - set(STUDIES_BY_NAME)
    if unknown:
        raise ReportError(f"bench/results/studies/{sorted(unknown)[0]}/ is no study of bench/studies.py; add it there")
    lines = ["# Studies", "",
             "Generated by `python -m bench report` from the files under `bench/results/studies/` (and the main "
             "page's files they compare against); do not edit by hand. Each study is a log: what it asked, what was "
             "run and when, and what it found, every figure drawn from a result file. The defaults and the user "
             "choices they led to: [RESULTS.md](RESULTS.md); superseded rows: `git log -p bench/results/`.", "",
             *index_lines(""), ""]
    for study in STUDY_LIST:
        lines += section(study, files)
    return "\n".join(lines).rstrip() + "\n"
