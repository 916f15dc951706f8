"""TLMCache: one cache object for every mixer.

Each layer owns a dict of named slots: attention layers keep post-RoPE ``key``/``value`` buffers of shape
(B, K, capacity, Dh) whose first ``length`` positions are filled;
Titans layers add ``memory`` (the neural memory's state dict); Hope layers add ``cms`` (fast weights and the
partial-chunk buffer). Mixers read and write their own slots; the model only counts tokens.
"""

from __future__ import annotations

import torch

ROWS = "rows"  # key of a per-row state: {"rows": [state of row 0, ...]} (padding.py)


class TLMCache:
    """Per-layer named state for incremental decoding (see module docstring)."""

    is_compileable = False  # read by transformers' generation utilities

    def __init__(self, num_layers: int):
        self.layers: list[dict] = [{} for _ in range(num_layers)]
        self.seen_tokens = 0

    # -- attention -------------------------------------------------------------------------------------
    def update_kv(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        """Append (B, K, N, Dh) keys/values for a layer; return the full (B, K, T, Dh) keys/values.

        Without autograd they live in buffers that double when full (views of the first T positions are
        returned), so a decoding step writes its own token only: concatenating would copy the whole cache at
        every step, O(T²) over a generation. With autograd (a forward that trains through the cache) they are
        concatenated, so no tensor a backward needs is written in place."""
        slot = self.layers[layer_idx]
        if torch.is_grad_enabled() and (key.requires_grad or value.requires_grad):
            if "key" in slot:
                key = torch.cat([slot["key"][:, :, : slot["length"]], key], dim=2)
                value = torch.cat([slot["value"][:, :, : slot["length"]], value], dim=2)
            slot["key"], slot["value"], slot["length"] = key, value, key.shape[2]
            return key, value
        length = slot.get("length", 0)
        slot["key"] = _append(slot.get("key"), length, key)
        slot["value"] = _append(slot.get("value"), length, value)
        slot["length"] = length + key.shape[2]
        return slot["key"][:, :, : slot["length"]], slot["value"][:, :, : slot["length"]]

    # -- transformers' Cache surface used by generate() ----------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    @property
    def is_linear(self) -> list[bool]:  # generate() asks whether any layer is a plain KV layer
        return [False for _ in self.layers]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder every batched state for beam search: batch-first tensors (or nests of them) are indexed, per-row
        states (``{"rows": [...]}``, see ``padding.py``) have their rows reordered."""

        def reorder(state):
            if isinstance(state, dict) and ROWS in state:
                return {ROWS: [state[ROWS][i] for i in beam_idx.tolist()]}
            return map_tensors(state, lambda t: t.index_select(0, beam_idx.to(t.device)))

        self.layers = [{name: reorder(state) for name, state in slot.items()} for slot in self.layers]

    def __len__(self) -> int:
        return len(self.layers)


def _append(buffer: torch.Tensor | None, length: int, new: torch.Tensor) -> torch.Tensor:
    """``buffer`` (B, K, capacity, Dh) with ``new`` (B, K, N, Dh) written at positions length..length+N, in a buffer
    of twice the length when it is full."""
    end = length + new.shape[2]
    if buffer is None or end > buffer.shape[2] or buffer.dtype != new.dtype:
        grown = new.new_empty(new.shape[0], new.shape[1], max(end, 2 * length), new.shape[3])
        if buffer is not None:
            grown[:, :, :length] = buffer[:, :, :length]
        buffer = grown
    buffer[:, :, length:end] = new
    return buffer


def map_tensors(obj, fn):
    """`fn` applied to every tensor of a nest of dicts, lists and tuples (other leaves unchanged)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


__all__ = ["TLMCache", "map_tensors"]
