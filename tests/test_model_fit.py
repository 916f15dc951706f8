"""A tokenizer, a model and data that do not fit are refused before anything is written (issue 25): a tokenizer
with tokens the model's embeddings do not cover, a sequence longer than a source's positions, token ids beyond the
vocabulary in a token cache or a text; and what a conversion says about its source is that source's (issue 53:
a TLM's own widths when it is tapered again).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hostile_helpers import source  # noqa: F401 - fixture
from test_faults import FAST, _convert, _one_error_line, _tiny_recipe, _tlm, _write_recipe
from tiny_sources import DATA, make_source, tiny_tokenizer
# ============================================================================ a tokenizer, a model and data that do not fit


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory) -> Path:
    """A source whose model has 100 embeddings beside the 320-token tokenizer."""
    return make_source(tmp_path_factory.mktemp("vocab") / "small", "llama", tokenizer=tiny_tokenizer(), vocab_size=100)


@pytest.mark.parametrize("args", [["convert", "-o", "{tmp}/out", *FAST],
                                  ["convert", "-o", "{tmp}/out", *FAST[2:], "--calibration-data", "self"],
                                  ["eval", "--data", str(DATA), "--seq-len", "32", "--max-tokens", "64"],
                                  ["analyze", "--data", str(DATA), "--seq-len", "32", "--max-tokens", "64"]],
                         ids=["convert", "self-calibration", "eval", "analyze"])
def test_a_model_vocabulary_smaller_than_its_tokenizer_is_one_line(small_vocab, tmp_path, args):
    cmd, *rest = args
    line = _one_error_line(_tlm([cmd, small_vocab, *(a.replace("{tmp}", str(tmp_path)) for a in rest)]))
    assert "tokenizer.json" in line and "beyond the 100 embeddings" in line and "model's own tokenizer" in line, line
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    return make_source(tmp_path_factory.mktemp("gpt2") / "gpt2", "gpt2", tokenizer=tiny_tokenizer())  # n_positions 128


@pytest.mark.parametrize("cmd", ["convert", "eval"])
def test_a_sequence_longer_than_the_sources_positions_is_one_line(gpt2, tmp_path, cmd):
    args = (["-o", tmp_path / "out", *FAST[:4], "--seq-len", "256", "--calibration-tokens", "512"] if cmd == "convert"
            else ["--data", str(DATA), "--seq-len", "256"])
    line = _one_error_line(_tlm([cmd, gpt2, *args]))
    assert "--seq-len 256 is longer than the 128 positions" in line and "--seq-len 128 or less" in line, line
    assert not list(tmp_path.iterdir())


def test_a_token_cache_with_ids_beyond_the_vocabulary_is_refused_before_anything_is_written(tmp_path):
    import numpy as np

    recipe = _tiny_recipe(tmp_path)
    assert _tlm(["tokenize", _write_recipe(tmp_path, recipe)]).exit_code == 0
    (shard,) = (tmp_path / "cache").glob("*/shard-00000.bin")
    ids = np.fromfile(shard, dtype=np.uint16)
    ids[len(ids) // 2] = 300  # the byte tokenizer has 257 tokens
    ids.tofile(shard)
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress"]))
    assert "token cache" in line and str(shard.parent) in line and "token id 300" in line, line
    assert "delete that cache folder" in line, line
    assert not (tmp_path / "run").exists()  # no recipe.yaml, no marker: a new output_dir is not even created


def test_a_special_token_beyond_the_vocabulary_in_the_text_is_one_line(tmp_path):
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<big>"]})  # id 320: the model has 320 embeddings
    src = make_source(tmp_path / "src", "llama", tokenizer=tokenizer)
    text = tmp_path / "calib.txt"
    text.write_text(DATA.read_text().replace("\n", " <big>\n"))  # in every block the calibration takes
    line = _one_error_line(_convert([src, "-o", tmp_path / "out", *FAST[2:], "--calibration-data", text]))
    assert "the calibration data" in line and "token id 320" in line and "vocabulary of 320" in line, line
    assert not (tmp_path / "out").exists()


def test_a_recipe_tokenizer_larger_than_the_checkpoint_is_refused(small_vocab, source, tmp_path):
    recipe = _tiny_recipe(tmp_path, init_from=str(small_vocab), tokenizer=str(source))
    del recipe["model"]
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress"]))
    assert "beyond the 100 embeddings" in line and "set tokenizer:" in line, line
    assert not (tmp_path / "run").exists()


def test_a_training_sequence_longer_than_the_positions_is_refused(tmp_path):
    gpt2 = make_source(tmp_path / "gpt2", "gpt2", tokenizer=tiny_tokenizer())
    recipe = _tiny_recipe(tmp_path, init_from=str(gpt2), tokenizer=None, data={"seq_len": 256})
    del recipe["model"], recipe["tokenizer"]
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress"]))
    assert "data.seq_len 256 is longer than the 128 positions" in line, line
    assert not (tmp_path / "run").exists()



def test_re_tapering_a_tlm_shows_its_own_widths(source, tmp_path):
    """Issue case: re-tapering a TLM printed its source's widths as "80 x 4" (the first layer's width for all)."""
    res = _convert([source, "-o", tmp_path / "tlm", *FAST])
    assert res.exit_code == 0, res.output
    assert "widths: 48 x 4 -> 72 .. 24 (cosine)" in res.output, res.output  # a uniform source: width x layers
    res = _convert([tmp_path / "tlm", "-o", tmp_path / "again", *FAST, "--schedule", "linear", "--ratio", "1.2/0.8"])
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if ln.startswith("widths: "))
    assert line.startswith("widths: 72 .. 24 -> ") and "x 4" not in line, line
