"""The conversion pipeline on tiny checkpoints: exact import, parameter parity, surgery and upcycling invariants."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from tiny_sources import DATA, FAMILIES, WIDTH, make_source, source_logits, tiny_tokenizer
from transformers import AutoModelForCausalLM

import tlm
from tlm_convert import convert as convert_module
from tlm_convert.calibrate import LayerSettings, ModelLayers, convert_layers
from tlm_convert.convert import convert
from tlm_convert.importance import ActivationStats, StopForward, activation_stats
from tlm_convert.options import ConvertOptions, Method
from tlm_convert.surgery import LayerPlan, plan_from_scores, resize_layer
from tlm_convert.upcycle import upcycle
from tlm_io.checkpoint import load_source

OPTS = dict(calibration_data=str(DATA), calibration_tokens=1024, seq_len=64, batch_size=4,
            method=Method(multiple_of=1))


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(3))


def resize_mlp(config, state, plans, grow_init):
    """Every layer of (config, state) resized by its plan (surgery.resize_layer), as the layer loop does."""
    state = dict(state)
    for i, plan in enumerate(plans):
        state.update(resize_layer(state, i, plan, grow_init, gated=config.mlp_gated))
    config = copy.deepcopy(config)
    config.intermediate_sizes = [p.width for p in plans]
    return config, state


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_uniform_conversion_is_exact(family, tmp_path, tokenizer, ids):
    src = make_source(tmp_path / "src", family, tokenizer=tokenizer)
    report = convert(str(src), str(tmp_path / "out"), ConvertOptions(schedule="uniform", **OPTS))
    assert report["widths_after"] == report["widths_before"] == [WIDTH] * 4
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert (_logits(out, ids) - source_logits(src, ids)).abs().max() <= 1e-4


def test_the_library_takes_a_built_in_name_as_the_cli_does(tmp_path, tokenizer, monkeypatch):
    """convert("smollm2-135m", ...) in-process (bench/gpu_check.py's call) finds the GGUF its package ships."""
    import importlib.machinery
    import sys
    import types

    from tlm_io import locate

    src = make_source(tmp_path / "pkg" / "weights", "llama", tokenizer=tokenizer)
    package = types.ModuleType("tiny_builtin_pkg")
    package.__spec__ = importlib.machinery.ModuleSpec("tiny_builtin_pkg", None, origin=str(src.parent / "__init__.py"))
    monkeypatch.setitem(sys.modules, "tiny_builtin_pkg", package)
    monkeypatch.setitem(locate.BUILTIN_SOURCES, "tiny-builtin", ("tiny_builtin_pkg", src.name))
    report = convert("tiny-builtin", str(tmp_path / "out"), ConvertOptions(schedule="uniform", **OPTS))
    assert report["source"] == str(src)

@pytest.mark.parametrize("low_memory", [False, True])
def test_uniform_import_skips_calibration_and_writes_the_same_tensors(low_memory, tmp_path, tokenizer, ids,
                                                                      monkeypatch):
    """Nothing resized, no scores needed: no calibration token runs (the calibration data is not even read), and
    the output equals the one the full layer loop writes (forced by making the mixer one that needs scores), which
    equals the source's logits."""
    src = make_source(tmp_path / "src", "llama", tokenizer=tokenizer)
    opts = {**OPTS, "schedule": "uniform", "low_memory": low_memory}
    fast = convert(str(src), str(tmp_path / "fast"), ConvertOptions(**{**opts, "calibration_data": "missing.txt"}))
    monkeypatch.setattr(convert_module, "SCORED_MIXERS", ("attention",))
    full = convert(str(src), str(tmp_path / "full"), ConvertOptions(**opts))
    assert fast["calibration_tokens"] == 0 and fast["importance_profile"] is None
    assert full["calibration_tokens"] == 1024 and len(full["importance_profile"]) == 4
    assert "- calibration: none (an exact import" in (tmp_path / "fast" / "report.md").read_text()
    a, b = _tensors(tmp_path / "fast"), _tensors(tmp_path / "full")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "fast").eval()
    assert (_logits(out, ids) - source_logits(src, ids)).abs().max() <= 1e-4


def _tensors(folder):
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_cosine_conversion_keeps_parameter_count(family, tmp_path, tokenizer, ids):
    src = make_source(tmp_path / "src", family, tokenizer=tokenizer)
    before = tuple(p.numel() for p in AutoModelForCausalLM.from_pretrained(src).parameters())
    report = convert(str(src), str(tmp_path / "out"),
                     ConvertOptions(eval_data=str(DATA), eval_tokens=512, **OPTS))
    assert report["widths_after"] == [72, 60, 36, 24]
    assert report["params_after"] == report["params_before"] == sum(before)
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    assert sum(p.numel() for p in out.parameters()) == sum(before)
    assert out.config.intermediate_sizes == [72, 60, 36, 24]
    saved = json.loads((tmp_path / "out" / "conversion_report.json").read_text())
    for key in ("source", "family", "schedule", "ratio", "widths_before", "widths_after", "params_before",
                "params_after", "importance", "calibration_tokens", "seconds", "peak_rss_mb",
                "perplexity_before", "perplexity_after"):
        assert key in saved, key
    assert (tmp_path / "out" / "widths.png").stat().st_size > 1000
    assert (tmp_path / "out" / "report.md").exists()
    assert (tmp_path / "out" / "tokenizer.json").exists()
    assert torch.isfinite(_logits(out, ids)).all()


def test_grow_only_with_zero_init_reproduces_source(tmp_path, tokenizer, ids):
    src = load_source(str(make_source(tmp_path / "src", "llama", tokenizer=tokenizer)))
    plans = [LayerPlan(keep=list(range(WIDTH)), grow=g) for g in (5, 11, 0, 3)]
    config, state = resize_mlp(src.tlm_config, src.state_dict, plans, grow_init="zero")
    grown = tlm.TLMForCausalLM(config).eval()
    grown.load_state_dict(state, strict=True)
    torch.testing.assert_close(_logits(grown, ids), source_logits(tmp_path / "src", ids), atol=1e-5, rtol=0)


def test_split_growth_is_exact_and_pruning_to_same_width_is_identity(tmp_path, tokenizer, ids):
    src = load_source(str(make_source(tmp_path / "src", "gpt2", tokenizer=tokenizer)))
    scores = [torch.rand(WIDTH, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    plans = plan_from_scores(scores, [WIDTH + 7, WIDTH, WIDTH + 50, WIDTH])
    config, state = resize_mlp(src.tlm_config, src.state_dict, plans, grow_init="split")
    grown = tlm.TLMForCausalLM(config).eval()
    grown.load_state_dict(state, strict=True)
    torch.testing.assert_close(_logits(grown, ids), source_logits(tmp_path / "src", ids), atol=1e-5, rtol=0)


def test_hook_statistics_accumulate_over_batches():
    a = torch.randn(6, 10, 7, generator=torch.Generator().manual_seed(0))
    whole, parts, single = ActivationStats(7, gram=True), ActivationStats(7, gram=True), ActivationStats(7, gram=True)
    whole.update(a)
    parts.update(a[:2])
    parts.update(a[2:])
    for row in a:
        single.update(row[None])
    for other in (parts, single):
        for name in ("sum", "sumsq", "seq_abs_sq", "gram"):
            torch.testing.assert_close(getattr(other, name), getattr(whole, name), rtol=1e-6, atol=1e-5)
        assert other.tokens == whole.tokens == 60


def test_the_statistics_live_on_the_layers_device():
    """The fp64 sums follow the weights (a conversion on --device cuda adds CUDA activations to them)."""
    down = torch.nn.Linear(6, 4, device="meta")
    with activation_stats(down, gram=True) as stats:
        pass
    assert {stats.sum.device.type, stats.sumsq.device.type, stats.gram.device.type} == {"meta"}


def test_stopping_hook_records_the_first_columns_and_stops():
    linear = torch.nn.Linear(5, 3)
    x = torch.randn(2, 4, 5)
    with activation_stats(linear, keep=True, columns=3, stop=True) as stats:
        with pytest.raises(StopForward):
            linear(x)
    assert stats.tokens == 8 and torch.equal(stats.kept[0], x[..., :3])
    torch.testing.assert_close(stats.sum, x[..., :3].sum((0, 1)).double())
    assert not linear._forward_pre_hooks


def test_hooks_are_removed_when_a_batch_fails():
    linear = torch.nn.Linear(5, 3)
    with pytest.raises(RuntimeError), activation_stats(linear) as stats:
        linear(torch.randn(1, 2, 5))
        raise RuntimeError("boom")
    assert stats.tokens == 2
    assert not linear._forward_pre_hooks


def test_refit_lowers_the_layer_reconstruction_error(tmp_path, tokenizer):
    src = load_source(str(make_source(tmp_path / "src", "llama", tokenizer=tokenizer)))
    text = DATA.read_text()
    blocks = torch.tensor(tokenizer(text)["input_ids"][: 16 * 64]).view(16, 64)
    errors = {}
    for refit in (False, True):
        model = tlm.TLMForCausalLM(src.tlm_config).eval()
        model.load_state_dict(src.state_dict)
        reference = tlm.TLMForCausalLM(src.tlm_config).eval()
        reference.load_state_dict(src.state_dict)
        convert_layers(model.model, ModelLayers(model), blocks, [72, 60, 36, 24],
                       LayerSettings(Method(importance="activation", refit_target="local", refit=refit), 8, 0))
        errors[refit] = float((_logits(model, blocks[:8]) - _logits(reference, blocks[:8])).pow(2).mean())
    assert errors[True] < errors[False]


@pytest.mark.parametrize("mixer", ["gated_attention", "titans", "hope_attention"])
def test_upcycling_preserves_logits(mixer, tmp_path, tokenizer, ids):
    src = load_source(str(make_source(tmp_path / "src", "llama", tokenizer=tokenizer)))
    scores = [torch.rand(WIDTH, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    config, state = upcycle(src.tlm_config, src.state_dict, mixer, scores)
    model = tlm.TLMForCausalLM(config).eval()
    model.load_state_dict({k: v for k, v in state.items() if k != "lm_head.weight"}, strict=False)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    assert set(model.config.mixer) == {mixer}
    torch.testing.assert_close(_logits(model, ids), source_logits(tmp_path / "src", ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family, importance, grow_init, refit_target", [
    ("gemma3_text", "wanda_sp", "noise", "local"),
    ("gpt2", "wanda_sp", "noise", "local"),
    ("llama", "activation", "noise", "residual"),
    ("llama", "obs", "split", "local"),  # split growth: scores first, then resize and a second pass
    ("llama", "obs", "noise", "residual"),
    ("llama", "magnitude", "zero", "residual"),
])
def test_carried_activations_match_the_converted_model(family, importance, grow_init, refit_target, tmp_path,
                                                       tokenizer):
    # the calibration carries each layer's output from recorded activations (shrinking layers) or from a pass
    # through the already-resized layer (growing ones); the result must be the converted model's own forward
    src = load_source(str(make_source(tmp_path / "src", family, tokenizer=tokenizer)))
    blocks = torch.tensor(tokenizer(DATA.read_text())["input_ids"][: 8 * 32]).view(8, 32)
    model = tlm.TLMForCausalLM(src.tlm_config).eval()
    model.load_state_dict(src.state_dict)
    settings = LayerSettings(Method(importance=importance, grow_init=grow_init, refit_target=refit_target), 4, 0)
    result = convert_layers(model.model, ModelLayers(model), blocks, [72, 60, 36, 24], settings)
    assert [p.width for p in result.plans] == [72, 60, 36, 24]
    assert [len(s) for s in result.scores] == [WIDTH] * 4  # scores of the source neurons, grown layers too
    model.config.intermediate_sizes = [72, 60, 36, 24]
    with torch.no_grad():
        last = model.model(blocks, use_cache=False).last_hidden_state  # after the final norm
        carried = model.model.norm(torch.cat(result.hidden))
    torch.testing.assert_close(carried, last, atol=1e-5, rtol=1e-5)


def test_report_counts_the_save_phase(tmp_path, tokenizer, monkeypatch):
    # the report is written from inside the "save" phase; its seconds must include the export so far (was 0.0)
    import time

    import tlm_convert.convert as convert_module

    export = convert_module.export_model

    def slow_export(*args, **kwargs):
        time.sleep(0.3)
        return export(*args, **kwargs)

    monkeypatch.setattr(convert_module, "export_model", slow_export)
    src = make_source(tmp_path / "src", "llama", tokenizer=tokenizer)
    report = convert(str(src), str(tmp_path / "out"), ConvertOptions(**OPTS))
    saved = json.loads((tmp_path / "out" / "conversion_report.json").read_text())
    assert saved["seconds"]["save"] >= 0.3
    assert report["seconds"]["save"] >= 0.3
    assert "| save | 0.0 |" not in (tmp_path / "out" / "report.md").read_text()


def test_phase_timer_snapshot_counts_running_phases():
    from tlm_convert.convert import PhaseTimer

    timer = PhaseTimer()
    with timer("load"):
        pass
    with timer("save"):
        time_in = timer.snapshot()
    assert time_in["save"] > 0.0 and time_in["load"] == timer.seconds["load"]
    assert timer.seconds["save"] >= time_in["save"] and not timer._running


def test_calibration_blocks_are_spread_over_the_whole_text():
    # the bundled sample is a handbook followed by encyclopedic prose: a prefix would only ever see the handbook
    from tlm_io.text import token_blocks

    def tokenizer(text, add_special_tokens=False):
        return {"input_ids": list(range(len(text.split())))}

    text = " ".join(["w"] * 1000)  # 1000 tokens: 15 blocks of 64 (and a partial one, dropped)
    calib = token_blocks(tokenizer, text, 64, 4 * 64)
    assert calib[:, 0].tolist() == [0, 5 * 64, 9 * 64, 14 * 64]  # first and last block, evenly spaced, in order
    assert torch.equal(calib[1], torch.arange(5 * 64, 6 * 64))
    evaluation = token_blocks(tokenizer, text, 64, 4 * 64, what="evaluation")
    assert evaluation[:, 0].tolist() == [0, 64, 128, 192]  # held-out text: the first blocks, as before
    assert token_blocks(tokenizer, text, 64, 4 * 64, spread=False)[:, 0].tolist() == [0, 64, 128, 192]
    assert token_blocks(tokenizer, text, 64, None)[:, 0].tolist() == [64 * i for i in range(15)]
    assert len(set(token_blocks(tokenizer, text, 64, 14 * 64)[:, 0].tolist())) == 14


def test_importance_default_depends_on_the_policy():
    # fisher (the best measured) by default in memory; --low-memory never holds the whole model: OBS while its dense
    # I x I matrices fit the budget, else activation
    from tlm_convert.calibrate import LOW_MEMORY
    from tlm_convert.convert import resolve_importance

    in_memory, low = ConvertOptions(), ConvertOptions(low_memory=True)
    in_memory.validate()
    low.validate()
    assert (in_memory.method.importance, low.method.importance) == ("fisher", "auto")
    assert resolve_importance(low, 1536) == [] and low.method.importance == "obs"  # SmolLM2's MLP: 94 MB of matrices
    wide = ConvertOptions(low_memory=True)
    wide.validate()
    notes = resolve_importance(wide, 11008)  # a 7B Llama's MLP: 4.5 GiB
    assert wide.method.importance == "activation" and "obs needs 4.5 GiB" in notes[0]
    assert not LOW_MEMORY.obs_fits(11008) and LOW_MEMORY.obs_fits(1536)
    chosen = ConvertOptions(method=Method(importance="wanda_sp"), low_memory=True)
    chosen.validate()
    assert chosen.method.importance == "wanda_sp"


def test_obs_prune_matches_the_textbook_updates():
    # the lazy G⁻¹ = H₀ − QQᵀ bookkeeping must choose and compensate exactly as updating G⁻¹ in place does
    from tlm_convert.compensate import obs_prune

    gen = torch.Generator().manual_seed(0)
    acts = torch.randn(400, 60, generator=gen) * torch.rand(60, generator=gen) ** 2
    gram, down = (acts.T @ acts).double(), torch.randn(9, 60, generator=gen)
    hinv = torch.linalg.inv(gram + 1e-3 * gram.diagonal().mean() * torch.eye(60, dtype=torch.float64))
    w, alive = down.double().clone(), torch.ones(60, dtype=torch.bool)
    for _ in range(60 - 25):
        cost = w.pow(2).sum(0) / hinv.diagonal()
        cost[~alive] = float("inf")
        j = int(torch.argmin(cost))
        row = hinv[j] / hinv[j, j]
        w -= w[:, j : j + 1] * row[None, :]
        hinv -= hinv[:, j : j + 1] * row[None, :]
        alive[j] = False
    keep, compensated = obs_prune(gram, down, 25, damp=1e-3)
    assert keep == alive.nonzero().flatten().tolist()
    torch.testing.assert_close(compensated, w[:, alive].float(), atol=1e-5, rtol=1e-5)


def test_a_tapered_tlm_is_retapered_around_its_mean_width(tmp_path, tokenizer):
    # the gradual taper's stages: a TLM converted again to a steeper ratio ends at the one-shot widths and count
    src = make_source(tmp_path / "src", "llama", tokenizer=tokenizer)
    half = convert(str(src), str(tmp_path / "half"), ConvertOptions(ratio="1.25/0.75", **OPTS))
    full = convert(str(tmp_path / "half"), str(tmp_path / "full"), ConvertOptions(ratio="1.5/0.5", **OPTS))
    once = convert_module.plan_widths(load_source(str(src)).tlm_config, ConvertOptions(ratio="1.5/0.5", **OPTS))
    assert half["widths_after"] != full["widths_after"] == once
    assert full["widths_before"] == half["widths_after"]
    assert full["params_after"] == full["params_before"] == half["params_before"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "full", trust_remote_code=True)
    assert model.config.intermediate_sizes == once
    odd = copy.deepcopy(load_source(str(tmp_path / "half")).tlm_config)
    odd.intermediate_sizes = [odd.intermediate_sizes[0] + 1] + odd.intermediate_sizes[1:]
    with pytest.raises(convert_module.ConversionError, match="not a multiple of its 4 layers"):
        convert_module.plan_widths(odd, ConvertOptions(**OPTS))


def test_fisher_draws_reach_the_pre_pass_and_bad_values_are_one_line_errors():
    assert convert_module.layer_settings(ConvertOptions(method=Method(fisher_draws=2))).method.fisher_draws == 2
    with pytest.raises(convert_module.ConversionError, match=r"^--set fisher_draws=0: must be an integer >= 1$"):
        ConvertOptions(method=Method(fisher_draws=0)).validate()
    with pytest.raises(convert_module.ConversionError, match=r"^--set fisher_draws=2 needs the Fisher pass: "):
        ConvertOptions(method=Method(fisher_draws=2, importance="obs")).validate()
    ConvertOptions(method=Method(fisher_draws=2, importance="obs"), schedule="measured-taper").validate()  # Fisher
