"""The Python files exports write beside the weights (tlm_io/templates/): modules of the package that import and
build models where they stand, and the modeling_tapered.py rendered for every stock family (tests/test_export.py
loads the exported folders with trust_remote_code)."""

import pytest
from transformers import GPT2Config, LlamaConfig

from tlm_io import templates
from tlm_io.export import tapered_modeling_source
from tlm_io.hf_layout import STOCK_CLASSES, WIDTH_KEY
from tlm_io.templates import configuration_decilm, modeling_decilm, modeling_tapered, tapered_gpt2_mlp

OTHER_FAMILIES = sorted(set(STOCK_CLASSES) - {"llama"})


def test_the_llama_rendering_is_the_file():
    assert tapered_modeling_source("llama").encode("utf-8") == templates.template_bytes(templates.TAPERED_FILE)


def test_every_field_stands_in_the_file():
    text = templates.template_bytes(templates.TAPERED_FILE).decode("utf-8")
    assert [llama for llama, _ in templates.TAPERED_FIELDS if llama not in text] == []


@pytest.mark.parametrize("model_type", OTHER_FAMILIES)
def test_a_rendering_names_only_its_family(model_type):
    source = tapered_modeling_source(model_type)
    compile(source, "modeling_tapered.py", "exec")
    module, base, causal_lm, mlp, layers, prefix = STOCK_CLASSES[model_type]
    assert "llama" not in source.lower()
    assert f"from transformers.models.{module}.modeling_{module} import {base}, {causal_lm}, {mlp}\n" in source
    assert f"class Tapered{causal_lm}({causal_lm}):" in source and f"class Tapered{base}({base}):" in source
    assert f"enumerate(self.{layers})" in source and f"self.{prefix} = Tapered{base}(config)" in source
    assert f"stock `{model_type}` config" in source and f"per_layer_config[i].{WIDTH_KEY[model_type]}`" in source
    if WIDTH_KEY[model_type] != "intermediate_size":
        assert "intermediate_size" not in source


def test_gpt2_rendering_takes_its_own_layer_mlp():
    source = tapered_modeling_source("gpt2")
    assert templates.layer_mlp_source("tapered_gpt2_mlp.py") in source
    assert templates.layer_mlp_source(templates.TAPERED_FILE) not in source


def test_tapered_module_builds_one_width_per_layer():
    widths = [48, 37, 26]
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, per_layer_config={i: {"intermediate_size": w} for i, w in enumerate(widths)})
    model = modeling_tapered.TaperedLlamaForCausalLM(config)
    assert [layer.mlp.up_proj.out_features for layer in model.model.layers] == widths
    assert isinstance(model.model, modeling_tapered.TaperedLlamaModel)


def test_gpt2_layer_mlp_width():
    layer_mlp = vars(tapered_gpt2_mlp)["_layer_mlp"]  # the function the gpt2 rendering carries
    assert layer_mlp(GPT2Config(n_embd=32, n_inner=40)).c_fc.nf == 40
    assert layer_mlp(GPT2Config(n_embd=32, n_inner=None)).c_fc.nf == 4 * 32  # GPT-2's default width


def test_decilm_modules_build_per_layer_widths_and_heads():
    blocks = [{"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 3.0}},
              {"attention": {"n_heads_in_group": 4, "unknown": 1}, "ffn": {"ffn_mult": 6.0}}]
    config = configuration_decilm.DeciLMConfig(vocab_size=64, hidden_size=128, intermediate_size=512,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                               block_configs=blocks)
    assert config.block_configs[1].ffn.ffn_mult == 6.0 and config.to_dict()["block_configs"][0]["ffn"]["no_op"] is False
    model = modeling_decilm.DeciLMForCausalLM(config)
    assert [layer.mlp.up_proj.out_features for layer in model.model.layers] == [256, 512]
    assert [layer.self_attn.k_proj.out_features // 32 for layer in model.model.layers] == [2, 1]  # kv heads


def test_decilm_refuses_no_op_blocks():
    blocks = [{"attention": {"n_heads_in_group": 1, "no_op": True}, "ffn": {"ffn_mult": 3.0}}]
    config = configuration_decilm.DeciLMConfig(vocab_size=64, hidden_size=128, num_hidden_layers=1,
                                               num_attention_heads=4, block_configs=blocks)
    with pytest.raises(NotImplementedError, match="layer 0: attention no_op"):
        modeling_decilm.DeciLMForCausalLM(config)

