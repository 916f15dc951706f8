"""Residual alignment ρ_MLP (tlm_study.analyze, design/model.md §3.5): hooks against a by-hand forward, constructed
parallel / antiparallel / orthogonal writes, position 0 excluded, Pearson r, hook cleanup, and ``tlm analyze``."""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn
from transformers import AutoModelForCausalLM

from tlm_cli.main import tlm_main
from tlm_study.analyze import (
    AlignmentResult,
    AnalysisError,
    ReferenceStats,
    pearson_r,
    residual_alignment,
    save_alignment,
    suggest_ratio,
)

from conftest import make_model
from tiny_sources import DATA, FAMILIES, make_source, tiny_tokenizer

N = 12


@pytest.fixture
def tokens():
    return torch.randint(0, 99, (3, N), generator=torch.Generator().manual_seed(3))


def _causal(n):
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


def _manual_stats(records):
    """records: per layer (h, z, f) of shape (B, N, d) -> per layer (mean_h, median_h, mean_z, median_z)."""
    out = []
    for h, z, f in records:
        ch = F.cosine_similarity(f[:, 1:], h[:, 1:], dim=-1).flatten().double().numpy()
        cz = F.cosine_similarity(f[:, 1:], z[:, 1:], dim=-1).flatten().double().numpy()
        out.append((ch.mean(), np.median(ch), cz.mean(), np.median(cz)))
    return out


def _manual_tlm(model, ids):
    body = model.model
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    h = body.embed(body.embed_tokens(ids), pos)
    rope, masks = body.block_context(h, pos)
    records = []
    for layer in body.layers:
        z = layer.mix(h, rope.get(layer.layer_type), masks[layer.layer_type], None)
        x = layer.post_attention_layernorm(z)
        f = layer.mlp(x, None, use_cache=False)[0] if layer.mlp.__class__.__name__ == "ContinuumMemory" else layer.mlp(x)
        if layer.sandwich:
            f = layer.post_feedforward_layernorm(f)
        records.append((h, z, f))
        h = z + f
    torch.testing.assert_close(body.norm(h), body(ids, use_cache=False).last_hidden_state, rtol=0, atol=1e-5)
    return records


def _manual_llama(model, ids):
    body = model.model
    h = body.embed_tokens(ids)
    rope = body.rotary_emb(h, torch.arange(ids.shape[1])[None])
    records = []
    for layer in body.layers:
        a, _ = layer.self_attn(hidden_states=layer.input_layernorm(h), position_embeddings=rope,
                               attention_mask=_causal(ids.shape[1]))
        z = h + a
        f = layer.mlp(layer.post_attention_layernorm(z))
        records.append((h, z, f))
        h = z + f
    torch.testing.assert_close(body.norm(h), body(ids).last_hidden_state, rtol=0, atol=1e-5)
    return records


def _manual_gpt2(model, ids):
    body = model.transformer
    h = body.wte(ids) + body.wpe(torch.arange(ids.shape[1])[None])
    records = []
    for layer in body.h:
        a = layer.attn(layer.ln_1(h), attention_mask=_causal(ids.shape[1]))[0]
        z = h + a
        f = layer.mlp(layer.ln_2(z))
        records.append((h, z, f))
        h = z + f
    torch.testing.assert_close(body.ln_f(h), body(ids).last_hidden_state, rtol=0, atol=1e-5)
    return records


def _assert_matches(result: AlignmentResult, manual, ids):
    assert result.n_tokens == ids.shape[0] * (ids.shape[1] - 1)
    assert result.num_layers == len(manual)
    for i, (mh, medh, mz, medz) in enumerate(manual):
        assert result.h.mean[i] == pytest.approx(mh, abs=1e-5)
        assert result.h.median[i] == pytest.approx(medh, abs=1e-5)
        assert result.z.mean[i] == pytest.approx(mz, abs=1e-5)
        assert result.z.median[i] == pytest.approx(medz, abs=1e-5)
    assert any(abs(a - b) > 1e-3 for a, b in zip(result.h.mean, result.z.mean))  # the two references differ


# ============================================================================================ hooks vs by hand


@pytest.mark.parametrize("mixer,overrides", [("attention", {}), ("hope_attention", {}),
                                             ("attention", {"sandwich_norm": True, "norm_offset": True})])
def test_tlm_hooks_match_a_forward_by_hand(mixer, overrides, tokens):
    model = make_model(mixer, **overrides)
    with torch.no_grad():
        manual = _manual_stats(_manual_tlm(model, tokens))
    result = residual_alignment(model, tokens, batch_size=2)  # two batches
    _assert_matches(result, manual, tokens)
    assert result.choices["architecture"] == "tlm" and result.choices["positions"].startswith("first real token")
    if overrides.get("sandwich_norm"):
        assert result.choices["f_modules"][0] == "model.layers.0.post_feedforward_layernorm (output)"
    if mixer == "hope_attention":
        assert "CMS" in result.choices["f_kinds"][0]


@pytest.mark.parametrize("family,manual_fn", [("llama", _manual_llama), ("gpt2", _manual_gpt2)])
def test_transformers_hooks_match_a_forward_by_hand(family, manual_fn, tokens):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](), dtype=torch.float32).eval()
    with torch.no_grad():
        manual = _manual_stats(manual_fn(model, tokens))
    result = residual_alignment(model, tokens, batch_size=8)
    _assert_matches(result, manual, tokens)
    assert result.choices["z_modules"][0] == ("transformer.h.0.ln_2 (input)" if family == "gpt2"
                                              else "model.layers.0.post_attention_layernorm (input)")


def test_gemma3_uses_the_pre_feedforward_norm_and_the_residual_write(tokens):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES["gemma3_text"](), dtype=torch.float32).eval()
    result = residual_alignment(model, tokens)  # the built-in z + F == layer output check passes
    assert result.choices["z_modules"][1] == "model.layers.1.pre_feedforward_layernorm (input)"
    assert result.choices["f_modules"][1] == "model.layers.1.post_feedforward_layernorm (output)"


# ============================================================================================ constructed cases


class _Scale(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c

    def forward(self, x):
        return self.c * x


class _Rotate(nn.Module):
    """(x0, x1) -> (-x1, x0) per channel pair: orthogonal to the input, token by token."""

    def forward(self, x):
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((-b, a), -1).flatten(-2)


class _SignByPosition(nn.Module):
    """+x at position 0, -x elsewhere: ρ is exactly -1 only if position 0 is excluded."""

    def forward(self, x):
        out = -x
        out[:, 0] = x[:, 0]
        return out


def _constructed(model, layer, mlp, mixer_off=True):
    block = model.model.layers[layer]
    with torch.no_grad():
        block.post_attention_layernorm.weight.fill_(1.0)  # norm(z) parallel to z
        if mixer_off:
            block.self_attn.o_proj.weight.zero_()  # z = h
    block.mlp = mlp


def test_parallel_antiparallel_and_orthogonal_writes(tokens):
    model = make_model("attention", num_hidden_layers=4)
    _constructed(model, 0, _Scale(2.0))  # F = c h: rho_h = rho_z = 1
    _constructed(model, 1, _Rotate(), mixer_off=False)  # F orthogonal to z (the mixer stays on)
    _constructed(model, 2, _Scale(-0.5))  # antiparallel: -1
    result = residual_alignment(model, tokens)
    for stats in (result.h, result.z):
        assert stats.mean[0] == pytest.approx(1.0, abs=1e-5) and stats.median[0] == pytest.approx(1.0, abs=1e-5)
        assert stats.mean[2] == pytest.approx(-1.0, abs=1e-5) and stats.median[2] == pytest.approx(-1.0, abs=1e-5)
        assert abs(stats.mean[3]) < 0.9  # the untouched random layer
    assert result.z.mean[1] == pytest.approx(0.0, abs=1e-5) and result.z.median[1] == pytest.approx(0.0, abs=1e-5)


def test_position_zero_is_excluded_and_padding_masked(tokens):
    model = make_model("attention")
    _constructed(model, 1, _SignByPosition())
    result = residual_alignment(model, tokens)
    assert result.h.mean[1] == pytest.approx(-1.0, abs=1e-5) and result.z.mean[1] == pytest.approx(-1.0, abs=1e-5)
    mask = torch.ones_like(tokens)
    mask[0, :3] = 0  # left padding: 3 pads, then the first real token is also excluded
    padded = residual_alignment(model, tokens, attention_mask=mask)
    assert padded.n_tokens == tokens.numel() - tokens.shape[0] - 3


# ============================================================================================ Pearson r, heuristic


def test_pearson_r_matches_numpy_corrcoef(tokens):
    rng = np.random.default_rng(0)
    for _ in range(5):
        x, y = rng.normal(size=7), rng.normal(size=7)
        assert pearson_r(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1], abs=1e-12)
    assert pearson_r([0, 1, 2], [3.0, 3.0, 3.0]) is None and pearson_r([0], [1.0]) is None
    assert pearson_r([0, 1, 2, 3], [0.1, 0.2, 0.3, 0.4]) == pytest.approx(1.0)
    result = residual_alignment(make_model("attention", num_hidden_layers=4), tokens)
    depth = np.arange(result.num_layers)
    for stats in (result.h, result.z):
        assert stats.pearson_r == pytest.approx(np.corrcoef(depth, stats.mean)[0, 1], abs=1e-9)
        assert stats.pearson_r_median == pytest.approx(np.corrcoef(depth, stats.median)[0, 1], abs=1e-9)
    assert json.loads(json.dumps(result.to_dict(), allow_nan=False))["h"]["mean"] == result.h.mean


def _profile(values):
    depth = list(range(len(values)))
    stats = ReferenceStats("h", list(values), list(values), pearson_r(depth, values), pearson_r(depth, values))
    return AlignmentResult(len(values), stats, stats, 10, 1, 11)


def test_suggest_ratio_heuristic():
    rising = suggest_ratio(_profile(np.linspace(0.0, 0.5, 8)))  # rise of 0.5 -> the paper's 1.5/0.5
    assert (rising.first, rising.last, rising.ratio) == (1.5, 0.5, "1.5/0.5") and "heuristic" in rising.heuristic
    assert suggest_ratio(_profile(np.linspace(0.0, 0.2, 8))).ratio == "1.2/0.8"
    assert suggest_ratio(_profile(np.linspace(0.5, 0.0, 8))).ratio == "1/1"  # falling: keep uniform
    assert suggest_ratio(_profile(np.linspace(0.0, 3.0, 8))).ratio == "1.75/0.25"  # capped at max_delta


# ============================================================================================ hook hygiene


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


class _Boom(nn.Module):
    def forward(self, x):
        raise RuntimeError("boom")


def test_hooks_are_removed_and_training_flag_restored(tokens):
    model = make_model("attention")
    model.train()
    before = _hook_count(model)
    residual_alignment(model, tokens)
    assert _hook_count(model) == before and model.training
    model.model.layers[1].mlp = _Boom()
    with pytest.raises(RuntimeError, match="boom"):
        residual_alignment(model, tokens)
    assert _hook_count(model) == before and model.training


def test_a_block_that_is_not_z_plus_f_is_refused(tokens):
    model = make_model("attention")
    handle = model.model.layers[1].register_forward_hook(lambda m, a, out: out * 2)  # output != z + F
    before = _hook_count(model)
    with pytest.raises(AnalysisError, match="layer 1: the layer output is not z_l"):
        residual_alignment(model, tokens)
    assert _hook_count(model) == before
    handle.remove()
    with pytest.raises(AnalysisError, match="no decoder layers"):
        residual_alignment(nn.Linear(2, 2), tokens)


def test_save_alignment_writes_json_and_png(tmp_path, tokens):
    result = residual_alignment(make_model("attention"), tokens)
    json_path, png_path = save_alignment(result, tmp_path / "a" / "b", extra={"model": "tiny"})
    assert json.loads(json_path.read_text())["model"] == "tiny"
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in json_path.parent.iterdir()) == ["alignment.json", "alignment.png"]


# ============================================================================================ CLI


def _run(args):
    kwargs = {"mix_stderr": False} if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters else {}
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return CliRunner(**kwargs).invoke(tlm_main, [str(a) for a in args], env=env, prog_name="tlm")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_source(tmp_path_factory.mktemp("analyze") / "llama", "llama", tokenizer=tiny_tokenizer())


def test_cli_analyze_prints_json_and_writes_files(source, tmp_path):
    args = ["analyze", source, "--data", DATA, "--seq-len", "32", "--max-tokens", "128", "--batch-size", "2"]
    result = _run(args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["tokens"] == 128 and report["seq_len"] == 32 and report["n_tokens"] == 4 * 31
    assert len(report["h"]["mean"]) == len(report["z"]["mean"]) == 4
    assert all(-1 <= v <= 1 for v in report["h"]["mean"] + report["z"]["median"])
    assert report["choices"]["data"] == str(DATA) and "heuristic" in report["heuristic_ratio_suggestion"]["note"]

    out = tmp_path / "align"
    result = _run([*args, "-o", out])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "alignment.json").read_text())
    assert saved["h"]["mean"] == pytest.approx(report["h"]["mean"], abs=1e-6)
    assert (out / "alignment.png").read_bytes()[:4] == b"\x89PNG"
    lines = result.stdout.splitlines()
    assert lines[0].startswith("wrote ") and lines[-1].startswith("pearson r(depth, rho): h ")
    assert not list(out.glob(".*tmp-*"))


@pytest.mark.parametrize("case", ["missing", "bad_option"])
def test_cli_analyze_refusals_are_one_line(case, source, tmp_path):
    if case == "missing":
        result = _run(["analyze", tmp_path / "nope", "--data", DATA])
    else:
        result = _run(["analyze", source, "--data", DATA, "--batch-size", "0"])
    text = result.stdout + result.stderr
    assert result.exit_code not in (0, None) and "Traceback" not in text and result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert math.isfinite(result.exit_code)
