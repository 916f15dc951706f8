"""GPT-2's layer MLP in modeling_tapered.py, which :func:`tlm_io.templates.render_tapered` puts in place of the
Llama one: GPT2MLP takes its width as an argument, ``n_inner`` or, when that is None, 4 x hidden_size (as GPT2Block
reads it)."""

from transformers.models.gpt2.modeling_gpt2 import GPT2MLP


def _layer_mlp(layer_config):
    width = layer_config.n_inner
    if width is None:
        width = 4 * layer_config.hidden_size
    return GPT2MLP(width, layer_config)
