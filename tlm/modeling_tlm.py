"""TLM modeling: decoder layers composed in a loop from per-layer config lists.

Block (pre-norm; ``sandwich_norm`` adds Gemma 3's post-norms)::

    z = h + [post_mixer_layernorm]( self_attn( input_layernorm(h) ) )
    h' = z + [post_feedforward_layernorm]( mlp( post_attention_layernorm(z) ) )

Tensor names follow transformers' Llama (``model.layers.3.mlp.down_proj.weight``), so uniform Llama-family
checkpoints map onto a TLM key for key. Axis legend: B batch, N new tokens, T keys (past + new), d hidden.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .cache import TLMCache
from .cms import ContinuumMemory
from .configuration_tlm import TLMConfig
from .mixers import build_mixer, build_mlp
from .modules import RMSNorm, RotaryEmbedding, build_norm


class TLMDecoderLayer(nn.Module):
    def __init__(self, config: TLMConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.input_layernorm = build_norm(config)
        self.self_attn = build_mixer(config, layer_idx)
        self.post_attention_layernorm = build_norm(config)  # the pre-MLP norm, as in transformers' Llama
        self.mlp = build_mlp(config, layer_idx)
        if config.sandwich_norm:
            self.post_mixer_layernorm = build_norm(config)
            self.post_feedforward_layernorm = build_norm(config)
        self.sandwich = config.sandwich_norm

    def forward(self, hidden_states, position_embeddings, attention_mask, cache, token_mask=None):
        # hidden_states: (B, N, d) -> (B, N, d); token_mask: None or bool (B, N), False at pad tokens
        z = self.mix(hidden_states, position_embeddings, attention_mask, cache, token_mask)
        return self.feed_forward(z, cache, token_mask)

    def mix(self, hidden_states, position_embeddings, attention_mask, cache, token_mask=None):
        """Token-mixer half of the block: h -> z = h + mixer(norm(h))."""
        x = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache,
                           token_mask=token_mask)
        if self.sandwich:
            x = self.post_mixer_layernorm(x)
        return hidden_states + x

    def feed_forward(self, hidden_states, cache=None, token_mask=None):
        """MLP half of the block: z -> z + mlp(norm(z)) (the converter calibrates the two halves separately)."""
        x = self.post_attention_layernorm(hidden_states)
        if isinstance(self.mlp, ContinuumMemory):  # Hope's continuum memory keeps in-context state
            state = cache.layers[self.layer_idx].get("cms") if cache is not None else None
            x, state = self.mlp(x, state, use_cache=cache is not None, token_mask=token_mask)
            if cache is not None:
                cache.layers[self.layer_idx]["cms"] = state
        else:
            x = self.mlp(x)
        if self.sandwich:
            x = self.post_feedforward_layernorm(x)
        return hidden_states + x


class TLMPreTrainedModel(PreTrainedModel):
    config_class = TLMConfig
    config: TLMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["TLMDecoderLayer"]
    _supports_sdpa = True

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # TLMCache is created by the model itself (it holds memory states, not only KV)

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            _fresh_normal(module.weight, std)
            if module.bias is not None:
                _fresh_fill(module.bias, 0.0)
        elif isinstance(module, nn.Embedding):
            _fresh_normal(module.weight, std)
        elif isinstance(module, RMSNorm):
            _fresh_fill(module.weight, 0.0 if module.offset else 1.0)
        elif isinstance(module, nn.LayerNorm):
            _fresh_fill(module.weight, 1.0)
            _fresh_fill(module.bias, 0.0)
        elif isinstance(module, RotaryEmbedding):
            module.reset_inv_freq()

    def post_init(self):
        """After transformers' generic init, the mixer-specific inits (Titans' gate biases and identity convs, a
        closed memory combine). transformers skips `_init_weights` for modules without direct parameters, so this
        runs here, on every module that defines `init_special_weights`, for parameters not loaded from a checkpoint."""
        super().post_init()
        with torch.no_grad():
            for module in self.modules():
                if hasattr(module, "init_special_weights"):
                    module.init_special_weights(lambda p: not getattr(p, "_is_hf_initialized", False))


def _fresh_normal(p, std):
    if not getattr(p, "_is_hf_initialized", False):
        p.normal_(0.0, std)


def _fresh_fill(p, value):
    if not getattr(p, "_is_hf_initialized", False):
        p.fill_(value)


class TLMModel(TLMPreTrainedModel):
    def __init__(self, config: TLMConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        if config.position_embedding == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(TLMDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = build_norm(config)
        if config.position_embedding == "rope":
            self.rotary_emb = RotaryEmbedding(config.rope_parameters, config.head_dim)
            if config.local_rope_parameters is not None:
                self.local_rotary_emb = RotaryEmbedding(config.local_rope_parameters, config.head_dim)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        output_hidden_states=None,
        past_key_values=None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        cache = cache if cache is not None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training:
            use_cache = False  # recomputation would write the cache twice
        if use_cache and cache is None:
            cache = TLMCache(self.config.num_hidden_layers)
        if not use_cache:
            cache = None
        B, N, _ = inputs_embeds.shape
        past = cache.seen_tokens if cache is not None else 0
        if position_ids is None:
            position_ids = _position_ids(attention_mask, past, N, inputs_embeds.device, B)

        h = self.embed(inputs_embeds, position_ids)
        rope, masks = self.block_context(h, position_ids, attention_mask, past)
        token_mask = _token_mask(attention_mask, past, N, h.device)

        all_hidden = [] if output_hidden_states else None
        for layer in self.layers:
            if all_hidden is not None:
                all_hidden.append(h)
            args = (h, rope.get(layer.layer_type), masks[layer.layer_type], cache, token_mask)
            if self.gradient_checkpointing and self.training:
                fn = getattr(self, "_gradient_checkpointing_func", None) or _checkpoint
                h = fn(layer.__call__, *args)
            else:
                h = layer(*args)
        h = self.norm(h)
        if all_hidden is not None:
            all_hidden.append(h)
        if cache is not None:
            cache.seen_tokens += N
        return BaseModelOutputWithPast(last_hidden_state=h, cache=cache,
                                       hidden_states=tuple(all_hidden) if all_hidden is not None else None)

    def embed(self, inputs_embeds, position_ids):
        """Token embeddings -> block input: Gemma's sqrt(d) scale and GPT-2's learned positions where configured."""
        h = inputs_embeds
        if self.config.scale_embeddings:
            h = h * torch.tensor(self.config.hidden_size**0.5, dtype=h.dtype)
        if self.config.position_embedding == "learned":
            h = h + self.embed_positions(position_ids)
        return h

    def block_context(self, h, position_ids, attention_mask=None, past: int = 0) -> tuple[dict, dict]:
        """RoPE tables and attention masks per layer type, for running layers one at a time (as the converter does)."""
        n = h.shape[1]
        masks = {t: _attention_mask(attention_mask, past, n, self.config, t, h.device) for t in set(self.config.layer_types)}
        return self._rope_tables(h, position_ids), masks

    def _rope_tables(self, h, position_ids) -> dict:
        if self.config.position_embedding != "rope":
            return {}
        full = self.rotary_emb(h, position_ids)
        local = self.local_rotary_emb(h, position_ids) if hasattr(self, "local_rotary_emb") else full
        return {"full_attention": full, "sliding_attention": local}


def _checkpoint(fn, *args):
    return checkpoint(fn, *args, use_reentrant=False)


def _position_ids(attention_mask, past, n, device, batch):
    if attention_mask is not None and not bool(attention_mask.all()):  # left padding: count real tokens
        pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return pos[:, past : past + n].to(device)
    return torch.arange(past, past + n, device=device).unsqueeze(0).expand(batch, -1)


def _token_mask(attention_mask, past, n, device):
    """None when this call has no padding, else bool (B, N): True at the new tokens that are real."""
    if attention_mask is None:
        return None
    new = attention_mask[:, past : past + n].to(device).bool()
    return None if bool(new.all()) else new


def _attention_mask(attention_mask, past, n, config, layer_type, device):
    """None for plain causal attention, else bool (B|1, 1, N, T) with True = may attend."""
    total = past + n
    window = config.sliding_window if layer_type == "sliding_attention" else None
    padded = attention_mask is not None and not bool(attention_mask.all())
    if not padded and (window is None or total <= window):
        return None
    q = torch.arange(past, total, device=device)[:, None]  # (N, 1)
    k = torch.arange(total, device=device)[None, :]  # (1, T)
    mask = k <= q
    if window is not None:
        mask = mask & (q - k < window)
    mask = mask[None, None]  # (1, 1, N, T)
    if padded:
        mask = mask & attention_mask[:, None, None, :total].bool().to(device)
        mask = mask | (k == q)  # a padding query attends to itself: no all-masked (NaN) rows
    return mask


class TLMForCausalLM(TLMPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: TLMConfig):
        super().__init__(config)
        self.model = TLMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_hidden_states=None,
        logits_to_keep: int = 0,
        past_key_values=None,
        return_dict=None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache if cache is not None else past_key_values, inputs_embeds=inputs_embeds,
                         use_cache=use_cache, output_hidden_states=output_hidden_states)
        h = out.last_hidden_state
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h)  # (B, N, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache, hidden_states=out.hidden_states)

    def prepare_inputs_for_generation(self, input_ids, cache=None, past_key_values=None, attention_mask=None,
                                      inputs_embeds=None, position_ids=None, use_cache=True, **kwargs):
        """Feed only the tokens the cache has not seen; positions follow the attention mask (left padding)."""
        cache = cache if cache is not None else past_key_values
        past = cache.seen_tokens if cache is not None else 0
        inputs = {"cache": cache, "use_cache": use_cache, "attention_mask": attention_mask}
        if inputs_embeds is not None and past == 0:
            inputs["inputs_embeds"] = inputs_embeds
        else:
            inputs["input_ids"] = input_ids[:, past:]
        if position_ids is not None:
            inputs["position_ids"] = position_ids[:, past:]
        for key in ("logits_to_keep", "output_hidden_states"):
            if key in kwargs:
                inputs[key] = kwargs[key]
        return inputs


__all__ = ["TLMForCausalLM", "TLMModel", "TLMPreTrainedModel", "TLMDecoderLayer"]
