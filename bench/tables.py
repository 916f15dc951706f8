"""Reading result files and drawing them as markdown: what bench/RESULTS.md, bench/STUDIES.md and the docs' generated
blocks share (bench/report.py and bench/studies.py draw the pages; the schema: bench/README.md, "Result files")."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from bench.suite import RESULTS, ROOT, STUDIES

QUALITY = RESULTS / "quality"  # the choices' conversion rows and heal curves (bench/RESULTS.md)
SET_LABELS = {"default-eval": "default-eval (cal. domain)", "eval-fiction": "fiction", "eval-code": "code",
              "eval-legal": "legal", "eval-encyclopedic": "encyclopedic"}
SOURCE_NAMES = {"smollm2-135m": "SmolLM2-135M", "gemma3-270m": "Gemma 3 270M"}
DEFAULT_SOURCE = "smollm2-135m"


class ReportError(ValueError):
    """A result file that cannot be reported (names the file and what is wrong)."""


def shown(path: Path) -> str:
    """``path`` relative to the repository root where it is under it (messages)."""
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ReportError(f"{shown(path)}: not JSON ({err}); fix or remove the file") from None
    if data.get("quick"):
        raise ReportError(f"{shown(path)} is a --quick smoke test, not a measurement; rerun it without "
                          "--quick or remove it")
    return data


def kind(path: Path, data: dict) -> str:
    """What a result file is: ``envelope`` (a benchmark's), ``row`` (a conversion's quality), ``curve`` (a heal
    curve) or ``source`` (a source's perplexities, quality_ablation.py's cache)."""
    if "benchmark" in data and "tables" in data:
        return "envelope"
    if "points" in data:
        return "curve"
    if "sets" in data and "ood_geomean" in data:
        return "row"
    if path.name == "source.json" or path.name.startswith("source_"):
        return "source"
    raise ReportError(f"{shown(path)}: neither a benchmark's result (benchmark, tables), a quality row (sets, "
                      "ood_geomean) nor a heal curve (points); see bench/README.md 'Result files'")


def cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.6g}" if abs(value) < 1e-2 and value else f"{value:,}"
    return str(value)


def markdown(table: dict) -> list[str]:
    lines = [f"**{table['title']}**", ""] if table.get("title") else []
    lines += ["| " + " | ".join(table["columns"]) + " |", "|" + "---|" * len(table["columns"])]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table["rows"]]
    if table.get("notes"):
        lines += ["", table["notes"]]
    return lines + [""]


def short_machine(data: dict) -> str:
    """The machine in a few words: its first clause, without parentheses (the whole story stays in the file)."""
    first = str(data.get("machine") or "not recorded").split(";")[0]
    first = re.sub(r"\s*\([^)]*(\)|$)", "", first)  # "(R)", "(AVX512-BF16)", an unclosed "(141 GB ..."
    return first.strip(" ,")


# options of the bench scripts that say where files go or how many threads run, not what is measured
PLUMBING = {"--calibration-cache", "--save", "--work", "--out", "--threads", "--json", "--workdir", "--results-dir"}
# options of several values that the section's own table lists (eval_suite.py's models and their OOD rows)
LISTED = {"--models": "LABEL=PATH ...", "--ood": "LABEL=STEM ..."}


def short_command(data: dict) -> str:
    """The command up to its first ``;`` or ``, then``, without the paths it reads and writes (``--save``,
    ``--out`` ...) and the ``--choice`` its table names, the values its table lists (``--models`` ...) as a
    placeholder, and with a bench script named by its file alone (the whole command stays in the file)."""
    command = re.split(r";|, then | \(", str(data.get("command") or "not recorded"))[0]
    command = re.sub(r" --choice (\"[^\"]*\"|'[^']*'|\S+)", "", command)  # the table's first column shows it
    words, out, skip, listing = command.split(), [], False, False
    for i, word in enumerate(words):
        listing = listing and not word.startswith("-")
        if skip or listing:
            skip = False
        elif word in LISTED:
            out += [word, LISTED[word]]
            listing = True
        elif word in PLUMBING:
            skip = True
        elif not (word == "OMP_NUM_THREADS=1" or word == "python" and words[i + 1:i + 2] != ["-m"]):
            out.append(word.removeprefix("bench/"))
    return " ".join(out)


def provenance(data: dict) -> str:
    """One short line: command, machine, torch, date."""
    parts = [f"command: `{short_command(data)}`", f"machine: {short_machine(data)}"]
    parts += [f"{key}: {data[key]}" for key in ("torch", "date") if data.get(key)]
    return "; ".join(parts) + "."


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def ood(ratios: dict, in_domain: set[str]) -> float:
    return geomean([v for k, v in ratios.items() if k not in in_domain])


def point_ood(curve: dict, point: dict) -> float:
    """A heal point's out-of-domain geometric mean (computed where the file does not give it)."""
    return point.get("ood_geomean", ood(point["ratio"], set(curve.get("in_domain", ["default-eval"]))))


def convert_cpu(row: dict) -> float | None:
    """The conversion's CPU seconds, the self samples' drawing apart (a row that drew them counts them)."""
    cpu = row.get("convert_cpu_s")
    return None if cpu is None else cpu - row.get("sample_cpu_s", 0)


def widths(row: dict) -> str | None:
    """The MLP widths, first .. last layer."""
    w = row.get("widths")
    return f"{w[0]:,} .. {w[-1]:,}" if w else None


def f3(v):
    return None if v is None else f"{v:.3f}"


def f0(v):
    return None if v is None else round(v)


def x3(v):
    return None if v is None else f"x{v:.3f}"


def result_files() -> dict[str, tuple[Path, dict]]:
    """Every JSON result file under bench/results/ by its stem (stems are unique: the studies' log text and the
    docs' blocks name files by stem)."""
    found: dict[str, tuple[Path, dict]] = {}
    for path in sorted(RESULTS.rglob("*.json")):
        if path.stem in found:
            raise ReportError(f"{shown(path)}: its name is also {shown(found[path.stem][0])}'s; rename one")
        found[path.stem] = (path, load(path))
    return found


def heal_of(row_path: Path, row: dict, curves: list[tuple[Path, dict]]) -> tuple[Path, dict] | None:
    """A conversion row's heal curve: heal_STEM.json, else the one curve whose ``converted`` folder is the row's."""
    named = [c for c in curves if c[0].name == f"heal_{row_path.stem}.json"]
    by_folder = [c for c in curves if Path(c[1]["converted"]).name == row.get("name")]
    if named:
        return named[0]
    return by_folder[0] if len(by_folder) == 1 else None


def in_studies(path: Path) -> bool:
    return path.is_relative_to(STUDIES)
