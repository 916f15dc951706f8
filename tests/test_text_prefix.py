"""Blocks begin as the tokenizer begins a text: a tokenizer that puts <bos> before every text (Gemma's) gets it at
position 0 of every calibration, evaluation, sampled and training block and before every strided window; one that
adds nothing (GPT-2, SmolLM2, the byte tokenizer) gets the blocks it always had."""

import json

import pytest
import torch
from tiny_sources import DATA, make_source, tiny_tokenizer

from conftest import make_model
from test_token_pipeline import record_batches
from test_train import tiny_recipe
from tlm_convert.convert import convert
from tlm_convert.options import ConvertOptions, Method
from tlm_convert.samples import calibration_blocks, sample_blocks, samples_text
from tlm_io.checkpoint import load_source
from tlm_io.errors import ConversionError
from tlm_io.load import byte_tokenizer, materialize
from tlm_io.perplexity import perplexity, strided_perplexity
from tlm_io.text import load_text, text_prefix, to_blocks, token_blocks
from tlm_train.recipe import recipe_from_dict
from tlm_train.shards import TokenBlocks
from tlm_train.trainer import train

BOS = 1  # tiny_tokenizer(bos=True)'s <bos>


@pytest.fixture(scope="module")
def bos_tokenizer():
    return tiny_tokenizer(bos=True)


def test_the_prefix_is_what_encoding_puts_before_a_text(bos_tokenizer):
    assert text_prefix(bos_tokenizer) == (BOS,) and bos_tokenizer("ab")["input_ids"][0] == BOS
    assert text_prefix(tiny_tokenizer()) == () and text_prefix(byte_tokenizer()) == () and text_prefix(None) == ()


def test_text_blocks_begin_with_the_prefix_and_hold_the_text_in_order(bos_tokenizer):
    text = load_text(str(DATA))
    ids = bos_tokenizer(text, add_special_tokens=False)["input_ids"]
    blocks = token_blocks(bos_tokenizer, text, 16, 64, what="evaluation")  # (4, 16): <bos> + 15 text tokens each
    assert blocks.shape == (4, 16) and (blocks[:, 0] == BOS).all()
    assert blocks[:, 1:].flatten().tolist() == ids[:60]
    plain = token_blocks(tiny_tokenizer(), text, 16, 64, what="evaluation")  # no prefix: as before
    assert plain.flatten().tolist() == tiny_tokenizer()(text, add_special_tokens=False)["input_ids"][:64]
    with pytest.raises(ConversionError, match="too short for the tokenizer's 1-token start of text"):
        token_blocks(bos_tokenizer, text, 2, 64)


def test_token_blocks_of_the_training_stream_match_the_text_blocks():
    class Stream:  # the TokenShards interface TokenBlocks reads
        def __init__(self, ids):
            self.ids = ids

        def __len__(self):
            return len(self.ids)

        def read(self, start, stop=None):
            return self.ids[start:stop]

    ids = torch.arange(2, 103, dtype=torch.int32).numpy()
    blocks = TokenBlocks(Stream(ids), 8, stop=100, prefix=(BOS,))  # 7 stream tokens a block
    assert len(blocks) == 14
    assert torch.equal(blocks.all(), to_blocks(torch.from_numpy(ids[:100]), 8, (BOS,)))
    assert torch.equal(blocks[[3, 0]], blocks.all()[[3, 0]]) and blocks[[1]][0].tolist() == [BOS, *range(9, 16)]
    assert torch.equal(TokenBlocks(Stream(ids), 8).all(), to_blocks(torch.from_numpy(ids), 8))


def test_strided_windows_with_the_prefix_score_what_prefixed_blocks_score():
    """Disjoint windows of <bos> + 7 tokens score every token of the stream, the first included, with the context a
    block gives it: the same loss as perplexity() over the prefixed blocks."""
    model = make_model()
    ids = torch.randint(2, 99, (42,), generator=torch.Generator().manual_seed(0))
    got = strided_perplexity(model, ids, window=8, stride=8, batch_size=3, prefix=(BOS,))  # stride capped at 7
    assert got.tokens == 42 and got.windows == 6
    assert got.perplexity == pytest.approx(perplexity(model, to_blocks(ids, 8, (BOS,))), rel=1e-5)
    overlapping = strided_perplexity(model, ids, window=8, stride=3, prefix=(BOS,))
    assert overlapping.tokens == 42 and overlapping.perplexity < got.perplexity * 1.5


@pytest.fixture(scope="module")
def bos_source(tmp_path_factory, bos_tokenizer):
    return make_source(tmp_path_factory.mktemp("bos"), "llama", tokenizer=bos_tokenizer)


@pytest.fixture(scope="module")
def bos_model(bos_source):
    src = load_source(str(bos_source), dtype=torch.float32)
    return materialize(src.tlm_config, src.state_dict).eval()


def test_samples_keep_the_prefix_and_their_text_leaves_it_out(bos_model, bos_tokenizer):
    samples = sample_blocks(bos_model, bos_tokenizer, 3, 12, seed=0, batch_size=2)
    assert samples.shape == (3, 12) and (samples[:, 0] == BOS).all() and not (samples[:, 1:] == BOS).any()
    text = samples_text(bos_tokenizer, samples)
    assert "<bos>" not in text
    blocks, sampled = calibration_blocks(bos_tokenizer, (str(DATA), "self"), 12, 48, model=bos_model)
    assert (blocks[:, 0] == BOS).all() and torch.equal(blocks[2:], sampled)


def test_training_and_held_out_blocks_begin_with_the_prefix(tmp_path, monkeypatch, bos_tokenizer):
    seen = record_batches(monkeypatch)
    recipe = tiny_recipe(tmp_path, train={"max_steps": 2}, log={"eval_every": 2, "save_every": 2})
    train(recipe_from_dict(recipe), model=make_model(vocab_size=len(bos_tokenizer)).train(), tokenizer=bos_tokenizer)
    assert seen and all((ids[:, 0] == BOS).all() and not (ids[:, 1:] == BOS).any() for ids in seen)


def test_a_conversion_says_what_its_blocks_begin_with(bos_source, tmp_path):
    """(The heal trains through train(), whose blocks are checked above.)"""
    out = tmp_path / "out"
    report = convert(str(bos_source), str(out), ConvertOptions(calibration_data=(str(DATA),), eval_data=str(DATA),
                                                               calibration_tokens=1024, seq_len=64, batch_size=4,
                                                               method=Method(multiple_of=1)))
    assert report["block_prefix"] == [BOS] and report["calibration_tokens"] == 1024
    assert "each beginning with the tokenizer's start of text (ids [1])" in (out / "report.md").read_text()


def test_tlm_eval_puts_the_prefix_before_every_window(bos_source):
    from click.testing import CliRunner

    from tlm_cli.main import tlm_main

    result = CliRunner().invoke(tlm_main, ["eval", str(bos_source), "--data", str(DATA), "--seq-len", "16",
                                           "--stride", "16", "--max-tokens", "60"])
    assert result.exit_code == 0, result.output
    line = json.loads(result.stdout)
    assert line["window_prefix"] == [BOS] and line["stride"] == 15  # disjoint windows of <bos> + 15 tokens
    assert line["scored_tokens"] == 60 and line["windows"] == 4
    too_short = CliRunner().invoke(tlm_main, ["eval", str(bos_source), "--data", str(DATA), "--seq-len", "2"])
    assert too_short.exit_code != 0 and "too short for the tokenizer's 1-token start of text" in too_short.output
