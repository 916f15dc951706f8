"""The transformers side of an export: the stock config of a TLM (``uniform_hf_config``, checked by
``check_round_trip``), its tensors under the source architecture's names (``hf_state_dict_from_tlm``), MLP padding
to one width, and which mixers a stock format can hold. Shared by the safetensors exports (export.py) and the GGUF
writer (gguf_export.py)."""

from __future__ import annotations

import torch

from tlm import TLMConfig

from .archs import (
    CONV1D,
    COPY,
    QKV_BIAS,
    QKV_CONV1D,
    SUPPORTED_ARCHITECTURES,
    TENSOR_TABLES,
    layer_template,
    tlm_config_from_hf,
)
from .checkpoint import Source
from .errors import ConversionError, one_line

# model_type -> (transformers module, base model class, causal LM class, MLP class, layer list, base attribute)
STOCK_CLASSES: dict[str, tuple[str, str, str, str, str, str]] = {
    "llama": ("llama", "LlamaModel", "LlamaForCausalLM", "LlamaMLP", "layers", "model"),
    "mistral": ("mistral", "MistralModel", "MistralForCausalLM", "MistralMLP", "layers", "model"),
    "qwen2": ("qwen2", "Qwen2Model", "Qwen2ForCausalLM", "Qwen2MLP", "layers", "model"),
    "qwen3": ("qwen3", "Qwen3Model", "Qwen3ForCausalLM", "Qwen3MLP", "layers", "model"),
    "gemma3_text": ("gemma3", "Gemma3TextModel", "Gemma3ForCausalLM", "Gemma3MLP", "layers", "model"),
    "gpt2": ("gpt2", "GPT2Model", "GPT2LMHeadModel", "GPT2MLP", "h", "transformer"),
}
WIDTH_KEY = {model_type: ("n_inner" if model_type == "gpt2" else "intermediate_size") for model_type in STOCK_CLASSES}


def with_widths(config: TLMConfig, widths: list[int]) -> TLMConfig:
    fields = config.to_dict()
    for key in ("model_type", "transformers_version", "architectures", "auto_map", "_name_or_path"):
        fields.pop(key, None)
    fields["intermediate_sizes"] = list(widths)
    return TLMConfig(**fields)


def check_mixers(config: TLMConfig, fmt: str, target: str) -> None:
    others = sorted({m for m in config.mixer if m != "attention"})
    if others:
        layers = [i for i, m in enumerate(config.mixer) if m != "attention"]
        where = ", ".join(map(str, layers[:8])) + (" ..." if len(layers) > 8 else "")
        raise ConversionError(f"export '{fmt}' cannot represent {'/'.join(others)} layers (layers {where}): {target} "
                              "has softmax attention blocks only; use --export tlm")


def target_model_type(config: TLMConfig, source: Source | None) -> str:
    """The transformers model_type the hf / padded / deci views use: the source's, else inferred from the block."""
    if source is not None and source.hf_config is not None:
        model_type = source.hf_config.model_type
        return "gemma3_text" if model_type == "gemma3" else model_type  # the text model only: no vision tower
    if config.position_embedding == "learned" or config.norm_type == "layernorm":
        return "gpt2"
    if config.sandwich_norm or config.norm_offset:
        return "gemma3_text"
    if config.qk_norm:
        return "qwen3"
    if config.attention_bias and not config.attention_out_bias:
        return "qwen2"
    if set(config.layer_types) == {"sliding_attention"}:
        return "mistral"
    if "sliding_attention" in config.layer_types:
        return "qwen2"
    return "llama"


def _rope_out(params: dict | None) -> dict | None:
    return dict(params) if params is not None else None


def _token_fields(config: TLMConfig) -> dict:
    return {k: getattr(config, k, None) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}


def _decoder_fields(config: TLMConfig, width: int) -> dict:
    return dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=int(width),
                num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
                num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
                max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.norm_eps,
                initializer_range=config.initializer_range, use_cache=config.use_cache,
                tie_word_embeddings=config.tie_word_embeddings, attention_dropout=config.attention_dropout,
                rope_parameters=_rope_out(config.rope_parameters), **_token_fields(config))


def uses_sliding_window(config: TLMConfig) -> bool:
    return "sliding_attention" in config.layer_types


def _fields_for(model_type: str, config: TLMConfig, width: int) -> dict:
    """transformers config fields of ``model_type`` that describe ``config`` (the inverse of archs' mapping)."""
    if model_type == "gpt2":
        scalar = config.query_pre_attn_scalar
        return dict(vocab_size=config.vocab_size, n_embd=config.hidden_size, n_layer=config.num_hidden_layers,
                    n_head=config.num_attention_heads, n_inner=int(width), n_positions=config.max_position_embeddings,
                    activation_function=config.hidden_act, layer_norm_epsilon=config.norm_eps,
                    scale_attn_weights=scalar is None, attn_pdrop=config.attention_dropout,
                    initializer_range=config.initializer_range, use_cache=config.use_cache,
                    tie_word_embeddings=config.tie_word_embeddings, **_token_fields(config))
    fields = _decoder_fields(config, width)
    if model_type == "gemma3_text":
        fields.pop("rope_parameters")
        full = _rope_out(config.rope_parameters)
        local = _rope_out(config.local_rope_parameters) or full
        scalar = config.query_pre_attn_scalar
        if scalar is not None and float(scalar).is_integer():
            scalar = int(scalar)  # Gemma3TextConfig types it as int
        fields.update(hidden_activation=config.hidden_act, attention_bias=config.attention_bias,
                      query_pre_attn_scalar=scalar,
                      layer_types=list(config.layer_types), sliding_window=config.sliding_window,
                      rope_parameters={"full_attention": full, "sliding_attention": local},
                      final_logit_softcapping=None, attn_logit_softcapping=None, use_bidirectional_attention=False)
        return fields
    fields["hidden_act"] = config.hidden_act
    if model_type == "llama":
        fields.update(attention_bias=config.attention_bias, mlp_bias=config.mlp_bias)
    elif model_type == "mistral":
        fields["sliding_window"] = config.sliding_window if uses_sliding_window(config) else None
    elif model_type in ("qwen2", "qwen3"):
        sliding = [i for i, t in enumerate(config.layer_types) if t == "sliding_attention"]
        fields.update(use_sliding_window=bool(sliding), sliding_window=config.sliding_window if sliding else None,
                      max_window_layers=sliding[0] if sliding else config.num_hidden_layers,
                      layer_types=list(config.layer_types))
        if model_type == "qwen3":
            fields["attention_bias"] = config.attention_bias
    return fields


# keys of a source config that the export recomputes or that must not travel to the new checkpoint
_DROP_SOURCE_KEYS = ("model_type", "transformers_version", "architectures", "auto_map", "per_layer_config",
                     "serialize_explicit_per_layer_config", "allow_global_per_layer_attribute_access",
                     "_name_or_path", "name_or_path", "_model_name_or_path", "quantization_config", "rope_scaling",
                     "rope_theta", "dtype",
                     "torch_dtype", "block_configs", "_attn_implementation_autoset")


def uniform_hf_config(config: TLMConfig, model_type: str, source: Source | None, width: int,
                      dtype: torch.dtype = torch.float32):
    """A stock transformers config of ``model_type`` describing ``config`` with every MLP ``width`` wide.

    Fields the TLM does not model (dropouts, token ids of the source, ...) are kept from the source config when
    it has the same model_type.
    """
    from transformers import AutoConfig

    fields: dict = {}
    src = source.hf_config if source is not None else None
    if src is not None:
        src = src.text_config if src.model_type == "gemma3" else src
        src_type = "gemma3_text" if src.model_type in ("gemma3", "gemma3_text") else src.model_type
        if src_type == model_type:
            try:
                fields = src.to_dict()
            except Exception:  # e.g. a heterogeneous source config: rebuild from the TLM only
                fields = {}
    for key in _DROP_SOURCE_KEYS:
        fields.pop(key, None)
    fields.update(_fields_for(model_type, config, width))
    try:
        hf_config = AutoConfig.for_model(model_type, **fields)
    except Exception as err:
        raise ConversionError(f"cannot describe this TLM as a {model_type} config ({one_line(err)}); use --export "
                              "tlm") from None
    hf_config.dtype = dtype
    return hf_config


_COMPARED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "hidden_act", "mlp_gated", "mlp_bias", "norm_type", "norm_eps", "norm_offset",
                    "sandwich_norm", "attention_bias", "attention_out_bias", "qk_norm", "query_pre_attn_scalar",
                    "position_embedding", "max_position_embeddings", "rope_parameters", "local_rope_parameters",
                    "layer_types", "sliding_window", "scale_embeddings", "tie_word_embeddings")


def _norm(value):
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_norm(v) for v in value]
    return value


def check_round_trip(hf_config, config: TLMConfig, fmt: str) -> None:
    """ConversionError unless importing ``hf_config`` gives back the block of ``config`` (the export is exact)."""
    try:
        back = tlm_config_from_hf(hf_config)
    except ValueError as err:
        raise ConversionError(f"export '{fmt}' cannot represent this TLM as {hf_config.model_type} "
                              f"({one_line(err)}); use --export tlm") from None
    diffs = []
    for name in _COMPARED_FIELDS:
        mine, theirs = getattr(config, name, None), getattr(back, name, None)
        if name == "local_rope_parameters" and not uses_sliding_window(config):
            continue  # unused without sliding layers
        if name == "sliding_window" and not uses_sliding_window(config):
            continue
        if name == "max_position_embeddings" and config.position_embedding != "learned" and \
                config.rope_parameters.get("rope_type") != "llama3":
            continue  # only the learned table and llama3 scaling depend on it
        if _norm(mine) != _norm(theirs):
            diffs.append(f"{name}={mine!r} ({hf_config.model_type} gives {theirs!r})")
    if diffs:
        raise ConversionError(f"export '{fmt}' cannot represent this TLM as {hf_config.model_type}: "
                              f"{'; '.join(diffs[:4])}; use --export tlm")


# ============================================================================================== tensors


def hf_state_dict_from_tlm(config: TLMConfig, state_dict, model_type: str) -> dict[str, torch.Tensor]:
    """Source-architecture tensors for a TLM state dict: the inverse of ``archs.tlm_state_dict_from_hf``.

    GPT-2: q/k/v are fused back into ``c_attn`` and linear weights transposed to Conv1D layout; Gemma 3: the norm
    names go back to Gemma's. A tied ``lm_head.weight`` is dropped (transformers re-ties it).
    """
    family = SUPPORTED_ARCHITECTURES[model_type]
    inverse: dict[str, tuple[str, str, int, int]] = {}
    for src, (targets, kind) in TENSOR_TABLES[family].items():
        targets = (targets,) if isinstance(targets, str) else targets
        for j, target in enumerate(targets):
            inverse[target] = (src, kind, j, len(targets))
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, list] = {}
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        template, layer = layer_template(name)
        if template not in inverse:
            raise ConversionError(f"TLM tensor '{name}' has no place in a {model_type} checkpoint; use --export tlm")
        src, kind, j, n = inverse[template]
        src_name = src.format(i=layer) if layer is not None else src
        if n == 1:
            out[src_name] = tensor.t().contiguous() if kind == CONV1D else tensor
            continue
        slot = parts.setdefault(src_name, [None] * n)
        slot[j] = tensor
        if all(p is not None for p in slot):
            if kind == QKV_CONV1D:
                out[src_name] = torch.cat([p.t() for p in slot], dim=1).contiguous()
            elif kind == QKV_BIAS:
                out[src_name] = torch.cat(slot, dim=0)
            else:
                raise AssertionError(kind)
            del parts[src_name]
    if parts:
        name = next(iter(parts))
        raise ConversionError(f"cannot rebuild {model_type} tensor '{name}': some of its q/k/v parts are missing "
                              "from the TLM state dict")
    assert all(kind in (COPY, CONV1D, QKV_CONV1D, QKV_BIAS) for _, kind in TENSOR_TABLES[family].values())
    return out


def pad_mlp_state_dict(config: TLMConfig, state_dict, width: int) -> dict[str, torch.Tensor]:
    """Every layer's MLP zero-padded to ``width`` neurons (TLM names): the model computes the same function.

    New neurons get zero gate/up rows (and bias entries) and zero down_proj columns; silu(0)·0 = 0, gelu(0) = 0.
    """
    out = dict(state_dict)
    for i, w in enumerate(config.intermediate_sizes):
        if w > width:
            raise ConversionError(f"layer {i} is {w} wide, more than the padded width {width}")
        if w == width:
            continue
        extra = width - w
        for name in ("gate_proj.weight", "up_proj.weight", "gate_proj.bias", "up_proj.bias"):
            key = f"model.layers.{i}.mlp.{name}"
            if key in out:
                t = out[key]
                out[key] = torch.cat([t, t.new_zeros((extra, *t.shape[1:]))], dim=0)
        key = f"model.layers.{i}.mlp.down_proj.weight"
        t = out[key]
        out[key] = torch.cat([t, t.new_zeros((t.shape[0], extra))], dim=1)
    return out


__all__ = ["STOCK_CLASSES", "WIDTH_KEY", "check_mixers", "check_round_trip", "hf_state_dict_from_tlm", "pad_mlp_state_dict", "target_model_type", "uniform_hf_config", "uses_sliding_window", "with_widths"]
