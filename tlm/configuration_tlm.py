"""TLMConfig: the single source of truth for a Tapered Language Model.

Per-layer choices are explicit lists of length ``num_hidden_layers``:

* ``intermediate_sizes[i]`` is layer i's MLP width. If it is not given it is resolved once, at construction, from
  ``intermediate_size`` (the uniform base width) and the taper spec (``schedule``, ``taper_ratio``,
  ``multiple_of``, ``steepness``); the spec is kept beside it for provenance only. Loading never re-derives widths.
* ``mixer[i]`` is layer i's token mixer: "attention", "gated_attention", "hope_attention" or "titans".
* ``layer_types[i]`` is "full_attention" or "sliding_attention" (Mistral / Qwen2 / Gemma 3 style windows).

The block options are the ones needed to express the uniform checkpoints the converter imports exactly:
Llama / Mistral / SmolLM, Qwen2, Qwen3, Gemma 3 and GPT-2 (see ``FAMILY_NOTES`` below for the mapping).
Construction validates every field and reports every problem at once.
"""

from __future__ import annotations

import math

from transformers import PretrainedConfig

from .cms import parse_mode
from .mixers import MIXERS
from .mlp import ACTIVATIONS
from .schedule import taper_widths

LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "linear", "llama3")
NORM_TYPES = ("rmsnorm", "layernorm")
POSITION_TYPES = ("rope", "learned")
HOPE_MODES = ("static", "online", "slow(m)")

FAMILY_NOTES = """
Llama/Mistral/SmolLM: defaults (rmsnorm, rope, gated silu MLP); Mistral adds sliding_window.
Qwen2: attention_bias=True (q/k/v only; attention_out_bias=False).
Qwen3: qk_norm=True.
Gemma 3: hidden_act=gelu_pytorch_tanh, norm_offset=True, sandwich_norm=True, qk_norm=True, scale_embeddings=True,
         layer_types alternating with local_rope_parameters, query_pre_attn_scalar.
GPT-2: norm_type=layernorm, position_embedding=learned, mlp_gated=False, hidden_act=gelu_new, biases everywhere.
"""


class TLMConfig(PretrainedConfig):
    r"""Configuration of a Tapered Language Model (model_type ``"tlm"``).

    Args (beyond the usual transformers names ``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
    ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``max_position_embeddings``,
    ``initializer_range``, ``tie_word_embeddings``, ``use_cache``):
        intermediate_size: base (uniform) MLP width D.
        intermediate_sizes: per-layer MLP widths; derived from the taper spec when omitted.
        schedule, taper_ratio, multiple_of, steepness: the taper spec passed to ``taper_widths``.
        mixer: one mixer name for every layer, or a list with one name per layer.
        hidden_act, mlp_gated, mlp_bias: MLP form (SwiGLU by default; GPT-2: ungated gelu with biases).
        norm_type, norm_eps, norm_offset, sandwich_norm: norms ((1+w) RMSNorm and post-norms for Gemma 3).
        attention_bias, attention_out_bias, qk_norm, query_pre_attn_scalar: attention details.
        position_embedding: "rope" or "learned" (GPT-2).
        rope_parameters, local_rope_parameters: ``{"rope_type", "rope_theta", ...}`` for full and sliding layers.
        layer_types, sliding_window: per-layer attention window.
        scale_embeddings: multiply embeddings by sqrt(hidden_size) (Gemma).
        gate_type: gated attention gate, "elementwise" or "headwise".
        titans_*: Titans memory (heads, head dim, depth, expansion, chunk size, theta_max, conv kernel, and the
            per-token surprise-norm clip that keeps the inner updates bounded; None disables it).
            titans_variant: "gate" (attention channels gated by the memory, 2σ(r W_c); W_c = 0 upcycles exactly;
            the default) or "mag" (the Titans paper's MAG: normalised attention and memory branches combined,
            titans_persistent_tokens learned tokens N_p prepended to attention and memory; use sliding_attention
            layer_types for its sliding window).
        hope_*: Hope continuum memory (level shares, modes "static" / "online" / "slow(m)", topology, chunk size
            of online levels, inner learning rate η of the online levels' local rule; η = 0, the default per
            design/model.md §4.4, makes an online level compute exactly as a static one).
    """

    model_type = "tlm"
    keys_to_ignore_at_inference = ["cache"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 384,
        intermediate_size: int = 1024,
        intermediate_sizes: list[int] | None = None,
        schedule: str = "uniform",
        taper_ratio: tuple[float, ...] | list[float] | str = (1.5, 0.5),
        multiple_of: int | None = None,
        steepness: float = 10.0,
        num_hidden_layers: int = 6,
        num_attention_heads: int = 6,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        mixer: str | list[str] = "attention",
        hidden_act: str = "silu",
        mlp_gated: bool = True,
        mlp_bias: bool = False,
        norm_type: str = "rmsnorm",
        norm_eps: float = 1e-6,
        norm_offset: bool = False,
        sandwich_norm: bool = False,
        attention_bias: bool = False,
        attention_out_bias: bool = False,
        qk_norm: bool = False,
        query_pre_attn_scalar: float | None = None,
        attention_dropout: float = 0.0,
        position_embedding: str = "rope",
        max_position_embeddings: int = 2048,
        rope_parameters: dict | None = None,
        local_rope_parameters: dict | None = None,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        scale_embeddings: bool = False,
        gate_type: str = "elementwise",
        titans_num_heads: int | None = None,
        titans_head_dim: int | None = None,
        titans_memory_depth: int = 2,
        titans_memory_expansion: int = 2,
        titans_chunk_size: int = 16,
        titans_theta_max: float = 0.1,
        titans_conv_kernel: int = 4,
        titans_surprise_clip: float | None = 1.0,
        titans_variant: str = "gate",
        titans_persistent_tokens: int = 4,
        hope_level_shares: list[float] | None = None,
        hope_level_modes: list[str] | None = None,
        hope_topology: str = "chain",
        hope_chunk_size: int = 16,
        hope_inner_lr: float = 0.0,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        **kwargs,
    ):
        kwargs.pop("rope_scaling", None)  # legacy name; TLM reads rope_parameters only
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads if num_key_value_heads is not None else num_attention_heads
        self.head_dim = head_dim if head_dim is not None else _div_or_none(hidden_size, num_attention_heads)
        self.intermediate_size = intermediate_size
        self.schedule = schedule
        self.taper_ratio = list(taper_ratio) if not isinstance(taper_ratio, str) else taper_ratio
        self.multiple_of = multiple_of
        self.steepness = steepness
        self.mixer = [mixer] * num_hidden_layers if isinstance(mixer, str) else list(mixer)
        self.hidden_act = hidden_act
        self.mlp_gated = mlp_gated
        self.mlp_bias = mlp_bias
        self.norm_type = norm_type
        self.norm_eps = norm_eps
        self.norm_offset = norm_offset
        self.sandwich_norm = sandwich_norm
        self.attention_bias = attention_bias
        self.attention_out_bias = attention_out_bias
        self.qk_norm = qk_norm
        self.query_pre_attn_scalar = query_pre_attn_scalar
        self.attention_dropout = attention_dropout
        self.position_embedding = position_embedding
        self.max_position_embeddings = max_position_embeddings
        self.rope_parameters = dict(rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
        self.local_rope_parameters = dict(local_rope_parameters) if local_rope_parameters else None
        self.layer_types = list(layer_types) if layer_types is not None else ["full_attention"] * num_hidden_layers
        self.sliding_window = sliding_window
        self.scale_embeddings = scale_embeddings
        self.gate_type = gate_type
        self.titans_num_heads = titans_num_heads if titans_num_heads is not None else num_attention_heads
        self.titans_head_dim = titans_head_dim if titans_head_dim is not None else self.head_dim
        self.titans_memory_depth = titans_memory_depth
        self.titans_memory_expansion = titans_memory_expansion
        self.titans_chunk_size = titans_chunk_size
        self.titans_theta_max = titans_theta_max
        self.titans_conv_kernel = titans_conv_kernel
        self.titans_surprise_clip = titans_surprise_clip
        self.titans_variant = titans_variant
        self.titans_persistent_tokens = titans_persistent_tokens
        self.hope_level_shares = list(hope_level_shares) if hope_level_shares else [1 / 3, 1 / 3, 1 / 3]
        self.hope_level_modes = list(hope_level_modes) if hope_level_modes else ["online", "static", "static"]
        self.hope_topology = hope_topology
        self.hope_chunk_size = hope_chunk_size
        self.hope_inner_lr = hope_inner_lr
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        width_errors: list[str] = []
        self.intermediate_sizes = self._resolve_widths(intermediate_sizes, width_errors)
        self.validate_tlm(width_errors)  # before transformers' own checks, so every problem is reported at once
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.tie_word_embeddings = tie_word_embeddings

    # ------------------------------------------------------------------ widths
    def _resolve_widths(self, intermediate_sizes, errors: list[str]):
        if intermediate_sizes is not None:
            return [int(w) for w in intermediate_sizes]
        if not (isinstance(self.num_hidden_layers, int) and isinstance(self.intermediate_size, int)):
            return None  # reported by validate_tlm
        if self.num_hidden_layers < 1 or self.intermediate_size < 1:
            return None
        q = self.multiple_of or (16 if self.intermediate_size % 16 == 0 else 1)
        try:
            return taper_widths(
                self.num_hidden_layers,
                self.intermediate_size,
                schedule=self.schedule,
                ratio=self.taper_ratio,
                multiple_of=q,
                steepness=self.steepness,
            )
        except ValueError as err:
            errors.append(str(err))
            return None

    # -------------------------------------------------------------- validation
    def validate_tlm(self, extra_errors: list[str] | None = None) -> None:
        """Check every field; raise one ValueError listing all problems (field, value, what is allowed)."""
        errors = list(extra_errors or []) + _collect_errors(self)
        if errors:
            raise ValueError("invalid TLMConfig:\n  - " + "\n  - ".join(errors))

    @property
    def num_params_mlp(self) -> int:
        """MLP parameters summed over layers (linear in the widths: equal sums give equal counts)."""
        mats = 3 if self.mlp_gated else 2
        return sum(mats * self.hidden_size * w for w in self.intermediate_sizes)


def _div_or_none(a, b):
    return a // b if isinstance(a, int) and isinstance(b, int) and b > 0 else None


def _check_choice(errors, name, value, allowed):
    if value not in allowed:
        errors.append(f"{name}={value!r}: expected one of {', '.join(map(repr, allowed))}")


def _check_positive(errors, cfg, names):
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            errors.append(f"{name}={value!r}: expected a positive integer")


def _check_per_layer(errors, name, values, n, allowed):
    if len(values) != n:
        errors.append(f"{name} has {len(values)} entries: expected num_hidden_layers={n}")
    bad = [(i, v) for i, v in enumerate(values) if v not in allowed]
    if bad:
        where = ", ".join(f"layer {i}: {v!r}" for i, v in bad[:5])
        errors.append(f"{name} has unknown values ({where}): expected one of {', '.join(allowed)}")


def _check_rope(errors, name, params):
    if not isinstance(params, dict):
        errors.append(f"{name}={params!r}: expected a dict with rope_type and rope_theta")
        return
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        errors.append(f"{name}.rope_type={rope_type!r}: expected one of {', '.join(ROPE_TYPES)}")
    theta = params.get("rope_theta")
    if not isinstance(theta, (int, float)) or theta <= 0:
        errors.append(f"{name}.rope_theta={theta!r}: expected a positive number")
    needed = {"linear": ["factor"], "llama3": ["factor", "low_freq_factor", "high_freq_factor",
                                                "original_max_position_embeddings"]}.get(rope_type, [])
    missing = [k for k in needed if k not in params]
    if missing:
        errors.append(f"{name} with rope_type={rope_type!r} is missing {', '.join(missing)}")


def _collect_errors(cfg: TLMConfig) -> list[str]:
    errors: list[str] = []
    _check_positive(errors, cfg, ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                  "num_key_value_heads", "max_position_embeddings"])
    if errors:
        return errors  # the rest depends on these
    n = cfg.num_hidden_layers
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        errors.append(f"num_key_value_heads={cfg.num_key_value_heads} must divide "
                      f"num_attention_heads={cfg.num_attention_heads}")
    if not isinstance(cfg.head_dim, int) or cfg.head_dim < 1:
        errors.append(f"head_dim={cfg.head_dim!r}: expected a positive integer (hidden_size / num_attention_heads "
                      "when not divisible must be given explicitly)")
    elif cfg.position_embedding == "rope" and cfg.head_dim % 2:
        errors.append(f"head_dim={cfg.head_dim}: RoPE needs an even head dimension")
    widths = cfg.intermediate_sizes
    if widths is not None and (len(widths) != n or any(w < 1 for w in widths)):
        errors.append(f"intermediate_sizes={widths!r}: expected {n} positive widths")
    _check_per_layer(errors, "mixer", cfg.mixer, n, tuple(MIXERS))
    _check_per_layer(errors, "layer_types", cfg.layer_types, n, LAYER_TYPES)
    if "sliding_attention" in cfg.layer_types and not (isinstance(cfg.sliding_window, int) and cfg.sliding_window > 0):
        errors.append(f"sliding_window={cfg.sliding_window!r}: sliding_attention layers need a positive window")
    _check_choice(errors, "norm_type", cfg.norm_type, NORM_TYPES)
    _check_choice(errors, "position_embedding", cfg.position_embedding, POSITION_TYPES)
    _check_choice(errors, "gate_type", cfg.gate_type, ("elementwise", "headwise"))
    _check_choice(errors, "hope_topology", cfg.hope_topology, ("sum", "chain"))
    _check_choice(errors, "hidden_act", cfg.hidden_act, tuple(sorted(ACTIVATIONS)))
    if cfg.position_embedding == "rope":
        _check_rope(errors, "rope_parameters", cfg.rope_parameters)
        if cfg.local_rope_parameters is not None:
            _check_rope(errors, "local_rope_parameters", cfg.local_rope_parameters)
    if not (isinstance(cfg.norm_eps, (int, float)) and cfg.norm_eps > 0):
        errors.append(f"norm_eps={cfg.norm_eps!r}: expected a positive number")
    if cfg.norm_type == "layernorm" and cfg.norm_offset:
        errors.append("norm_offset=True is a (1+w) RMSNorm option: use it with norm_type='rmsnorm'")
    if "titans" in cfg.mixer:
        _check_positive(errors, cfg, ["titans_num_heads", "titans_head_dim", "titans_memory_depth",
                                      "titans_memory_expansion", "titans_chunk_size", "titans_conv_kernel"])
        _check_choice(errors, "titans_variant", cfg.titans_variant, ("gate", "mag"))
        if not (isinstance(cfg.titans_persistent_tokens, int) and cfg.titans_persistent_tokens >= 0):
            errors.append(f"titans_persistent_tokens={cfg.titans_persistent_tokens!r}: expected an integer >= 0")
    if "hope_attention" in cfg.mixer:
        _check_hope(errors, cfg)
    return errors


def _valid_mode(mode) -> bool:
    try:
        parse_mode(mode)
    except ValueError:
        return False
    return True


def _check_hope(errors, cfg):
    shares, modes = cfg.hope_level_shares, cfg.hope_level_modes
    if len(shares) != len(modes):
        errors.append(f"hope_level_shares has {len(shares)} entries but hope_level_modes has {len(modes)}")
    if any(s <= 0 for s in shares) or not math.isclose(sum(shares), 1.0, abs_tol=1e-6):
        errors.append(f"hope_level_shares={shares!r}: expected positive shares summing to 1")
    bad = [m for m in modes if not _valid_mode(m)]
    if bad:
        errors.append(f"hope_level_modes has {bad!r}: expected each of {', '.join(HOPE_MODES)}")
    if not (isinstance(cfg.hope_chunk_size, int) and cfg.hope_chunk_size >= 1):
        errors.append(f"hope_chunk_size={cfg.hope_chunk_size!r}: expected a positive integer")
    if not (isinstance(cfg.hope_inner_lr, (int, float)) and cfg.hope_inner_lr >= 0):
        errors.append(f"hope_inner_lr={cfg.hope_inner_lr!r}: expected a number >= 0")


__all__ = ["TLMConfig"]
