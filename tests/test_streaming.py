"""--low-memory conversion (tlm_convert.streaming): the same output as the in-memory path, refusals, atomicity."""

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny_sources import DATA, make_source, tiny_tokenizer
from transformers import AutoModelForCausalLM

from tlm_convert import report, streaming
from tlm_convert.compensate import refit_down_proj
from tlm_convert.convert import ConvertOptions, convert
from tlm_convert.errors import ConversionError
from tlm_convert.importance import ActivationStats

# importance given: the default differs between the paths (obs in memory, activation with --low-memory)
OPTS = dict(calibration_data=str(DATA), calibration_tokens=512, seq_len=64, batch_size=4, multiple_of=1,
            importance="activation")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    tokenizer = tiny_tokenizer()
    root = tmp_path_factory.mktemp("sources")
    return {family: make_source(root / family, family, tokenizer=tokenizer) for family in ("llama", "gpt2")}


def _tensors(folder):
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _leftovers(parent, name):
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.tmp-")]


@pytest.mark.parametrize("family, extra, frugal", [
    ("llama", dict(eval_data=str(DATA), eval_tokens=192), None),  # small enough for the in-memory path's steps
    ("gpt2", dict(refit_target="residual"), "blocks"),  # the code paths of wide layers: blocked Gram, AᵀY and refit
    ("llama", dict(refit_target="local"), "hook"),  # ... and of calibration sets too large to keep the activations
    ("llama", dict(importance="obs", refit_target="residual"), None),  # OBS from the residual optimum D*
    ("gpt2", dict(importance="obs", refit_target="residual"), "hook"),
])
def test_low_memory_writes_the_in_memory_tensors(family, extra, frugal, sources, tmp_path, monkeypatch):
    src = sources[family]
    seen = []
    with monkeypatch.context() as patch:  # the reference's plot is not under test here (saves time)
        patch.setattr(report, "write_plot", lambda _report, path: path.write_bytes(b""))
        full = convert(str(src), str(tmp_path / "full"), ConvertOptions(**{**OPTS, **extra}))
    if frugal:  # forced on the tiny layers
        monkeypatch.setattr(streaming, "BLOCK_BYTES", 4096)
    if frugal == "hook":
        monkeypatch.setattr(streaming, "KEEP_ACTIVATIONS_BYTES", 0)
    low = convert(str(src), str(tmp_path / "low"), ConvertOptions(low_memory=True, **{**OPTS, **extra}),
                  on_layer=seen.append)
    assert seen == [0, 1, 2, 3]
    assert low["widths_after"] == full["widths_after"] == [72, 60, 36, 24]
    assert low["params_before"] == low["params_after"] == full["params_after"] == full["params_before"]
    a, b = _tensors(tmp_path / "full"), _tensors(tmp_path / "low")
    assert a.keys() == b.keys()
    # the same arithmetic up to fp32 summation order, which the refit's least-squares solve amplifies (damping 1e-3):
    # per tensor, max |Δ| <= 1e-4 of its largest entry (measured up to 1.1e-4 x 0.35 on the blocked gpt2 route)
    for k in a:
        assert float((a[k] - b[k]).abs().max()) <= 1e-6 + 2e-4 * float(a[k].abs().max()), k
    assert sum(t.numel() for t in b.values()) == low["params_before"]
    config = {p: json.loads((tmp_path / p / "config.json").read_text()) for p in ("full", "low")}
    assert config["low"] == config["full"]
    index = json.loads((tmp_path / "low" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(b)
    assert len(set(index["weight_map"].values())) == 6  # embeddings, one shard per layer, final norm (+ head)
    saved = json.loads((tmp_path / "low" / "conversion_report.json").read_text())
    assert saved["low_memory"] is True and saved["widths_after"] == full["widths_after"]
    for name in ("report.md", "tokenizer.json", "modeling_tlm.py", "configuration_tlm.py"):
        assert (tmp_path / "low" / name).is_file(), name
    assert (tmp_path / "low" / "widths.png").stat().st_size > 1000
    if "eval_data" in extra:
        for key in ("perplexity_before", "perplexity_after"):
            assert low[key] == pytest.approx(full[key], rel=1e-5)
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "low", trust_remote_code=True).eval()
        assert model.config.intermediate_sizes == [72, 60, 36, 24]
        assert sum(p.numel() for p in model.parameters()) == low["params_before"]
    assert not _leftovers(tmp_path, "low")


@pytest.mark.parametrize("change, message", [
    (dict(export="hf"), "writes --export tlm only \\(--export hf needs"),
    (dict(export="padded"), "drop --low-memory, or use --export tlm"),
    (dict(mixer="titans"), "titans mixer"),
    (dict(device="cuda"), "runs on the CPU; drop --device cuda or --low-memory"),
])
def test_unsupported_options_are_refused(change, message, sources, tmp_path):
    with pytest.raises(ConversionError, match=message):
        convert(str(sources["llama"]), str(tmp_path / "out"), ConvertOptions(low_memory=True, **{**OPTS, **change}))
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path, "out")


def test_sources_that_cannot_be_streamed_are_refused(sources, tmp_path):
    (tmp_path / "bin").mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "bin" / name).write_bytes((sources["llama"] / name).read_bytes())
    torch.save(load_file(sources["llama"] / "model.safetensors"), tmp_path / "bin" / "pytorch_model.bin")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    opts = ConvertOptions(low_memory=True, **OPTS)
    for source, message in ((tmp_path / "bin", "PyTorch .bin weights; --low-memory streams safetensors only"),
                            (gguf, "GGUF.*drop --low-memory"), ("someorg/somemodel", "not a local folder")):
        with pytest.raises(ConversionError, match=message):
            convert(str(source), str(tmp_path / "out"), opts)
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path, "out")


def test_output_is_atomic_when_a_layer_fails(sources, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("old output")

    def fail(layer):
        if layer == 1:
            raise RuntimeError("boom")

    opts = ConvertOptions(low_memory=True, overwrite=True, **OPTS)
    with pytest.raises(RuntimeError, match="boom"):
        convert(str(sources["llama"]), str(tmp_path / "out"), opts, on_layer=fail)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]  # the old output is untouched
    assert not _leftovers(tmp_path, "out")


def test_in_place_refit_matches_refit_down_proj(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    acts = torch.randn(300, 90, generator=gen, dtype=torch.float64)
    down = torch.randn(12, 90, generator=gen)
    keep = sorted(torch.randperm(90, generator=gen)[:50].tolist())
    monkeypatch.setattr(streaming, "BLOCK_BYTES", 8 * 150 * 7)  # 7 rows per block: every loop runs many times
    gram = acts.T @ acts
    expected = refit_down_proj(gram.clone(), down, keep)
    torch.testing.assert_close(streaming.refit_down_proj_inplace(gram.clone(), down, keep), expected, atol=1e-5,
                               rtol=1e-5)
    # another target (the residual one): AᵀY given whole or as its kept rows
    cross = acts.T @ torch.randn(300, 12, generator=gen, dtype=torch.float64)
    expected = refit_down_proj(gram.clone(), down, keep, cross=cross)
    for given in (dict(cross=cross), dict(rhs_t=cross[keep].T.contiguous())):
        torch.testing.assert_close(streaming.refit_down_proj_inplace(acts.T @ acts, down, keep, **given), expected,
                                   atol=1e-5, rtol=1e-5)
    # not positive definite even with damping: both fall back to the same least-squares solve
    indefinite = -torch.eye(90, dtype=torch.float64) + 0.01 * (acts.T @ acts) / 300
    expected = refit_down_proj(indefinite.clone(), down, keep)
    torch.testing.assert_close(streaming.refit_down_proj_inplace(indefinite, down, keep), expected, atol=1e-5,
                               rtol=1e-5)


def test_blocked_gram_matches_activation_stats(monkeypatch):
    monkeypatch.setattr(streaming, "BLOCK_BYTES", 12 * 37 * 5)  # 5 rows per block
    a = torch.randn(3, 11, 37, generator=torch.Generator().manual_seed(1))
    whole, blocked = ActivationStats(37, gram=True), streaming.BlockedGramStats(37, gram=True)
    for part in (a[:2], a[2:]):
        whole.update(part)
        blocked.update(part)
    for name in ("sum", "sumsq", "seq_abs_sq", "gram"):
        torch.testing.assert_close(getattr(blocked, name), getattr(whole, name), rtol=1e-6, atol=1e-5)
    assert blocked.tokens == whole.tokens == 33
