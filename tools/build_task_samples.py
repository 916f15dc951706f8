"""Build the bundled zero-shot task samples (tlm_io/data/tasks/*.jsonl) from the public originals.

Each output file holds documents in the fields lm-evaluation-harness's own task reads (its Hugging Face data set's
columns), so the task YAMLs of tlm_io/tasks/ apply lm-eval's own doc_to_text / doc_to_choice / doc_to_target to
them. Where an original is in another layout, the documents are rebuilt from it (the rules are below, per task).
The sample is ``random.Random(seed).sample(range(n), size)`` of the original's items, kept in their original order;
``--size 0`` writes every item (a full set for ``tlm eval --task-data DIR``).

    python tools/build_task_samples.py --piqa PIQA_DATA --foundry LOCAL_DATA --hellaswag-text FILE.bz2 \\
        --out tlm_io/data/tasks [--size 500] [--seed 0]

PIQA_DATA: ``piqa/data`` of ybisk/ybisk.github.io (valid.jsonl, valid-labels.lst); LOCAL_DATA:
``scripts/eval/local_data`` of mosaicml/llm-foundry; FILE.bz2: ``hellaswag_val_full.txt.bz2`` of
klosax/hellaswag_text_data. Provenance (commits, licences) is in tlm_io/data/README.md. Offline, deterministic.
"""

from __future__ import annotations

import argparse
import bz2
import json
import random
import sys
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def piqa(root: Path) -> list[dict]:
    """valid.jsonl (goal, sol1, sol2) with valid-labels.lst (0 / 1), line by line: lm-eval's piqa columns."""
    docs = read_jsonl(root / "valid.jsonl")
    labels = [int(x) for x in (root / "valid-labels.lst").read_text().split()]
    assert len(docs) == len(labels), (len(docs), len(labels))
    return [{"goal": d["goal"], "sol1": d["sol1"], "sol2": d["sol2"], "label": y} for d, y in zip(docs, labels)]


def arc(path: Path) -> list[dict]:
    """llm-foundry's {"query": "Question: Q", "choices", "gold"} -> ai2_arc's question, choices {text, label},
    answerKey (labels A, B, C, ...)."""
    out = []
    for d in read_jsonl(path):
        assert d["query"].startswith("Question: "), d["query"][:40]
        labels = [chr(ord("A") + i) for i in range(len(d["choices"]))]
        out.append({"question": d["query"][len("Question: "):], "choices": {"text": d["choices"], "label": labels},
                    "answerKey": labels[d["gold"]]})
    return out


def openbookqa(path: Path) -> list[dict]:
    """llm-foundry's {"query": question stem, "choices", "gold"} -> openbookqa's question_stem, choices, answerKey."""
    out = []
    for d in read_jsonl(path):
        labels = [chr(ord("A") + i) for i in range(len(d["choices"]))]
        out.append({"question_stem": d["query"], "choices": {"text": d["choices"], "label": labels},
                    "answerKey": labels[d["gold"]]})
    return out


def winogrande(path: Path) -> list[dict]:
    """llm-foundry's {"context_options": [S[:i] + option1, S[:i] + option2], "continuation", "gold"} ->
    winogrande's sentence, option1, option2, answer ("1" / "2"). S[:i] is the options' common beginning up to its
    last space; the sentence is S[:i] + "_ " + continuation, which gives lm-eval's choices and target exactly."""
    out = []
    for d in read_jsonl(path):
        a, b = d["context_options"]
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        i = a.rfind(" ", 0, i) + 1  # back to the start of the option's first word
        assert "_" not in a[:i], a
        out.append({"sentence": a[:i] + "_ " + d["continuation"], "option1": a[i:], "option2": b[i:],
                    "answer": str(d["gold"] + 1)})
    return out


def lambada(path: Path) -> list[dict]:
    """llm-foundry's {"context", "continuation": the last word} -> lambada_openai's text (joined by one space)."""
    out = []
    for d in read_jsonl(path):
        assert " " not in d["continuation"] and not d["context"].endswith(" "), d
        out.append({"text": d["context"] + " " + d["continuation"]})
    return out


def boolq(path: Path) -> list[dict]:
    """llm-foundry's {"query": "Passage: P\\nQuestion: Q?", "choices": [no, yes], "gold"} -> passage, question,
    label. The passages have no "Title -- " beginning, which lm-eval's (SuperGLUE) boolq has."""
    out = []
    for d in read_jsonl(path):
        body = d["query"]
        assert body.startswith("Passage: ") and body.endswith("?") and d["choices"] == ["no", "yes"], body[:40]
        passage, question = body[len("Passage: "):-1].rsplit("\nQuestion: ", 1)
        out.append({"passage": passage, "question": question, "label": d["gold"]})
    return out


def hellaswag_text(path: Path) -> list[dict]:
    """klosax's 6 lines a task (activity_label: ctx, label, 4 endings; its own cleaning of the WikiHow markers) ->
    query, choices (lm-eval's hellaswag preprocess applied on top), label."""
    from lm_eval.tasks.hellaswag.utils import preprocess  # lm-eval's own cleaning, not a copy of it

    lines = bz2.decompress(path.read_bytes()).decode("utf-8").split("\n")
    lines = lines[: len(lines) - len(lines) % 6]
    return [{"query": preprocess(lines[k]), "choices": [preprocess(e) for e in lines[k + 2:k + 6]],
             "label": int(lines[k + 1])} for k in range(0, len(lines), 6)]


def sample(items: list, size: int, seed: int) -> list:
    """``size`` items drawn with ``random.Random(seed)`` in their original order; all of them for size 0 or more."""
    if size <= 0 or size >= len(items):
        return items
    keep = sorted(random.Random(seed).sample(range(len(items)), size))
    return [items[i] for i in keep]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--piqa", type=Path, required=True)
    ap.add_argument("--foundry", type=Path, required=True)
    ap.add_argument("--hellaswag-text", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--size", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    f = args.foundry
    sources = {
        "arc_easy": lambda: arc(f / "world_knowledge/arc_easy.jsonl"),
        "arc_challenge": lambda: arc(f / "world_knowledge/arc_challenge.jsonl"),
        "openbookqa": lambda: openbookqa(f / "commonsense_reasoning/openbook_qa.jsonl"),
        "winogrande": lambda: winogrande(f / "language_understanding/winogrande.jsonl"),
        "lambada_openai": lambda: lambada(f / "language_understanding/lambada_openai.jsonl"),
        "boolq_notitle": lambda: boolq(f / "reading_comprehension/boolq.jsonl"),
        "piqa": lambda: piqa(args.piqa),
        "hellaswag_text": lambda: hellaswag_text(args.hellaswag_text),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for name, read in sources.items():
        items = read()
        kept = sample(items, args.size, args.seed)
        text = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in kept)
        (args.out / f"{name}.jsonl").write_text(text, encoding="utf-8")
        print(f"{name}: {len(kept)} of {len(items)} items, {len(text.encode()):,} bytes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
