"""Residual alignment ρ_MLP per layer: does a layer's MLP write along the residual stream
("reinforce", ρ near 1) or across it ("transform", ρ near 0)?

    ρ_l = cos(F_l, r_l)   per token, then mean and median over tokens;   Pearson r(l, mean ρ_l) as the summary

What is measured, for every supported model (a block is ``h -> z = h + mixer(norm(h)) -> z + F(z)``):

- ``h_l`` (reference "h", as reported by the paper): the block input, the residual stream before the mixer.
  Captured by a forward pre-hook on the decoder layer (``model.model.layers[l]``; GPT-2 ``model.transformer.h[l]``).
- ``z_l`` (reference "z", what the MLP half reads): the residual after the mixer, *before* the pre-MLP norm.
  A forward pre-hook on the MLP itself would see the normed input, so the hook sits on the pre-MLP norm instead:
  TLM ``post_attention_layernorm`` (TLM's pre-MLP norm, also with sandwich norm, whose post-mixer norm is
  ``post_mixer_layernorm``); Llama / Mistral / Qwen2 / Qwen3 ``post_attention_layernorm``; Gemma 2/3
  ``pre_feedforward_layernorm`` (their ``post_attention_layernorm`` is the sandwich norm on the attention output);
  GPT-2 ``ln_2``.
- ``F_l``: what the MLP half adds to the residual, i.e. ``h_{l+1} - z_l``. Without sandwich norm that is the MLP
  output (TLM ``layers[l].mlp``; for Hope-attention the MLP slot holds the continuum memory system and its whole
  output, all levels, is F_l; for Titans it is the block MLP only, the memory sits in the mixer). With sandwich norm
  (TLM ``sandwich_norm=True``, Gemma 2/3) it is the output of ``post_feedforward_layernorm`` applied to the MLP
  output, the vector actually written to the stream (its learned gain changes the direction, so the MLP's own
  output would give a different cosine). The module names used are recorded per layer in ``choices``.

Every batch is checked: each layer's output must equal ``z_l + F_l`` (to a dtype-dependent tolerance), so a block
that does not have this structure (parallel attention, post-norm residuals) raises :class:`AnalysisError` instead of
giving a silently wrong number.

The other choices of §3.5, fixed here and recorded in :attr:`AlignmentResult.choices`: raw (un-normed) references;
per-token cosine, then mean (median too); the first real token of each sequence (position 0 without padding) and
padding excluded; cosines in float32 whatever the model dtype; Pearson r of the per-layer mean against the layer
index (affine-invariant, so ``l`` and ``l/(L-1)`` agree). Layer indices are 0-based.

:func:`suggest_ratio` is a *heuristic* of this project (not from the paper) that turns the ρ profile into a taper
ratio; see its docstring.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from tlm.cms import ContinuumMemory
from tlm.modeling_tlm import TLMDecoderLayer
from tlm_io.errors import AnalysisError

logger = logging.getLogger(__name__)

REFERENCES = ("h", "z")
_REFERENCE_TEXT = {
    "h": "h_l: block input (residual stream before the mixer)",
    "z": "z_l: residual after the mixer, before the pre-MLP norm (what the MLP half reads)",
}


# ================================================================================================ results


@dataclass
class ReferenceStats:
    """ρ per layer against one reference stream."""

    reference: str  # "h" or "z"
    mean: list[float]  # per layer, mean over tokens of the per-token cosine
    median: list[float]  # per layer, median over tokens
    pearson_r: float | None  # Pearson r(layer index, mean); None when undefined (< 2 layers or a constant profile)
    pearson_r_median: float | None  # the same for the median profile


@dataclass
class AlignmentResult:
    """Residual alignment of every layer; ``h`` and ``z`` hold the statistics for the two reference streams."""

    num_layers: int
    h: ReferenceStats
    z: ReferenceStats
    n_tokens: int  # tokens per layer entering the statistics (position 0 and padding excluded)
    n_sequences: int
    seq_len: int
    choices: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def reference(self, name: str) -> ReferenceStats:
        if name not in REFERENCES:
            raise AnalysisError(f"reference must be one of {REFERENCES}, got {name!r}")
        return self.h if name == "h" else self.z

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (no NaN: undefined values are None)."""
        return _json_safe(asdict(self))


def _json_safe(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def pearson_r(x, y) -> float | None:
    """Pearson correlation of two equal-length sequences (float64); None when undefined (n < 2 or zero variance)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise AnalysisError(f"pearson_r needs two 1-D sequences of equal length, got shapes {x.shape} and {y.shape}")
    if len(x) < 2 or not (np.isfinite(x).all() and np.isfinite(y).all()):
        return None
    dx, dy = x - x.mean(), y - y.mean()
    denom = math.sqrt(float(dx @ dx) * float(dy @ dy))
    if denom == 0.0:
        return None
    return float(np.clip(float(dx @ dy) / denom, -1.0, 1.0))


# ================================================================================================ hook sites


@dataclass
class _Site:
    layer: nn.Module  # pre-hook: input = h_l; forward hook: output = h_{l+1} (checked against z_l + F_l)
    z_module: nn.Module  # pre-hook: input = z_l
    f_module: nn.Module  # forward hook: output = F_l (first element when a tuple, e.g. Hope's CMS)
    z_name: str
    f_name: str
    f_kind: str


def _layers_of(model: nn.Module) -> tuple[str, nn.ModuleList]:
    for path in ("model.layers", "layers", "transformer.h", "h", "model.decoder.layers"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return path, obj
    raise AnalysisError(f"{type(model).__name__} has no decoder layers at model.layers or transformer.h; "
                        "supported: TLM, Llama/Mistral/Qwen2/Qwen3/Gemma 2/3 (model.model.layers) and GPT-2")


def _resolve_sites(model: nn.Module) -> tuple[str, list[_Site]]:
    """(architecture label, one _Site per layer)."""
    path, layers = _layers_of(model)
    sites = []
    arch = "tlm" if isinstance(layers[0], TLMDecoderLayer) else ("gpt2" if path.endswith("h") else "transformers")
    for i, layer in enumerate(layers):
        prefix = f"{path}.{i}"
        if isinstance(layer, TLMDecoderLayer):
            z_attr = "post_attention_layernorm"
            f_attr = "post_feedforward_layernorm" if layer.sandwich else "mlp"
            f_kind = "CMS output (Hope: all levels)" if isinstance(layer.mlp, ContinuumMemory) else "MLP output"
            if layer.sandwich:
                f_kind = f"post_feedforward_layernorm({f_kind}) (sandwich norm: the residual write)"
        elif hasattr(layer, "ln_2") and hasattr(layer, "mlp"):  # GPT-2 block
            z_attr, f_attr, f_kind = "ln_2", "mlp", "MLP output"
        elif hasattr(layer, "mlp") and hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 2/3 sandwich norm
            z_attr = "pre_feedforward_layernorm"
            if hasattr(layer, "post_feedforward_layernorm"):
                f_attr = "post_feedforward_layernorm"
                f_kind = "post_feedforward_layernorm(MLP output) (sandwich norm: the residual write)"
            else:
                f_attr, f_kind = "mlp", "MLP output"
        elif hasattr(layer, "mlp") and hasattr(layer, "post_attention_layernorm"):  # Llama / Qwen / Mistral
            z_attr, f_attr, f_kind = "post_attention_layernorm", "mlp", "MLP output"
        else:
            raise AnalysisError(f"layer {i} ({type(layer).__name__}) has no recognised MLP and pre-MLP norm; "
                                "supported: TLM, Llama/Mistral/Qwen2/Qwen3/Gemma 2/3 and GPT-2 blocks")
        z_mod, f_mod = getattr(layer, z_attr, None), getattr(layer, f_attr, None)
        if not isinstance(z_mod, nn.Module) or not isinstance(f_mod, nn.Module):
            raise AnalysisError(f"layer {i} ({type(layer).__name__}) lacks the module {z_attr} or {f_attr}")
        sites.append(_Site(layer, z_mod, f_mod, f"{prefix}.{z_attr}", f"{prefix}.{f_attr}", f_kind))
    return arch, sites


def _forward_base(model: nn.Module) -> nn.Module:
    """The transformer body without the LM head (avoids a (tokens × vocab) logits tensor per batch)."""
    for attr in ("model", "transformer"):
        body = getattr(model, attr, None)
        if isinstance(body, nn.Module) and any(hasattr(body, a) for a in ("layers", "h")):
            return body
    return model


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def _cosine(a: Tensor, b: Tensor) -> Tensor:
    """Per-row cosine in float32: (n, d), (n, d) -> (n,); 0 where either vector is zero."""
    a, b = a.float(), b.float()
    dot = (a * b).sum(-1)
    norms = torch.linalg.vector_norm(a, dim=-1) * torch.linalg.vector_norm(b, dim=-1)
    return torch.where(norms > 0, dot / norms.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(dot))


def _keep_mask(ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    """(B, N) bool: real tokens other than the first real token of each sequence."""
    if attention_mask is None:
        keep = torch.ones_like(ids, dtype=torch.bool)
        keep[:, 0] = False
        return keep
    real = attention_mask.to(torch.long)
    return real.bool() & (real.cumsum(-1) > 1)


# ================================================================================================ measurement


def residual_alignment(
    model: nn.Module,
    blocks: Tensor,
    batch_size: int = 8,
    attention_mask: Tensor | None = None,
    data: str | None = None,
) -> AlignmentResult:
    """ρ_MLP per layer of ``model`` on token ``blocks`` (n, seq_len), for both references (module docstring).

    ``attention_mask`` (same shape, 1 = real token) masks padding; without it every position is real. ``data``
    is only recorded (the name of the held-out set). The model runs under ``torch.no_grad()`` in eval mode (its
    training flag is restored afterwards); all hooks are removed when this returns or raises.
    """
    if not isinstance(blocks, Tensor) or blocks.ndim != 2 or blocks.dtype not in (torch.long, torch.int):
        raise AnalysisError("blocks must be an integer tensor of token ids, shape (n_sequences, seq_len)")
    n_seq, seq_len = blocks.shape
    if n_seq < 1 or seq_len < 2:
        raise AnalysisError(f"blocks of shape {tuple(blocks.shape)}: need at least one sequence of 2 tokens or more "
                            "(position 0 is excluded)")
    if batch_size < 1:
        raise AnalysisError(f"batch_size must be a positive integer, got {batch_size}")
    if attention_mask is not None and attention_mask.shape != blocks.shape:
        raise AnalysisError(f"attention_mask shape {tuple(attention_mask.shape)} differs from blocks "
                            f"{tuple(blocks.shape)}")

    arch, sites = _resolve_sites(model)
    body = _forward_base(model)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    model_dtype = param.dtype if param is not None else torch.float32
    rel_tol = 1e-4 if model_dtype in (torch.float32, torch.float64) else 3e-2
    choices = {
        "architecture": arch,
        "model_class": type(model).__name__,
        "model_dtype": str(model_dtype).removeprefix("torch."),
        "references": dict(_REFERENCE_TEXT),
        "F": "what the MLP half adds to the residual (h_{l+1} - z_l); per layer in f_modules / f_kinds",
        "z_modules": [s.z_name + " (input)" for s in sites],
        "f_modules": [s.f_name + " (output)" for s in sites],
        "f_kinds": [s.f_kind for s in sites],
        "normalisation": "raw (un-normed) reference streams",
        "aggregation": "per-token cosine, then mean and median over tokens",
        "positions": "first real token of every sequence excluded (position 0 without padding); padding masked",
        "precision": "float32 dot products and norms",
        "summary": "Pearson r of the per-layer mean (and median) against the 0-based layer index",
        "layer_index": "0-based",
        "data": data,
        "n_sequences": int(n_seq),
        "seq_len": int(seq_len),
    }
    logger.info("residual alignment: %s (%s, %s), %d layers, %d x %d tokens, batch %d; F per layer: %s",
                type(model).__name__, arch, choices["model_dtype"], len(sites), n_seq, seq_len, batch_size,
                sorted(set(choices["f_kinds"])))

    cos: dict[str, list[list[Tensor]]] = {r: [[] for _ in sites] for r in REFERENCES}
    state: dict[str, Any] = {}
    handles = []

    def on_layer_in(i):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs.get("hidden_states")
            if not isinstance(h, Tensor):
                raise AnalysisError(f"layer {i}: could not find the hidden states among the layer's inputs")
            state["cur"] = {"layer": i, "h": h}
        return hook

    def on_z(i):
        def hook(module, args):
            cur = state.get("cur")
            if cur is None or cur["layer"] != i or "z" in cur:
                raise AnalysisError(f"layer {i}: {sites[i].z_name} did not run once, after the layer started")
            cur["z"] = args[0]
        return hook

    def on_f(i):
        def hook(module, args, output):
            cur = state.get("cur")
            if cur is None or cur["layer"] != i or "z" not in cur or "f" in cur:
                raise AnalysisError(f"layer {i}: {sites[i].f_name} did not run once, after {sites[i].z_name}")
            f = _first(output)
            keep = state["keep"]
            cur["f"] = f
            f_kept = f[keep]
            cos["h"][i].append(_cosine(f_kept, cur["h"][keep]).cpu())
            cos["z"][i].append(_cosine(f_kept, cur["z"][keep]).cpu())
        return hook

    def on_layer_out(i):
        def hook(module, args, kwargs, output):
            cur = state.pop("cur", None)
            if cur is None or "f" not in cur:
                raise AnalysisError(f"layer {i}: {sites[i].f_name} did not run inside the layer")
            out = _first(output).float()
            err = float((out - (cur["z"].float() + cur["f"].float())).abs().max())
            scale = max(1.0, float(out.abs().max()))
            if not err <= rel_tol * scale:
                raise AnalysisError(f"layer {i}: the layer output is not z_l + F_l (max difference {err:.3g}); this "
                                    f"block does not have the pre-norm residual form h -> z = h + mixer -> z + F(z)")
        return hook

    was_training = model.training
    t0 = time.perf_counter()
    try:
        for i, s in enumerate(sites):
            handles.append(s.layer.register_forward_pre_hook(on_layer_in(i), with_kwargs=True))
            handles.append(s.z_module.register_forward_pre_hook(on_z(i)))
            handles.append(s.f_module.register_forward_hook(on_f(i)))
            handles.append(s.layer.register_forward_hook(on_layer_out(i), with_kwargs=True))
        model.eval()
        with torch.no_grad():
            for start in range(0, n_seq, batch_size):
                ids = blocks[start : start + batch_size].to(device)
                mask = attention_mask[start : start + batch_size].to(device) if attention_mask is not None else None
                state["keep"] = _keep_mask(ids, mask)
                kwargs = {"use_cache": False}
                if mask is not None:
                    kwargs["attention_mask"] = mask
                body(input_ids=ids, **kwargs)
                missing = [i for i in range(len(sites)) if len(cos["h"][i]) != len(cos["h"][0])]
                if missing or len(cos["h"][0]) != start // batch_size + 1:
                    raise AnalysisError(f"the MLP of layer(s) {missing or [0]} did not run in the forward pass")
                logger.debug("residual alignment: %d/%d sequences", min(start + batch_size, n_seq), n_seq)
    finally:
        for handle in handles:
            handle.remove()
        state.clear()
        model.train(was_training)
    seconds = time.perf_counter() - t0

    stats = {}
    n_tokens = 0
    for ref in REFERENCES:
        per_layer = [torch.cat(chunks).double().numpy() for chunks in cos[ref]]
        n_tokens = int(len(per_layer[0]))
        if n_tokens == 0:
            raise AnalysisError("no tokens left after excluding position 0 and padding")
        means = [float(v.mean()) for v in per_layer]
        medians = [float(np.median(v)) for v in per_layer]
        depth = list(range(len(sites)))
        stats[ref] = ReferenceStats(ref, means, medians, pearson_r(depth, means), pearson_r(depth, medians))
    result = AlignmentResult(len(sites), stats["h"], stats["z"], n_tokens, int(n_seq), int(seq_len), choices,
                             seconds)
    logger.info("residual alignment: %d tokens per layer, Pearson r(depth, rho) h=%s z=%s, %.1fs", n_tokens,
                _fmt(result.h.pearson_r), _fmt(result.z.pearson_r), seconds)
    return result


def _fmt(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


# ================================================================================================ heuristic


@dataclass
class RatioSuggestion:
    """A taper ratio (first/last layer width multipliers) suggested by :func:`suggest_ratio` — a heuristic."""

    first: float
    last: float
    reference: str
    slope: float | None  # least-squares change of mean ρ from the first to the last layer
    pearson_r: float | None
    reason: str
    heuristic: str = ("project heuristic, not from the paper: delta = clip(gain * slope, 0, max_delta) when "
                      "Pearson r >= min_r, else 0; ratio = (1 + delta)/(1 - delta)")

    @property
    def ratio(self) -> str:
        """In the form ``tlm-convert --ratio`` takes."""
        return f"{self.first:g}/{self.last:g}"


def suggest_ratio(result: AlignmentResult, reference: str = "h", gain: float = 1.0, min_r: float = 0.3,
                  max_delta: float = 0.75, step: float = 0.05) -> RatioSuggestion:
    """A HEURISTIC taper ratio from the ρ profile (this project's, not the paper's; unvalidated).

    The paper's reading: early MLPs transform (ρ low) and deserve width, late MLPs reinforce (ρ high) and need less.
    Fit mean ρ_l by least squares against t = l/(L-1) in [0, 1]; the fitted rise from the first to the last layer is
    ``slope``. The suggestion is the symmetric ratio ``(1 + δ)/(1 - δ)`` with ``δ = clip(gain·slope, 0, max_delta)``
    rounded to ``step``, so with the default gain a rise of 0.5 in cosine gives the paper's 1.5/0.5. A weak or
    negative trend (Pearson r below ``min_r``, or fewer than 3 layers) gives the uniform 1/1.
    """
    stats = result.reference(reference)
    if gain < 0 or not 0 <= max_delta < 1 or step <= 0:
        raise AnalysisError("suggest_ratio needs gain >= 0, 0 <= max_delta < 1 and step > 0")
    L = len(stats.mean)
    if L < 3:
        return RatioSuggestion(1.0, 1.0, reference, None, stats.pearson_r, f"only {L} layer(s): no trend to read")
    t = np.arange(L, dtype=np.float64) / (L - 1)
    y = np.asarray(stats.mean, dtype=np.float64)
    slope = float(np.polyfit(t, y, 1)[0])
    r = stats.pearson_r
    if r is None or r < min_r:
        return RatioSuggestion(1.0, 1.0, reference, slope, r,
                               f"Pearson r {_fmt(r)} < {min_r}: no clear rise of rho with depth, keep uniform widths")
    delta = min(max(gain * slope, 0.0), max_delta)
    delta = round(round(delta / step) * step, 6)
    return RatioSuggestion(round(1 + delta, 6), round(1 - delta, 6), reference, slope, r,
                           f"rho_{reference} rises by {slope:.3f} from the first to the last layer (fit), "
                           f"Pearson r {r:.3f}")


# ================================================================================================ outputs


def plot_alignment(result: AlignmentResult, title: str | None = None) -> bytes:
    """PNG of mean (solid) and median (dashed) ρ per layer for both references, Pearson r in the title.

    Uses matplotlib's Agg canvas directly (no pyplot, so no global backend change)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    import io

    fig = Figure(figsize=(7, 4.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    layers = list(range(result.num_layers))
    for stats, color, label in ((result.h, "tab:blue", "h_l (block input)"), (result.z, "tab:orange",
                                                                             "z_l (after mixer)")):
        ax.plot(layers, stats.mean, "o-", color=color, label=f"{label}, mean")
        ax.plot(layers, stats.median, "--", color=color, alpha=0.6, label=f"{label}, median")
    ax.axhline(0.0, color="grey", lw=0.6)
    ax.set_xlabel("layer (0-based)")
    ax.set_ylabel("rho = cos(F_l, reference)")
    head = f"{title}: " if title else ""
    ax.set_title(f"{head}Pearson r(depth, rho): h {_fmt(result.h.pearson_r)}, z {_fmt(result.z.pearson_r)}",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def save_alignment(result: AlignmentResult, folder: str | Path, extra: dict[str, Any] | None = None,
                   title: str | None = None) -> tuple[Path, Path]:
    """Write ``alignment.json`` (``result.to_dict()`` plus ``extra``) and ``alignment.png`` into ``folder``
    (created if missing). Both are rendered before anything is written, and each file is written to a temporary
    name and renamed, so a failure never leaves a partial file."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise AnalysisError(f"output '{folder}' exists and is not a folder")
    payload = json.dumps({**(extra or {}), **result.to_dict()}, indent=2) + "\n"
    png = plot_alignment(result, title)
    folder.mkdir(parents=True, exist_ok=True)
    paths = (folder / "alignment.json", folder / "alignment.png")
    for path, data in zip(paths, (payload.encode("utf-8"), png)):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=folder)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    logger.info("residual alignment written to %s and %s", *paths)
    return paths


__all__ = [
    "AlignmentResult",
    "AnalysisError",
    "RatioSuggestion",
    "ReferenceStats",
    "pearson_r",
    "plot_alignment",
    "residual_alignment",
    "save_alignment",
    "suggest_ratio",
]
