"""Sizes before memory: a model config is checked against the machine before any module or tensor is built.

:func:`check_model_size` estimates the parameters a config describes (embeddings, head, attention and MLP of
every layer) and refuses, in one line naming the key and value, a config whose float32 weights would not fit in
the available memory (``MemAvailable``, a cgroup ``memory.max`` or ``RLIMIT_AS``, whichever is smallest) or that
exceeds a documented cap (:data:`CAPS`). A ``MemoryError`` after minutes of building modules becomes a refusal in
milliseconds. :func:`declared_sizes` reads those sizes from a checkpoint's metadata alone (its config.json, or a GGUF's
header through the gguf package and transformers' own GGUF key table), without importing torch: the console commands
check them before their modules import torch and transformers, which takes seconds (tlm_cli.launch).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from .bounded import read_json
from .errors import ConversionError
from .outputs import human_bytes

# no supported family comes near these; a value above one is a typo or a hostile file
CAPS = {"num_hidden_layers": 4096, "hidden_size": 1 << 17, "intermediate_size": 1 << 20, "vocab_size": 1 << 24}
_ALIASES = {"num_hidden_layers": ("num_hidden_layers", "n_layer"), "hidden_size": ("hidden_size", "n_embd"),
            "intermediate_size": ("intermediate_size", "n_inner"), "vocab_size": ("vocab_size",)}


def available_memory() -> int:
    """Bytes this process may still allocate: the smallest of MemAvailable, the cgroup limit and RLIMIT_AS."""
    limits = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for name in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(name).read_text().strip()
            if text.isdigit():
                limits.append(int(text))
        except OSError:
            pass
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft not in (resource.RLIM_INFINITY, -1) and soft > 0:
            limits.append(soft)
    except (ImportError, OSError, ValueError):
        pass
    return min(limits) if limits else 1 << 62


def _value(cfg: Mapping, key: str):
    for name in _ALIASES[key]:
        if cfg.get(name) is not None:
            return name, cfg[name]
    return _ALIASES[key][0], None


def estimate_params(cfg: Mapping) -> int:
    """Parameters of a decoder described by ``cfg`` (HF, GPT-2 or TLM key names; missing keys count as small)."""
    sizes = {key: _value(cfg, key)[1] for key in _ALIASES}
    sizes = {key: v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 1 for key, v in sizes.items()}
    layers, hidden, vocab = sizes["num_hidden_layers"], sizes["hidden_size"], sizes["vocab_size"]
    widths = cfg.get("intermediate_sizes")
    if isinstance(widths, (list, tuple)) and widths and all(isinstance(w, int) for w in widths[:layers]):
        mlp = 3 * hidden * sum(widths[:layers])
    else:
        mlp = 3 * hidden * (sizes["intermediate_size"] if _value(cfg, "intermediate_size")[1] else 4 * hidden) * layers
    return 2 * vocab * hidden + layers * 4 * hidden * hidden + mlp


def check_model_size(cfg: Mapping, where: str | os.PathLike, prefix: str = "", bytes_per_param: int = 4) -> int:
    """Refuse a config whose model is absurd or cannot fit in memory; return its estimated parameter count.

    ``where`` names the file (or recipe section) in the message; ``prefix`` goes before key names
    (``model.config.``). Nested ``text_config`` sections (multimodal configs) are checked too."""
    if isinstance(cfg.get("text_config"), Mapping):
        check_model_size(cfg["text_config"], where, f"{prefix}text_config.", bytes_per_param)
    for key, cap in CAPS.items():
        name, value = _value(cfg, key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            raise ConversionError(f"{where}: {prefix}{name}={value} is above the supported maximum {cap}; fix "
                                  f"{prefix}{name}")
    params = estimate_params(cfg)
    need, free = params * bytes_per_param, available_memory()
    if need > free:
        named = ", ".join(f"{prefix}{n}={v}" for n, v in (_value(cfg, k) for k in _ALIASES) if v is not None)
        raise ConversionError(f"{where}: the model described ({named}) has about {params:.3g} parameters, "
                              f"{human_bytes(need)} in float32, more than the {human_bytes(free)} of available memory; "
                              "fix these sizes or use a machine with more memory")
    return params


def declared_sizes(source: Path) -> dict:
    """The sizes a located checkpoint (a folder with config.json, or a .gguf file) declares in its metadata, under
    transformers' key names; {} when they cannot be read here (the loader then reports why). Imports no torch."""
    try:
        if source.is_dir():
            return read_json(source / "config.json", "model config")  # bounded: never a device or a huge file
        return _gguf_sizes(source)
    except Exception:  # unreadable here (corrupt, truncated, no gguf package): the loader names the problem
        return {}


def _gguf_sizes(file: Path) -> dict:
    """A GGUF's ``{architecture}.*`` header fields renamed by transformers' table (block_count -> num_hidden_layers,
    ...); the vocabulary is the length of its token list where no vocab_size field is given."""
    from gguf import GGUFReader
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING  # a plain table: no torch behind it

    fields = GGUFReader(str(file)).fields
    arch_field = fields.get("general.architecture")
    if arch_field is None:
        return {}
    arch = arch_field.contents()
    renames = GGUF_CONFIG_MAPPING.get(arch, GGUF_CONFIG_MAPPING["llama"])
    sizes = {}
    for key, name in renames.items():
        field = fields.get(f"{arch}.{key}")
        if name in _ALIASES and field is not None and len(field.data) == 1:
            sizes[name] = int(field.contents())
    tokens = fields.get("tokenizer.ggml.tokens")
    if "vocab_size" not in sizes and tokens is not None:
        sizes["vocab_size"] = len(tokens.data)
    return sizes


__all__ = ["CAPS", "available_memory", "check_model_size", "declared_sizes", "estimate_params"]
