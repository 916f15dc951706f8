"""Tapered Llama: transformers' stock Llama with one MLP width per layer.

Written by tlm-convert (tapered-lm). config.json is a stock `llama` config whose `per_layer_config` gives
every layer's `intermediate_size`; the stock classes refuse it (the global width is ambiguous), these subclasses build
the stock model and then replace layer i's MLP with the stock MLP at `config.per_layer_config[i].intermediate_size`.
Everything else is inherited unchanged. Load with:

    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
"""

import logging
from contextlib import contextmanager

from transformers.models.llama.modeling_llama import LlamaModel, LlamaForCausalLM, LlamaMLP

_HETEROGENEITY_LOGGER = logging.getLogger("transformers.integrations.heterogeneity.configuration_utils")


@contextmanager
def _global_width_access(config):
    """Let the stock constructor read the global width while it builds the layers that are replaced below."""
    had_flag = "allow_global_per_layer_attribute_access" in config.__dict__
    previous_flag = config.allow_global_per_layer_attribute_access
    previous_level = _HETEROGENEITY_LOGGER.level
    config.allow_global_per_layer_attribute_access = True
    _HETEROGENEITY_LOGGER.setLevel(logging.ERROR)
    try:
        yield
    finally:
        _HETEROGENEITY_LOGGER.setLevel(previous_level)
        if had_flag:
            config.allow_global_per_layer_attribute_access = previous_flag
        else:
            config.__dict__.pop("allow_global_per_layer_attribute_access", None)


def _layer_mlp(layer_config):
    return LlamaMLP(layer_config)


class TaperedLlamaModel(LlamaModel):
    def __init__(self, config):
        with _global_width_access(config):
            super().__init__(config)
        for i, layer in enumerate(self.layers):
            layer.mlp = _layer_mlp(config.per_layer_config[i])
        self.post_init()


class TaperedLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        with _global_width_access(config):
            super().__init__(config)
        self.model = TaperedLlamaModel(config)
        self.post_init()


__all__ = ["TaperedLlamaModel", "TaperedLlamaForCausalLM"]
