"""Token-weighted refit and layer reconstruction (tlm_convert.reconstruct) on tiny random fp32 models."""

import pytest
import torch
from tiny_sources import DATA, make_source, tiny_tokenizer

import tlm
from tlm_convert import calibrate
from tlm_convert.calibrate import LayerSettings, ModelLayers, convert_layers
from tlm_convert.options import ConvertOptions, Method
from tlm_convert.reconstruct import reconstruct_mlp, token_weights
from tlm_io.checkpoint import load_source
from tlm_io.errors import ConversionError

WIDTHS = [72, 60, 36, 24]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def source(tmp_path, tokenizer):
    src = load_source(str(make_source(tmp_path / "src", "llama", tokenizer=tokenizer)))
    blocks = torch.tensor(tokenizer(DATA.read_text())["input_ids"][: 16 * 64]).view(16, 64)
    return src, blocks


def _model(src):
    model = tlm.TLMForCausalLM(src.tlm_config).eval()
    model.load_state_dict(src.state_dict)
    return model


def _convert(src, blocks, **settings):
    model = _model(src)
    method = Method(**{"importance": "obs", "refit_target": "residual", **settings})
    convert_layers(model.model, ModelLayers(model), blocks, WIDTHS, LayerSettings(method, batch_size=8, seed=0))
    return model


def test_token_weights():
    z = torch.randn(2, 5, 7)
    assert token_weights("none", [z]) is None
    sink, inv = token_weights("sink", [z])[0], token_weights("inv_norm", [z])[0]
    assert sink[:, 0].eq(0).all() and sink[:, 1:].eq(1).all()
    assert inv[:, 0].eq(0).all()
    torch.testing.assert_close(inv[:, 1:], 1 / z[:, 1:].pow(2).mean(-1))
    with pytest.raises(ValueError, match="token_weighting"):
        token_weights("bogus", [z])


@pytest.mark.parametrize("importance", ["obs", "activation"])
def test_uniform_token_weights_equal_the_unweighted_refit_exactly(importance, source, monkeypatch):
    src, blocks = source
    plain = _convert(src, blocks, importance=importance)
    monkeypatch.setattr(calibrate, "token_weights",
                        lambda kind, mixed: [torch.ones(z.shape[:2]) for z in mixed])
    uniform = _convert(src, blocks, importance=importance, token_weighting="sink")
    for (name, a), (_, b) in zip(plain.state_dict().items(), uniform.state_dict().items()):
        assert torch.equal(a, b), name


def test_reconstruction_lowers_the_layer_error_on_its_calibration_batches():
    torch.manual_seed(0)
    config = tlm.TLMConfig(vocab_size=64, hidden_size=24, intermediate_size=40, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2)
    layer = tlm.TLMForCausalLM(config).model.layers[0]
    layer.requires_grad_(False)
    mixed = [torch.randn(4, 16, 24) for _ in range(3)]
    targets = [torch.randn(4, 16, 24) * 0.1 for _ in range(3)]
    history = reconstruct_mlp(layer, mixed, targets, None, epochs=5, lr=1e-2)
    assert len(history) == 6 and history[-1] < 0.9 * history[0]
    assert not any(p.requires_grad for p in layer.parameters())  # the flags are restored
    assert all(p.grad is None for p in layer.parameters())  # no gradients left behind


def test_reconstruction_lowers_the_converted_models_error_and_is_deterministic(source):
    src, blocks = source
    reference = _model(src)
    with torch.no_grad():
        target = reference(blocks).logits

    def error(model):
        with torch.no_grad():
            return float((model(blocks).logits - target).pow(2).mean())

    refit = _convert(src, blocks)
    trained = _convert(src, blocks, reconstruct_epochs=3, reconstruct_lr=1e-3)
    again = _convert(src, blocks, reconstruct_epochs=3, reconstruct_lr=1e-3)
    assert error(trained) < error(refit)
    for (name, a), (_, b) in zip(trained.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("settings", [{"token_weighting": "inv_norm"},
                                      {"token_weighting": "sink", "reconstruct_epochs": 2, "reconstruct_lr": 1e-3},
                                      {"refit_target": "local", "token_weighting": "inv_norm",
                                       "reconstruct_epochs": 2, "reconstruct_lr": 1e-3}])
def test_summed_statistics_give_the_kept_activations_result(settings, source):
    # activations too large to keep: the weighted Gram matrix and AᵀWY are summed batch by batch instead
    src, blocks = source
    models = []
    for policy in (calibrate.IN_MEMORY, calibrate.MemoryPolicy("summed", keep_activations_bytes=0)):
        model = _model(src)
        layer_settings = LayerSettings(Method(**{"importance": "obs", "refit_target": "residual", **settings}), 8, 0)
        convert_layers(model.model, ModelLayers(model), blocks, WIDTHS, layer_settings, policy)
        models.append(model)
    for (name, a), (_, b) in zip(models[0].state_dict().items(), models[1].state_dict().items()):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=name)


def test_options_refuse_bad_values_in_one_line():
    with pytest.raises(ConversionError, match=r"^--set reconstruct_epochs=-1: must be an integer >= 0$"):
        ConvertOptions(method=Method(reconstruct_epochs=-1)).validate()
    with pytest.raises(ConversionError, match=r"^--set token_weighting: expected one of none, sink, inv_norm, got 'bogus'"):
        ConvertOptions(method=Method(token_weighting="bogus")).validate()
