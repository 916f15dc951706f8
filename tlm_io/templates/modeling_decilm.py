"""DeciLM (`nemotron-nas`) for transformers: Llama with a per-layer MLP width and key/value
head count.

Written by tlm-convert (tapered-lm), minimal: layer i's MLP width is
find_multiple(int(2 * ffn_mult * hidden_size / 3), 256) (the rule of vLLM, SGLang and llama.cpp), its key/value
heads num_attention_heads // n_heads_in_group. no_op and replace_with_linear blocks are not implemented.
"""

import copy

from transformers.models.llama.modeling_llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel

from .configuration_decilm import DeciLMConfig, ffn_mult_to_intermediate_size


def _layer_config(config, layer_idx):
    block = config.block_configs[layer_idx]
    for part in ("attention", "ffn"):
        sub = getattr(block, part)
        if sub.no_op or sub.replace_with_linear:
            raise NotImplementedError(f"layer {layer_idx}: {part} no_op / replace_with_linear blocks are not "
                                      "implemented by this minimal DeciLM code")
    layer_config = copy.copy(config)
    if block.ffn.ffn_mult is not None:
        layer_config.intermediate_size = ffn_mult_to_intermediate_size(block.ffn.ffn_mult, config.hidden_size)
    else:
        layer_config.intermediate_size = block.ffn.intermediate_size
    if block.attention.n_heads_in_group:
        layer_config.num_key_value_heads = config.num_attention_heads // block.attention.n_heads_in_group
    return layer_config


class DeciLMModel(LlamaModel):
    config_class = DeciLMConfig

    def __init__(self, config):
        super().__init__(config)
        for i, layer in enumerate(self.layers):
            layer_config = _layer_config(config, i)
            layer.mlp = LlamaMLP(layer_config)
            if layer_config.num_key_value_heads != config.num_key_value_heads:
                layer.self_attn = LlamaAttention(layer_config, i)
        self.post_init()


class DeciLMForCausalLM(LlamaForCausalLM):
    config_class = DeciLMConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = DeciLMModel(config)
        self.post_init()


__all__ = ["DeciLMModel", "DeciLMForCausalLM"]
