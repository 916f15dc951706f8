"""TLMConfig: width resolution, validation messages, serialisation."""

import pytest
from conftest import tiny_config

import tlm


def test_widths_resolve_from_the_taper_spec_and_are_stored():
    config = tlm.TLMConfig(num_hidden_layers=6, intermediate_size=1024, schedule="cosine")
    assert config.intermediate_sizes == [1536, 1440, 1184, 864, 608, 512]
    assert tlm.TLMConfig(num_hidden_layers=3, intermediate_size=37).intermediate_sizes == [37, 37, 37]


def test_saved_widths_are_never_re_derived(tmp_path):
    config = tiny_config(intermediate_sizes=[50, 40, 21], schedule="cosine")
    config.save_pretrained(tmp_path)
    again = tlm.TLMConfig.from_pretrained(tmp_path)
    assert again.intermediate_sizes == [50, 40, 21]
    assert again.mixer == config.mixer and again.to_dict() == config.to_dict()


def test_every_bad_field_is_reported_at_once():
    with pytest.raises(ValueError) as err:
        tlm.TLMConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=3, hidden_size=32,
                      mixer=["attention", "titan"], norm_type="batchnorm", hidden_act="swooshy",
                      rope_parameters={"rope_type": "yarn", "rope_theta": 1e4},
                      layer_types=["full_attention", "sliding_attention"])
    message = str(err.value)
    for fragment in ("num_key_value_heads=3 must divide num_attention_heads=4", "'titan'", "norm_type='batchnorm'",
                     "hidden_act='swooshy'", "rope_parameters.rope_type='yarn'", "sliding_window=None"):
        assert fragment in message, fragment


def test_bad_taper_spec_is_reported_with_the_other_errors():
    with pytest.raises(ValueError, match=r"(?s)ratio.*norm_type='x'"):
        tlm.TLMConfig(num_hidden_layers=4, intermediate_size=64, schedule="cosine", taper_ratio=(2.0, 0.5),
                      norm_type="x")


def test_per_layer_lists_must_match_the_depth():
    with pytest.raises(ValueError, match="mixer has 2 entries: expected num_hidden_layers=3"):
        tiny_config(mixer=["attention", "titans"])
    with pytest.raises(ValueError, match="intermediate_sizes"):
        tiny_config(intermediate_sizes=[10, 10])


def test_hope_level_options_are_validated():
    with pytest.raises(ValueError, match="hope_level_modes"):
        tiny_config("hope_attention", hope_level_modes=["online", "fast", "static"])
