"""Evaluation sets: the bundled texts match their recorded provenance, names resolve, plain text is sniffed, and the
report's out-of-domain geometric mean leaves the calibration-domain set out."""

import hashlib
import math
import re

import pytest

from tlm_convert.evalsets import perplexity_entries, perplexity_lines
from tlm_io.errors import ConversionError
from tlm_io.text import BUNDLED, DATA_DIR, EVAL_SETS, IN_DOMAIN, eval_sources, is_plain_text, load_text


def test_bundled_sets_match_the_sha256_in_the_data_readme():
    readme = (DATA_DIR / "README.md").read_text(encoding="utf-8")
    for name in ("default", *EVAL_SETS):
        path = BUNDLED[name]
        recorded = re.search(rf"{re.escape(path.name)} `([0-9a-f]{{64}})`", readme)
        assert recorded, f"no sha256 for {path.name} in data/README.md"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == recorded[1], path.name


def test_eval_sources_expand_all_eval_in_order_without_repeats():
    assert eval_sources(None) == eval_sources(()) == []
    assert eval_sources("x.txt") == ["x.txt"]
    assert eval_sources(("eval-code", "all-eval")) == ["eval-code", "default-eval", "eval-fiction", "eval-legal",
                                                       "eval-encyclopedic"]
    assert set(IN_DOMAIN) <= set(EVAL_SETS)


def test_plain_text_is_sniffed_whatever_the_suffix(tmp_path):
    raw, blob, jsonl = tmp_path / "wiki.test.raw", tmp_path / "x.raw", tmp_path / "a.jsonl"
    raw.write_text(" = Valkyria = \n\n naïve café " * 5000, encoding="utf-8")  # > 64 KiB: a character may be cut
    blob.write_bytes(b"text\0with a NUL byte")
    jsonl.write_text("plain words", encoding="utf-8")
    assert is_plain_text(raw) and not is_plain_text(blob) and not is_plain_text(jsonl)
    assert is_plain_text(jsonl, "text") and not is_plain_text(tmp_path / "missing.raw")
    assert load_text(raw) == raw.read_text(encoding="utf-8")
    with pytest.raises(ConversionError, match="data format 'csv' is unknown"):
        is_plain_text(raw, "csv")


def test_geometric_mean_is_over_the_out_of_domain_sets_only():
    before = {"default-eval": 10.0, "eval-fiction": 20.0, "eval-code": 5.0}
    after = {"default-eval": 30.0, "eval-fiction": 40.0, "eval-code": 40.0}
    entries = perplexity_entries(before, after)
    assert [s["ratio"] for s in entries["perplexity_sets"]] == [3.0, 2.0, 8.0]
    assert entries["perplexity_ratio"] == 3.0 and entries["perplexity_before"] == 10.0  # the first set
    assert entries["perplexity_ratio_ood_geomean"] == pytest.approx(math.sqrt(2.0 * 8.0))
    lines = perplexity_lines(entries)
    assert lines[0] == "on default-eval (calibration domain): 10.000 before, 30.000 after (x3.000)"
    assert lines[-1] == "ratio x4.000, geometric mean over the 2 out-of-domain sets"
    only_in_domain = perplexity_entries({"default-eval": 1.0}, {"default-eval": 2.0})
    assert "perplexity_ratio_ood_geomean" not in only_in_domain and len(perplexity_lines(only_in_domain)) == 1
    own = perplexity_entries(before, after, calibration_data="my_corpus.txt")  # default-eval is out of its domain
    assert not any(s["in_domain"] for s in own["perplexity_sets"])
    assert own["perplexity_ratio_ood_geomean"] == pytest.approx((3.0 * 2.0 * 8.0) ** (1 / 3))
    itself = perplexity_entries(before, after, calibration_data="eval-code")  # calibrated on the set it measures
    assert [s["in_domain"] for s in itself["perplexity_sets"]] == [False, False, True]
