"""Import tables: how each supported source architecture maps onto a TLM, exactly.

One *family* per block design; several transformers ``model_type`` values can share one::

    model_type      family   block (see tlm/configuration_tlm.py FAMILY_NOTES)
    llama, mistral  llama    RMSNorm, RoPE, SwiGLU; attention_bias (q,k,v,o), mlp_bias; Mistral: sliding window
    qwen2           qwen2    q/k/v bias (o without); per-layer sliding windows (use_sliding_window)
    qwen3           qwen3    q/k RMSNorm per head; attention_bias (q,k,v,o); per-layer sliding windows
    gemma3_text     gemma3   (1+w) RMSNorm, sandwich norms, q/k norm, sqrt(d)-scaled embeddings, GeGLU,
    gemma3                   query_pre_attn_scalar, local/global layers with their own RoPE (text part only)
    gpt2            gpt2     LayerNorm, learned positions, ungated gelu MLP, biases everywhere, Conv1D weights

Everything that changes the function of the source model is either mapped or refused: ``tlm_config_from_hf``
raises one ValueError naming every setting TLM cannot reproduce (field, value, why), so an import is exact or it
does not happen. ``tlm_state_dict_from_hf`` is a pure key/value mapping (no model is materialised; the result is
checked against the names and shapes of a meta-device TLM).

Tensor tables are written with ``{i}`` for the layer index, in the *canonical source spelling*: the names
transformers' own ``*ForCausalLM`` state dict uses (``model.layers.{i}...``; GPT-2: ``transformer.h.{i}...``).
``canonical_source_state_dict`` brings the other accepted spellings into it (GPT-2 hub files without the
``transformer.`` prefix; Gemma 3 multimodal ``language_model.model.`` / ``model.language_model.``).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch
from transformers import PretrainedConfig

from tlm import TLMConfig, TLMForCausalLM
from tlm.configuration_tlm import ROPE_TYPES
from tlm.mlp import ACTIVATIONS

# ----------------------------------------------------------------------------------------------- families

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "llama",  # Llama 1-3.x, SmolLM / SmolLM2, TinyLlama, ...
    "mistral": "llama",  # Llama block + sliding window on every layer
    "qwen2": "qwen2",  # Qwen2 / Qwen2.5
    "qwen3": "qwen3",  # Qwen3 dense
    "gemma3_text": "gemma3",  # Gemma 3 text-only checkpoints (gemma-3-270m / 1b)
    "gemma3": "gemma3",  # Gemma 3 multimodal checkpoints (4b+): the text model only, the vision tower is dropped
    "gpt2": "gpt2",
}

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3", "gpt2")

# Fixed TLM block options per family (what FAMILY_NOTES describes); per-checkpoint fields come from the config.
FAMILY_BLOCK: dict[str, dict[str, Any]] = {
    "llama": dict(norm_type="rmsnorm", norm_offset=False, sandwich_norm=False, qk_norm=False, mlp_gated=True,
                  position_embedding="rope", scale_embeddings=False),
    "qwen2": dict(norm_type="rmsnorm", norm_offset=False, sandwich_norm=False, qk_norm=False, mlp_gated=True,
                  mlp_bias=False, position_embedding="rope", scale_embeddings=False,
                  attention_bias=True, attention_out_bias=False),
    "qwen3": dict(norm_type="rmsnorm", norm_offset=False, sandwich_norm=False, qk_norm=True, mlp_gated=True,
                  mlp_bias=False, position_embedding="rope", scale_embeddings=False),
    "gemma3": dict(norm_type="rmsnorm", norm_offset=True, sandwich_norm=True, qk_norm=True, mlp_gated=True,
                   mlp_bias=False, position_embedding="rope", scale_embeddings=True),
    "gpt2": dict(norm_type="layernorm", norm_offset=False, sandwich_norm=False, qk_norm=False, mlp_gated=False,
                 mlp_bias=True, position_embedding="learned", scale_embeddings=False,
                 attention_bias=True, attention_out_bias=True),
}

# ----------------------------------------------------------------------------------------------- tensors

COPY = "copy"  # the tensor as is (the same object: no copy is made)
CONV1D = "conv1d"  # GPT-2 Conv1D weight (in, out) -> nn.Linear weight (out, in)
QKV_CONV1D = "qkv_conv1d"  # GPT-2 c_attn weight (d, 3d): split the columns into q, k, v, then transpose each
QKV_BIAS = "qkv_bias"  # GPT-2 c_attn bias (3d,): split into q, k, v

_L = "model.layers.{i}."

# Llama, Mistral, SmolLM, Qwen2, Qwen3: TLM uses the very same names. Entries that a checkpoint lacks are fine
# (biases, q/k norms); the result is checked against the TLM the config describes.
_LLAMA_STYLE_TENSORS: dict[str, tuple[str | tuple[str, ...], str]] = {
    "model.embed_tokens.weight": ("model.embed_tokens.weight", COPY),
    _L + "input_layernorm.weight": (_L + "input_layernorm.weight", COPY),
    _L + "self_attn.q_proj.weight": (_L + "self_attn.q_proj.weight", COPY),
    _L + "self_attn.q_proj.bias": (_L + "self_attn.q_proj.bias", COPY),
    _L + "self_attn.k_proj.weight": (_L + "self_attn.k_proj.weight", COPY),
    _L + "self_attn.k_proj.bias": (_L + "self_attn.k_proj.bias", COPY),
    _L + "self_attn.v_proj.weight": (_L + "self_attn.v_proj.weight", COPY),
    _L + "self_attn.v_proj.bias": (_L + "self_attn.v_proj.bias", COPY),
    _L + "self_attn.o_proj.weight": (_L + "self_attn.o_proj.weight", COPY),
    _L + "self_attn.o_proj.bias": (_L + "self_attn.o_proj.bias", COPY),
    _L + "self_attn.q_norm.weight": (_L + "self_attn.q_norm.weight", COPY),
    _L + "self_attn.k_norm.weight": (_L + "self_attn.k_norm.weight", COPY),
    _L + "post_attention_layernorm.weight": (_L + "post_attention_layernorm.weight", COPY),  # pre-MLP norm
    _L + "mlp.gate_proj.weight": (_L + "mlp.gate_proj.weight", COPY),
    _L + "mlp.gate_proj.bias": (_L + "mlp.gate_proj.bias", COPY),
    _L + "mlp.up_proj.weight": (_L + "mlp.up_proj.weight", COPY),
    _L + "mlp.up_proj.bias": (_L + "mlp.up_proj.bias", COPY),
    _L + "mlp.down_proj.weight": (_L + "mlp.down_proj.weight", COPY),
    _L + "mlp.down_proj.bias": (_L + "mlp.down_proj.bias", COPY),
    "model.norm.weight": ("model.norm.weight", COPY),
    "lm_head.weight": ("lm_head.weight", COPY),
}

# Gemma 3: Gemma's post_attention_layernorm is the norm AFTER attention (TLM: post_mixer_layernorm); Gemma's
# pre_feedforward_layernorm is the norm before the MLP (TLM, Llama meaning: post_attention_layernorm).
# Norm weights are stored as-is: both sides compute x̂·(1 + w).
_GEMMA3_TENSORS: dict[str, tuple[str | tuple[str, ...], str]] = {
    **{k: v for k, v in _LLAMA_STYLE_TENSORS.items() if "post_attention_layernorm" not in k},
    _L + "post_attention_layernorm.weight": (_L + "post_mixer_layernorm.weight", COPY),
    _L + "pre_feedforward_layernorm.weight": (_L + "post_attention_layernorm.weight", COPY),
    _L + "post_feedforward_layernorm.weight": (_L + "post_feedforward_layernorm.weight", COPY),
}

_H = "transformer.h.{i}."
_GPT2_TENSORS: dict[str, tuple[str | tuple[str, ...], str]] = {
    "transformer.wte.weight": ("model.embed_tokens.weight", COPY),
    "transformer.wpe.weight": ("model.embed_positions.weight", COPY),
    _H + "ln_1.weight": (_L + "input_layernorm.weight", COPY),
    _H + "ln_1.bias": (_L + "input_layernorm.bias", COPY),
    _H + "attn.c_attn.weight": ((_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight",
                                 _L + "self_attn.v_proj.weight"), QKV_CONV1D),
    _H + "attn.c_attn.bias": ((_L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias",
                               _L + "self_attn.v_proj.bias"), QKV_BIAS),
    _H + "attn.c_proj.weight": (_L + "self_attn.o_proj.weight", CONV1D),
    _H + "attn.c_proj.bias": (_L + "self_attn.o_proj.bias", COPY),
    _H + "ln_2.weight": (_L + "post_attention_layernorm.weight", COPY),
    _H + "ln_2.bias": (_L + "post_attention_layernorm.bias", COPY),
    _H + "mlp.c_fc.weight": (_L + "mlp.up_proj.weight", CONV1D),
    _H + "mlp.c_fc.bias": (_L + "mlp.up_proj.bias", COPY),
    _H + "mlp.c_proj.weight": (_L + "mlp.down_proj.weight", CONV1D),
    _H + "mlp.c_proj.bias": (_L + "mlp.down_proj.bias", COPY),
    "transformer.ln_f.weight": ("model.norm.weight", COPY),
    "transformer.ln_f.bias": ("model.norm.bias", COPY),
    "lm_head.weight": ("lm_head.weight", COPY),
}

TENSOR_TABLES: dict[str, dict[str, tuple[str | tuple[str, ...], str]]] = {
    "llama": _LLAMA_STYLE_TENSORS,
    "qwen2": _LLAMA_STYLE_TENSORS,
    "qwen3": _LLAMA_STYLE_TENSORS,
    "gemma3": _GEMMA3_TENSORS,
    "gpt2": _GPT2_TENSORS,
}

# Source tensors that are deliberately not imported: non-persistent buffers some checkpoints still contain
# (RoPE tables, GPT-2's causal-mask buffers, Gemma's embed_scale) and the vision side of multimodal Gemma 3.
_ROPE_BUFFERS = (r"model\.rotary_emb\.(original_)?inv_freq",
                 r"model\.layers\.\d+\.self_attn\.rotary_emb\.(original_)?inv_freq")
DROPPED_TENSORS: dict[str, tuple[str, ...]] = {
    "llama": _ROPE_BUFFERS,
    "qwen2": _ROPE_BUFFERS,
    "qwen3": _ROPE_BUFFERS,
    "gemma3": _ROPE_BUFFERS + (r"model\.rotary_emb\.\w+_inv_freq", r"model\.embed_tokens\.embed_scale",
                               # multimodal checkpoints: the vision side is not part of the language model
                               r"model\.vision_tower\..*", r"model\.multi_modal_projector\..*"),
    "gpt2": (r"transformer\.h\.\d+\.attn\.(bias|masked_bias)",),  # the old causal-mask buffers
}

# llama.cpp's tensor names of the Llama block (transformers names, the layer index as {i}): what the GGUF export
# writes and the GGUF reader maps back
GGUF_LLAMA_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}


# ----------------------------------------------------------------------------------------------- configs


def family_of(hf_config) -> str:
    """The family of a transformers config; ValueError listing the supported model types."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r}: tlm-convert imports "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)} (families: {', '.join(FAMILIES)})")
    return SUPPORTED_ARCHITECTURES[model_type]


def _refuse(problems: list[str], field: str, value, why: str) -> None:
    problems.append(f"{field}={value!r}: {why}")


def _rope(params, where: str, hf, problems: list[str]) -> dict | None:
    """TLM rope dict for transformers' rope_parameters (one layer type); refusals go to ``problems``."""
    if not isinstance(params, dict):
        _refuse(problems, where, params, "expected a dict with rope_type and rope_theta")
        return None
    before = len(problems)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        _refuse(problems, f"{where}.rope_type", rope_type,
                f"TLM implements RoPE types {', '.join(ROPE_TYPES)} only; {rope_type!r} changes the frequencies "
                "or the attention scaling, so the import would not be exact")
    partial = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        _refuse(problems, f"{where}.partial_rotary_factor", partial, "TLM rotates the whole head dimension")
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        _refuse(problems, f"{where}.rope_theta", theta, "expected a positive number")
    if len(problems) > before:
        return None
    out = {"rope_type": rope_type, "rope_theta": float(theta)}
    if rope_type == "linear":
        out["factor"] = params.get("factor")
    elif rope_type == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            out[key] = params.get(key)
        # transformers' fallback when the checkpoint does not name it (standardize_rope_params)
        out["original_max_position_embeddings"] = params.get("original_max_position_embeddings",
                                                             hf.max_position_embeddings)
    missing = [k for k, v in out.items() if v is None]
    if missing:
        _refuse(problems, where, params, f"rope_type {rope_type!r} needs {', '.join(missing)}")
    return out


def _activation(name, field: str, problems: list[str]) -> str:
    if name not in ACTIVATIONS:
        _refuse(problems, field, name, f"TLM implements the activations {', '.join(sorted(ACTIVATIONS))}")
    return name


def _token_ids(hf) -> dict:
    return {k: getattr(hf, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


def _decoder_fields(hf, problems: list[str], hidden_act_field: str = "hidden_act") -> dict:
    """Fields shared by the RoPE decoder families (Llama, Mistral, Qwen2, Qwen3, Gemma 3)."""
    n_layers = hf.num_hidden_layers
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    return dict(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_hidden_layers=n_layers,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=hf.intermediate_size,
        intermediate_sizes=[hf.intermediate_size] * n_layers,
        hidden_act=_activation(getattr(hf, hidden_act_field), hidden_act_field, problems),
        norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        attention_dropout=getattr(hf, "attention_dropout", 0.0) or 0.0,
        initializer_range=getattr(hf, "initializer_range", 0.02),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        use_cache=getattr(hf, "use_cache", True),
        **_token_ids(hf),
    )


def _windows(hf, layer_types, window, problems: list[str]) -> dict:
    layer_types = list(layer_types)
    if "sliding_attention" in layer_types and not (isinstance(window, int) and window > 0):
        _refuse(problems, "sliding_window", window,
                f"layer_types has sliding_attention layers ({layer_types}) but no window (transformers cannot "
                "run this config either)")
    bad = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if bad:
        _refuse(problems, "layer_types", bad, "TLM knows full_attention and sliding_attention layers only")
    if len(layer_types) != hf.num_hidden_layers:
        _refuse(problems, "layer_types", layer_types, f"expected {hf.num_hidden_layers} entries")
    uses_window = "sliding_attention" in layer_types
    return dict(layer_types=layer_types, sliding_window=window if uses_window else None)


def _llama_fields(hf, problems: list[str]) -> dict:
    fields = _decoder_fields(hf, problems)
    bias = bool(getattr(hf, "attention_bias", False))  # Llama: q, k, v AND o
    fields.update(attention_bias=bias, attention_out_bias=bias, mlp_bias=bool(getattr(hf, "mlp_bias", False)))
    fields["rope_parameters"] = _rope(hf.rope_parameters, "rope_parameters", hf, problems)
    if hf.model_type == "mistral":  # MistralModel applies sliding_window (when set) to every layer
        window = getattr(hf, "sliding_window", None)
        kind = "sliding_attention" if window is not None else "full_attention"
        fields.update(_windows(hf, [kind] * hf.num_hidden_layers, window, problems))
    return fields


def _qwen_fields(hf, problems: list[str]) -> dict:
    fields = _decoder_fields(hf, problems)
    if hf.model_type == "qwen3":
        bias = bool(getattr(hf, "attention_bias", False))  # Qwen3: q, k, v AND o
        fields.update(attention_bias=bias, attention_out_bias=bias)
    fields["rope_parameters"] = _rope(hf.rope_parameters, "rope_parameters", hf, problems)
    # sliding_window is already None unless use_sliding_window; layer_types already follows max_window_layers
    layer_types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    fields.update(_windows(hf, layer_types, getattr(hf, "sliding_window", None), problems))
    return fields


def _gemma3_fields(hf, problems: list[str]) -> dict:
    text = hf.text_config if hf.model_type == "gemma3" else hf
    fields = _decoder_fields(text, problems, hidden_act_field="hidden_activation")
    if hf.model_type == "gemma3":  # the multimodal model ties lm_head by its top-level flag
        fields["tie_word_embeddings"] = bool(getattr(hf, "tie_word_embeddings", False))
    bias = bool(getattr(text, "attention_bias", False))  # Gemma 3: q, k, v AND o
    fields.update(attention_bias=bias, attention_out_bias=bias, query_pre_attn_scalar=text.query_pre_attn_scalar)
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(text, name, None) is not None:
            _refuse(problems, name, getattr(text, name), "TLM has no tanh soft-capping (Gemma 3 checkpoints use None)")
    if getattr(text, "use_bidirectional_attention", False):
        _refuse(problems, "use_bidirectional_attention", True, "TLM is a causal LM")
    fields.update(_windows(text, text.layer_types, getattr(text, "sliding_window", None), problems))
    rope = text.rope_parameters
    if not (isinstance(rope, dict) and set(rope) <= {"full_attention", "sliding_attention"}):
        _refuse(problems, "rope_parameters", rope, "Gemma 3 expects one dict per layer type "
                "{'full_attention': {...}, 'sliding_attention': {...}}")
        return fields
    used = set(fields["layer_types"])
    if "full_attention" in used or "sliding_attention" not in used:
        fields["rope_parameters"] = _rope(rope.get("full_attention"), "rope_parameters['full_attention']", text,
                                          problems)
    if "sliding_attention" in used:
        local = _rope(rope.get("sliding_attention"), "rope_parameters['sliding_attention']", text, problems)
        fields["local_rope_parameters"] = local
        if "full_attention" not in used:  # all layers local: use it as the (only) table
            fields["rope_parameters"] = local
    return fields


def _gpt2_fields(hf, problems: list[str]) -> dict:
    for name, why in (
        ("scale_attn_by_inverse_layer_idx", "TLM does not scale attention scores by 1/(layer_idx+1)"),
        ("reorder_and_upcast_attn", "TLM does not reproduce GPT-2's reordered/upcast attention numerics"),
        ("add_cross_attention", "cross-attention blocks are not part of a TLM"),
    ):
        if getattr(hf, name, False):
            _refuse(problems, name, True, why)
    inner = hf.n_inner if hf.n_inner is not None else 4 * hf.n_embd
    return dict(
        vocab_size=hf.vocab_size,
        hidden_size=hf.n_embd,
        num_hidden_layers=hf.n_layer,
        num_attention_heads=hf.n_head,
        num_key_value_heads=hf.n_head,
        head_dim=hf.n_embd // hf.n_head,
        intermediate_size=inner,
        intermediate_sizes=[inner] * hf.n_layer,
        hidden_act=_activation(hf.activation_function, "activation_function", problems),
        norm_eps=hf.layer_norm_epsilon,
        max_position_embeddings=hf.n_positions,
        # scale_attn_weights=False: scores are not scaled at all, i.e. a scale of 1.0**-0.5
        query_pre_attn_scalar=None if getattr(hf, "scale_attn_weights", True) else 1.0,
        attention_dropout=getattr(hf, "attn_pdrop", 0.0) or 0.0,
        initializer_range=getattr(hf, "initializer_range", 0.02),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        use_cache=getattr(hf, "use_cache", True),
        **_token_ids(hf),
    )


_FIELD_MAPPERS = {"llama": _llama_fields, "qwen2": _qwen_fields, "qwen3": _qwen_fields, "gemma3": _gemma3_fields,
                  "gpt2": _gpt2_fields}

_TLM_FIELDS = frozenset(inspect.signature(TLMConfig.__init__).parameters) - {"self", "kwargs"}


def _check_overrides(overrides: dict) -> None:
    base = PretrainedConfig()
    unknown = [k for k in overrides if k not in _TLM_FIELDS and not hasattr(base, k) and k != "attn_implementation"]
    if unknown:
        raise ValueError(f"unknown TLMConfig field(s) in overrides: {', '.join(map(repr, unknown))}")


def tlm_config_from_hf(hf_config, **overrides) -> TLMConfig:
    """The TLMConfig that reproduces ``hf_config`` exactly (uniform widths), then ``overrides`` on top.

    Raises ValueError naming every source setting TLM cannot reproduce.
    """
    family = family_of(hf_config)
    problems: list[str] = []
    fields = {**FAMILY_BLOCK[family], **_FIELD_MAPPERS[family](hf_config, problems)}
    if problems:
        raise ValueError(f"cannot import {hf_config.model_type!r} exactly:\n  - " + "\n  - ".join(problems))
    dtype = getattr(hf_config, "dtype", None)
    if dtype is not None:
        fields["dtype"] = dtype
    _check_overrides(overrides)
    fields.update(overrides)
    return TLMConfig(**fields)


# ----------------------------------------------------------------------------------------------- tensors


def canonical_source_state_dict(hf_config, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint under the canonical source names used by the tables (a new dict; tensors untouched)."""
    family, model_type = family_of(hf_config), hf_config.model_type
    out = {}
    for name, tensor in state_dict.items():
        if family == "gpt2" and not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name  # hub GPT-2 files store the base model without its prefix
        elif model_type == "gemma3":
            for old, new in (("language_model.model.", "model."), ("model.language_model.", "model."),
                             ("language_model.lm_head.", "lm_head."), ("vision_tower.", "model.vision_tower."),
                             ("multi_modal_projector.", "model.multi_modal_projector.")):
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
        if name in out:
            raise ValueError(f"tensor {name!r} appears twice in the checkpoint under different spellings")
        out[name] = tensor
    return out


def layer_template(name: str) -> tuple[str, int | None]:
    m = re.search(r"\.(\d+)\.", name)
    if m is None:
        return name, None
    return name[: m.start()] + ".{i}." + name[m.end():], int(m.group(1))


def transform_tensor(kind: str, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if kind == COPY:
        return (tensor,)
    if kind == CONV1D:
        return (tensor.t().contiguous(),)
    if kind == QKV_CONV1D:
        return tuple(part.t().contiguous() for part in tensor.chunk(3, dim=1))
    if kind == QKV_BIAS:
        return tuple(part.clone() for part in tensor.chunk(3, dim=0))
    raise AssertionError(kind)


def tlm_targets(hf_config, names) -> tuple[dict[str, tuple[str, str, int]], list[str]]:
    """Where every TLM tensor comes from: TLM name -> (canonical source name, transform kind, part of its output),
    in the order of ``names`` (canonical source names), and the source names that have no place in the model.
    Dropped buffers and a tied head's copy are skipped."""
    family = family_of(hf_config)
    config = tlm_config_from_hf(hf_config)
    table, drops = TENSOR_TABLES[family], [re.compile(p) for p in DROPPED_TENSORS[family]]
    targets, unexpected = {}, []
    for name in names:
        if any(p.fullmatch(name) for p in drops):
            continue
        template, layer = layer_template(name)
        if template not in table or (layer is not None and layer >= config.num_hidden_layers):
            unexpected.append(name)
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the source's copy is ignored, exactly as transformers does
        outs, kind = table[template]
        for part, out in enumerate((outs,) if isinstance(outs, str) else outs):
            targets[out.format(i=layer)] = (name, kind, part)
    return targets, unexpected


def gather(targets: dict[str, tuple[str, str, int]], names, load) -> dict[str, torch.Tensor]:
    """TLM name -> tensor for ``names`` (keys of ``targets``, see :func:`tlm_targets`), each source tensor read with
    ``load(source name)`` and transformed once."""
    parts: dict[str, tuple[torch.Tensor, ...]] = {}
    out = {}
    for name in names:
        source, kind, part = targets[name]
        if source not in parts:
            parts[source] = transform_tensor(kind, load(source))
        out[name] = parts[source][part]
    return out


def tlm_state_dict_from_hf(hf_config, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """TLM tensors for a source checkpoint (pure: the input is not modified; unchanged tensors are shared).

    With tied embeddings ``lm_head.weight`` is the very tensor of ``model.embed_tokens.weight`` (so that
    ``load_state_dict(strict=True)`` is satisfied); drop it before writing with ``safetensors.save_file``.
    Raises ValueError for unknown tensors, missing tensors or wrong shapes (all of them at once).
    """
    config = tlm_config_from_hf(hf_config)  # refuses what cannot be reproduced
    canonical = canonical_source_state_dict(hf_config, state_dict)
    targets, unexpected = tlm_targets(hf_config, canonical)
    out = gather(targets, targets, canonical.__getitem__)
    if config.tie_word_embeddings and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    _check_against_model(config, out, unexpected)
    return out


def tlm_shapes(config: TLMConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the state dict of ``TLMForCausalLM(config)`` (built on the meta device)."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in TLMForCausalLM(config).state_dict().items()}


def _check_against_model(config: TLMConfig, tensors: dict[str, torch.Tensor], unexpected: list[str]) -> None:
    expected = tlm_shapes(config)
    problems = [f"unexpected source tensor {k!r}" for k in unexpected]
    problems += [f"missing TLM tensor {k!r} (expected shape {s})" for k, s in expected.items() if k not in tensors]
    problems += [f"TLM tensor {k!r} has no place in the model" for k in tensors if k not in expected]
    problems += [f"TLM tensor {k!r} has shape {tuple(v.shape)}, expected {expected[k]}"
                 for k, v in tensors.items() if k in expected and tuple(v.shape) != expected[k]]
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise ValueError("checkpoint does not match its config:\n  - " + "\n  - ".join(shown))


__all__ = ["SUPPORTED_ARCHITECTURES", "FAMILIES", "FAMILY_BLOCK", "TENSOR_TABLES", "DROPPED_TENSORS", "family_of",
           "tlm_config_from_hf", "tlm_state_dict_from_hf", "tlm_targets", "canonical_source_state_dict",
           "layer_template", "transform_tensor", "gather", "tlm_shapes", "GGUF_LLAMA_NAMES"]
