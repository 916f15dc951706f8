"""``shrink="fold"`` (tlm_convert.fold): shrinking layers merge their neurons into clusters instead of dropping the
lowest-scored. Exact on neurons that come in duplicates, the drop's widths, parameter count and exports, the drop
itself with no k-means iteration, deterministic, and its knob's bad values are one-line errors."""

import copy

import pytest
import torch
from tiny_sources import DATA, make_source, tiny_tokenizer
from transformers import AutoModelForCausalLM

import tlm
from tlm.mlp import GatedMLP, PlainMLP
from tlm_convert.calibrate import LayerSettings, ModelLayers, convert_layers
from tlm_convert.convert import ConvertOptions, convert
from tlm_convert.fold import fold_merge
from tlm_convert.options import method_from
from tlm_convert.surgery import LayerPlan, plan_from_scores, resize_layer
from tlm_io.checkpoint import load_source
from tlm_io.errors import ConversionError

WIDTHS = [72, 60, 36, 24]  # tiny_sources' 48-wide layers at cosine 1.5/0.5
OPTS = dict(calibration_data=str(DATA), calibration_tokens=1024, seq_len=64, batch_size=4)
PREFIX = "model.layers.0.mlp."


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _duplicated_mlp(gated: bool, hidden=6, distinct=4, copies=2) -> torch.nn.Module:
    """An MLP of ``distinct * copies`` neurons, neuron j + distinct * c computing what neuron j does: gated, its up row
    times k and down column over k (k < 0 too: the SwiGLU symmetry); ungated, the same rows and bias."""
    gen = torch.Generator().manual_seed(0)
    mlp = (GatedMLP if gated else PlainMLP)(hidden, distinct * copies)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
        for c in range(1, copies):
            twin, k = slice(c * distinct, (c + 1) * distinct), torch.tensor([2.0, -0.5, 3.0, -1.5])[:distinct] * c
            if gated:
                mlp.gate_proj.weight[twin] = mlp.gate_proj.weight[:distinct]
                mlp.up_proj.weight[twin] = mlp.up_proj.weight[:distinct] * k[:, None]
                mlp.down_proj.weight[:, twin] = mlp.down_proj.weight[:, :distinct] / k
            else:
                mlp.up_proj.weight[twin] = mlp.up_proj.weight[:distinct]
                mlp.up_proj.bias[twin] = mlp.up_proj.bias[:distinct]
    return mlp.eval()


def _fold_mlp(mlp, scores, iters, x):
    """The MLP folded to half its width by fold_merge (moment of the inputs ``x``) and surgery.resize_layer."""
    width = mlp.down_proj.in_features // 2
    bias = mlp.up_proj.bias is not None
    xt = torch.cat([x, torch.ones(len(x), 1)], 1) if bias else x
    rows = {n: getattr(mlp, n).weight.detach() for n in ("gate_proj", "up_proj") if hasattr(mlp, n)}
    if bias:
        rows = {n: torch.cat([w, getattr(mlp, n).bias.detach()[:, None]], 1) for n, w in rows.items()}
    seeds = plan_from_scores([scores], [width])[0].keep
    plan = LayerPlan(keep=seeds, merge=fold_merge(rows, xt.T.double() @ xt.double(), scores, seeds, iters))
    state = {PREFIX + k: v for k, v in mlp.state_dict().items()}
    new = resize_layer(state, 0, plan, gated=hasattr(mlp, "gate_proj"))
    folded = copy.deepcopy(mlp)
    for name, module in folded.named_children():
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(new[PREFIX + name + ".weight"])
            if module.bias is not None and PREFIX + name + ".bias" in new:
                module.bias = torch.nn.Parameter(new[PREFIX + name + ".bias"])
    return folded


# the top half of the scores: one neuron of each pair, or both neurons of two pairs (k-means must separate them)
ONE_PER_PAIR = [4.0, 3.0, 2.0, 1.0, 0.5, 0.4, 0.3, 0.2]
BOTH_OF_TWO_PAIRS = [4.0, 3.0, 0.2, 0.1, 4.0, 3.0, 0.2, 0.1]


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("scores, iters", [(ONE_PER_PAIR, 10), (ONE_PER_PAIR, 0), (BOTH_OF_TWO_PAIRS, 10)])
def test_a_fold_of_duplicate_pairs_is_exact_at_half_the_width(gated, scores, iters):
    mlp = _duplicated_mlp(gated)
    gen = torch.Generator().manual_seed(1)
    calibration, fresh = torch.randn(64, 6, generator=gen), torch.randn(32, 6, generator=gen)
    folded = _fold_mlp(mlp, torch.tensor(scores), iters, calibration)
    assert folded.down_proj.weight.shape == (6, 4) and folded.up_proj.weight.shape == (4, 6)
    with torch.no_grad():
        torch.testing.assert_close(folded(fresh), mlp(fresh), atol=1e-5, rtol=1e-5)
    if gated:  # one of each pair stays as it was, its down column carrying its twin's output as well
        merged = {tuple(r.tolist()) for r in folded.gate_proj.weight}
        assert merged == {tuple(r.tolist()) for r in mlp.gate_proj.weight[:4]}


def test_a_fold_to_more_clusters_than_distinct_neurons_splits_copies_and_stays_exact():
    # 2 distinct neurons in 4 copies each, folded to 4: k-means leaves clusters empty, filled by splitting copies
    mlp = _duplicated_mlp(True, distinct=2, copies=4)
    gen = torch.Generator().manual_seed(1)
    calibration, fresh = torch.randn(64, 6, generator=gen), torch.randn(32, 6, generator=gen)
    folded = _fold_mlp(mlp, torch.ones(8), 10, calibration)
    with torch.no_grad():
        torch.testing.assert_close(folded(fresh), mlp(fresh), atol=1e-5, rtol=1e-5)


def _convert(tmp_path, name, src, **knobs):
    """convert() with method knobs set (as tlm-convert's --set sets them)."""
    return convert(str(src), str(tmp_path / name), ConvertOptions(eval_data=str(DATA), eval_tokens=512,
                                                                  low_memory=src.name == "gpt2",
                                                                  method=method_from({"multiple_of": 1, **knobs}), **OPTS))


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # gpt2: ungated with biases, and streamed (low memory)
def test_a_fold_conversion_has_the_drops_widths_parameters_and_exports(family, tmp_path, tokenizer):
    src = make_source(tmp_path / family, family, tokenizer=tokenizer)
    drop = _convert(tmp_path, "drop", src)
    fold = _convert(tmp_path, "fold", src, shrink="fold")
    assert fold["widths_after"] == drop["widths_after"] == WIDTHS
    assert fold["params_after"] == drop["params_after"] == drop["params_before"]
    tensors = {}
    for name in ("drop", "fold"):
        out = AutoModelForCausalLM.from_pretrained(tmp_path / name, trust_remote_code=True).eval()
        tensors[name] = out.state_dict()
        ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            assert torch.isfinite(out(ids).logits).all()
    assert {k: v.shape for k, v in tensors["fold"].items()} == {k: v.shape for k, v in tensors["drop"].items()}
    last = "model.layers.3.mlp.up_proj.weight"
    assert not torch.equal(tensors["fold"][last], tensors["drop"][last])  # the fold merged where the drop kept
    assert fold["perplexity_after"] > 0


def _tiny(tmp_path, tokenizer, family="llama"):
    src = load_source(str(make_source(tmp_path / family, family, tokenizer=tokenizer)))
    blocks = torch.tensor(tokenizer(DATA.read_text())["input_ids"][: 8 * 32]).view(8, 32)
    return src, blocks


def _converted(src, blocks, **settings):
    model = tlm.TLMForCausalLM(copy.deepcopy(src.tlm_config)).eval()
    model.load_state_dict(src.state_dict)
    result = convert_layers(model.model, ModelLayers(model), blocks, WIDTHS, LayerSettings(method_from({"importance": "activation", **settings}), 4, 0))
    model.config.intermediate_sizes = list(WIDTHS)
    return model, result


@pytest.mark.parametrize("refit_target", ["local", "residual"])
def test_a_fold_without_iterations_is_the_drop(refit_target, tmp_path, tokenizer):
    # 0 iterations: the kept neurons' rows stay as they are; the refit of their down projection then removes what
    # the summed columns added, whichever target (the fold's refit from the folded MLP's own activations)
    src, blocks = _tiny(tmp_path, tokenizer)
    settings = dict(importance="activation", refit_target=refit_target)
    drop, _ = _converted(src, blocks, **settings)
    fold, _ = _converted(src, blocks, shrink="fold", fold_iters=0, **settings)
    with torch.no_grad():
        torch.testing.assert_close(fold(blocks).logits, drop(blocks).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family, settings", [
    ("llama", dict(refit_target="residual")),
    ("gemma3_text", dict(importance="wanda_sp", refit_target="local")),  # sandwich norms
    ("gpt2", dict(importance="obs", refit=False)),  # biases; the summed columns themselves
    ("llama", dict(reconstruct_epochs=1, token_weighting="inv_norm")),
])
def test_a_fold_carries_the_converted_models_activations_and_is_deterministic(family, settings, tmp_path,
                                                                             tokenizer):
    src, blocks = _tiny(tmp_path, tokenizer, family)
    runs = [_converted(src, blocks, shrink="fold", **settings) for _ in range(2)]
    (model, result), (again, _) = runs
    assert [p.width for p in result.plans] == WIDTHS
    with torch.no_grad():
        last = model.model(blocks, use_cache=False).last_hidden_state
    torch.testing.assert_close(model.model.norm(torch.cat(result.hidden)), last, atol=1e-5, rtol=1e-5)
    first, second = model.state_dict(), again.state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("knob, message", [
    ("shrink=squash", "--set shrink: expected one of drop, fold, got 'squash'"),
    ("fold_iters=-1", "--set fold_iters=-1: must be an integer >= 0"),
    ("fold_iters=2.5", "--set fold_iters: expected an integer, got 2.5"),
])
def test_bad_fold_settings_are_one_line_errors(knob, message):
    with pytest.raises(ConversionError) as err:
        method_from([knob])
    assert str(err.value) == message and "\n" not in message
    assert method_from([]).shrink == "drop"
