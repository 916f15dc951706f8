"""The low-memory policy's source and sink: a checkpoint (safetensors or .bin folder, llama GGUF) read one layer at a
time, and the converted model written one layer at a time as its own shard.

:func:`open_stream` reads the headers (no data) and checks names and shapes against the TLM the config describes.
:class:`StreamedLayers` is the :class:`~tlm_convert.calibrate.Layers` of :func:`~tlm_convert.calibrate.convert_layers`
for it::

    embeddings -> shard 1 (and the evaluation hidden states)
    for every layer i:  read layer i (fp32) -> [eval: the source layer] -> (the loop converts it)
        -> upcycle the layer's mixer, cast to --dtype -> [eval: the converted layer] -> shard i + 2
    final norm (+ lm_head) -> last shard; model.safetensors.index.json, config.json + the TLM remote code
    (auto_map), tokenizer, generation config

At any moment one decoder layer's weights are in memory. Safetensors are read with plain file reads, not memory maps
(a mapped checkpoint's pages count in the process's resident set); a .bin shard is mapped for one tensor at a time,
a GGUF file is mapped and dequantised tensor by tensor (tlm_io.readers, tlm_io.gguf_reader). ``--mixer titans``
(its fresh weights come from the whole model's seeded init) and exports other than ``tlm`` need the whole model:
:func:`check_streamable` refuses them once, before anything is read.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from tlm import TLMConfig, TLMForCausalLM
from tlm.modeling_tlm import TLMDecoderLayer
from tlm.modules import rope_inv_freq
from tlm_io.archs import COPY, SUPPORTED_ARCHITECTURES, family_of, gather, tlm_shapes, tlm_targets, transform_tensor
from tlm_io.checkpoint import Source
from tlm_io.config_import import (
    generation_config_of,
    import_hf_config,
    read_gguf_config,
    read_hf_config,
    read_tlm_config,
    tie_missing_head,
    unsupported_error,
)
from tlm_io.errors import ConversionError, first_few
from tlm_io.export import copy_tokenizer, write_generation_config
from tlm_io.gguf_reader import GGUFTensors
from tlm_io.heap import trim_heap
from tlm_io.locate import locate
from tlm_io.perplexity import nll_sum
from tlm_io.bounded import read_json
from tlm_io.readers import BinTensors, SafetensorsFiles, TensorIndex, prepare_tensor, weight_files
from tlm_io.shapes import check_shapes
from tlm_io.sizes import check_model_size
from tlm_io.tokenizer_source import tokenizer_folder

from .upcycle import carry_scores, upcycle_layer

SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


# ============================================================================================== source


@dataclass(kw_only=True)
class StreamSource(Source):
    """A :class:`~tlm_io.checkpoint.Source` read tensor by tensor (its ``state_dict`` stays empty): TLM name ->
    (source name, transform, part) in ``targets``."""

    tensors: TensorIndex  # SafetensorsFiles, BinTensors or GGUFTensors
    targets: dict[str, tuple[str, str, int]]
    shapes: dict[str, tuple[int, ...]]  # TLM name -> shape

    def layer_names(self, i: int) -> list[str]:
        prefix = f"model.layers.{i}."
        return [n for n in self.targets if n.startswith(prefix)]

    def other_names(self) -> list[str]:
        return [n for n in self.targets if not _LAYER.match(n)]

    def read(self, names) -> dict[str, torch.Tensor]:
        """The TLM tensors ``names`` in fp32, each source tensor read (and checked) once."""
        return gather(self.targets, names, self._load)

    def _load(self, name: str) -> torch.Tensor:
        return prepare_tensor(name, self.tensors[name], self.tensors.file(name), torch.float32)


def open_stream(source, trust_remote_code: bool = False) -> StreamSource:
    """Open a local checkpoint for streaming: a transformers or TLM folder (safetensors, or zip-format .bin), or a
    llama-architecture .gguf file (or a folder holding exactly one); everything else is refused."""
    path = locate(source, download=False)
    src = _open_gguf(path) if path.is_file() else _open_folder(path)
    src.trust_remote_code = trust_remote_code
    return src


def _open_folder(path: Path) -> StreamSource:
    raw = read_json(path / "config.json", "model config", finite=True)
    check_model_size(raw, path / "config.json")  # before anything is built
    kind, files = weight_files(path)
    tensors, notes = (SafetensorsFiles(files) if kind == "safetensors" else BinTensors(files)), []
    if raw.get("model_type") == "tlm":
        kind, hf_config = "tlm", None
        config, targets = _tlm_targets(path, tensors, notes)
    else:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise unsupported_error(model_type, raw.get("architectures"), path)
        kind, hf_config = "hf", read_hf_config(path, raw)
        config, targets = _hf_targets(path, hf_config, tensors, notes)
    return _stream_source(kind, path, hf_config, config, tensors, targets, tokenizer_folder(path),
                          generation_config_of(path), notes)


def _open_gguf(file: Path) -> StreamSource:
    from transformers import GenerationConfig

    hf_config = read_gguf_config(file)
    tensors = GGUFTensors.open(file, hf_config)
    if tensors is None:
        raise ConversionError(f"'{file}' is a GGUF that only transformers' whole-model loader reads (not a plain "
                              "llama-architecture file); drop --low-memory")
    hf_config.dtype = torch.float32  # as load_source leaves it
    notes: list[str] = []
    config, targets = _hf_targets(file, hf_config, tensors, notes)
    return _stream_source("gguf", file, hf_config, config, tensors, targets, (str(file.parent), file.name),
                          GenerationConfig.from_model_config(hf_config), notes)


def _stream_source(kind, path, hf_config, config, tensors, targets, tokenizer_source, generation_config, notes):
    shapes = {name: tuple(transform_tensor(kind_, torch.empty(tensors.shape(src), device="meta"))[part].shape)
              for name, (src, kind_, part) in targets.items()}  # the shapes the transforms give, without data
    check_shapes(expected_shapes(config), shapes, f"'{path}'")
    return StreamSource(kind=kind, path=str(path), hf_config=hf_config, tlm_config=config, state_dict={},
                        family="tlm" if hf_config is None else family_of(hf_config),
                        num_params=sum(math.prod(s) for s in shapes.values()), tokenizer_source=tokenizer_source,
                        generation_config=generation_config, notes=notes, tensors=tensors, targets=targets,
                        shapes=shapes)


def _hf_targets(path: Path, hf_config, tensors, notes: list):
    canonical, config = import_hf_config(path, hf_config, {name: name for name in tensors}, notes)  # -> file name
    targets, unexpected = tlm_targets(hf_config, canonical)
    if unexpected:
        raise ConversionError(f"the weights in '{path}' do not match its config: unexpected source tensor(s) "
                              f"{first_few(unexpected)}; re-download the checkpoint or fix config.json")
    return config, {out: (canonical[name], kind, part) for out, (name, kind, part) in targets.items()}


def _tlm_targets(path: Path, tensors, notes: list):
    config = read_tlm_config(path)
    tie_missing_head(config, set(tensors), notes)
    targets = {n: (n, COPY, 0) for n in tensors if not (n == "lm_head.weight" and config.tie_word_embeddings)}
    return config, targets


def expected_shapes(config: TLMConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a checkpoint of ``config`` stores (a tied lm_head is not stored)."""
    shapes = tlm_shapes(config)
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


# ============================================================================================== the loop's layers


class StreamedLayers:
    """The source and sink of a streamed conversion into ``tmp``: layer i is read from ``src`` when the loop asks
    for it and written as shard i + 2 when the loop is done with it; with ``eval_blocks``, the source and the
    converted model's hidden states on them are carried along, layer by layer."""

    def __init__(self, src: StreamSource, final_config: TLMConfig, widths, dtype: torch.dtype, tmp: Path,
                 eval_blocks: dict[str, torch.Tensor] | None, batch_size: int, timer):
        self.src, self.widths, self.dtype, self.tmp, self.timer = src, widths, dtype, tmp, timer
        with torch.device("meta"):  # structure only: configs, rope, norms and the embedding code path
            self.src_model = TLMForCausalLM(src.tlm_config)
            self.final_model = TLMForCausalLM(final_config)
        self.base, self.base_after = self.src_model.model, self.final_model.model
        _real_rope(self.base, torch.float32)
        _real_rope(self.base_after, dtype)  # the in-memory policy casts the whole final model, buffers too
        self.expected = expected_shapes(final_config)
        self.num_shards = src.tlm_config.num_hidden_layers + 2
        self.weight_map: dict[str, str] = {}
        self.total_bytes = self.params_written = 0
        self.eval = None
        if eval_blocks is not None:  # the batches of every set in turn, each tagged with its set's name
            tagged = [(name, blocks[i : i + batch_size]) for name, blocks in eval_blocks.items()
                      for i in range(0, len(blocks), batch_size)]
            batches = [b for _, b in tagged]
            self.eval = {"batches": batches, "sets": [name for name, _ in tagged],
                         "positions": [torch.arange(b.shape[1]).expand(b.shape[0], -1) for b in batches]}
        self.perplexity_before = self.perplexity_after = None

    def embed(self) -> None:
        """The embeddings into ``base`` (the loop embeds the calibration tokens with them) and into shard 1."""
        names = [n for n in self.src.other_names() if n.startswith("model.embed")]
        with self.timer("load"):
            tensors = self.src.read(names)
        self.base.load_state_dict(_strip(tensors, "model."), strict=False, assign=True)
        cast = {k: v.to(self.dtype) for k, v in tensors.items()}
        if self.eval is not None:
            with self.timer("eval"):
                self.base_after.load_state_dict(_strip(cast, "model."), strict=False, assign=True)
                self.eval["before"] = _embed(self.base, self.eval)
                self.eval["after"] = _embed(self.base_after, self.eval)
                _release_embeddings(self.base_after)
        with self.timer("save"):
            self._write_shard(1, cast)

    def embedded(self) -> None:
        _release_embeddings(self.base)

    def layer(self, i: int) -> TLMDecoderLayer:
        with self.timer("load"):
            layer = _build_layer(self.src.tlm_config, i, _strip(self.src.read(self.src.layer_names(i)),
                                                                 f"model.layers.{i}."))
        if self.eval is not None:
            with self.timer("eval"):
                self.eval["before"] = _run_layer(self.base, layer, self.eval["before"], self.eval["positions"])
        return layer

    def done(self, i: int, layer, plan, score) -> None:
        prefix = f"model.layers.{i}."
        state = {prefix + k: v for k, v in layer.state_dict().items()}
        del layer
        state = upcycle_layer(state, i, self.final_model.config.mixer[i], self.final_model.config,
                              carry_scores(score, plan.keep, plan.grow))
        state = {k: v.to(self.dtype) for k, v in state.items()}
        if self.eval is not None:
            with self.timer("eval"):
                after = _build_layer(self.final_model.config, i, _strip(state, prefix))
                self.eval["after"] = _run_layer(self.base_after, after, self.eval["after"], self.eval["positions"])
                del after
        with self.timer("save"):
            self._write_shard(i + 2, state)
        del state
        trim_heap()

    def finish(self) -> None:
        """The last shard (final norm, untied head), the perplexities, the index and the model files."""
        names = [n for n in self.src.other_names() if not n.startswith("model.embed")]
        with self.timer("load"):
            tensors = self.src.read(names)
        cast = {k: v.to(self.dtype) for k, v in tensors.items()}
        if self.eval is not None:
            with self.timer("eval"):
                head = tensors.get("lm_head.weight")
                if head is None:  # tied
                    head = self.src.read(["model.embed_tokens.weight"])["model.embed_tokens.weight"]
                self.perplexity_before = _perplexity(self.base, tensors, head, self.eval["before"], self.eval)
                self.perplexity_after = _perplexity(self.base_after, cast, head.to(self.dtype), self.eval["after"],
                                                    self.eval)
                self.eval = None
        with self.timer("save"):
            self._write_shard(self.num_shards, cast)
            self._write_model_files()

    def _write_shard(self, k: int, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        name = SHARD_NAME.format(k, self.num_shards)
        clean = {}
        for key, tensor in tensors.items():
            if key not in self.expected or key in self.weight_map:
                raise ConversionError(f"internal error: tensor {key} has no place in the converted model")
            if tuple(tensor.shape) != self.expected[key]:
                raise ConversionError(f"internal error: {key} has shape {tuple(tensor.shape)}, the converted model "
                                      f"expects {self.expected[key]}")
            clean[key] = tensor.detach().contiguous()
        save_file(clean, str(self.tmp / name), metadata={"format": "pt"})
        for key, tensor in clean.items():
            self.weight_map[key] = name
            self.total_bytes += tensor.numel() * tensor.element_size()
            self.params_written += tensor.numel()

    def _write_model_files(self) -> None:
        """Index, config + remote code (as save_pretrained writes them), generation config, tokenizer."""
        from transformers.dynamic_module_utils import custom_object_save

        missing = [k for k in self.expected if k not in self.weight_map]
        if missing:
            raise ConversionError(f"internal error: the converted model lacks {', '.join(missing[:3])}")
        index = {"metadata": {"total_size": self.total_bytes, "total_parameters": self.params_written},
                 "weight_map": dict(sorted(self.weight_map.items()))}
        (self.tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        model = self.final_model
        model.config.dtype = str(self.dtype).removeprefix("torch.")
        model.config.architectures = [type(model).__name__]
        custom_object_save(model, self.tmp, config=model.config)  # modeling_tlm.py and its imports, auto_map
        model.config.save_pretrained(str(self.tmp))
        if self.src.generation_config is None:
            model.generation_config.save_pretrained(str(self.tmp))
        write_generation_config(self.src, model, "tlm", self.tmp)
        copy_tokenizer(self.src, self.tmp)


def _real_rope(base, dtype) -> None:
    for name in ("rotary_emb", "local_rotary_emb"):
        rotary = getattr(base, name, None)
        if rotary is not None:
            rotary.inv_freq = rope_inv_freq(rotary.params, rotary.head_dim).to(dtype)


def _release_embeddings(base) -> None:
    for name in ("embed_tokens", "embed_positions"):
        module = getattr(base, name, None)
        if module is not None and module.weight.device.type != "meta":
            module.weight = torch.nn.Parameter(torch.empty_like(module.weight, device="meta"), requires_grad=False)


def _strip(tensors: dict, prefix: str) -> dict:
    return {k.removeprefix(prefix): v for k, v in tensors.items()}


def _build_layer(config, i: int, tensors: dict) -> TLMDecoderLayer:
    """Decoder layer i holding ``tensors`` (names relative to the layer) as its parameters, without copies."""
    with torch.device("meta"):
        layer = TLMDecoderLayer(config, i)
    layer.load_state_dict(tensors, strict=True, assign=True)
    return layer.eval()


def _embed(base, eval_state) -> list[torch.Tensor]:
    return [base.embed(base.embed_tokens(b), p) for b, p in zip(eval_state["batches"], eval_state["positions"])]


def _run_layer(base, layer, hidden, positions) -> list[torch.Tensor]:
    """One layer of TLMModel.forward (no cache, no padding) on the carried hidden states."""
    out = []
    for h, p in zip(hidden, positions):
        rope, masks = base.block_context(h, p)
        out.append(layer(h, rope.get(layer.layer_type), masks[layer.layer_type], None))
    return out


def _perplexity(base, tensors: dict, head: torch.Tensor, hidden, eval_state) -> dict[str, float]:
    """{set: perplexity}: perplexity.nll_sum on carried last-layer hidden states, summed per evaluation set."""
    norm = {k.removeprefix("model.norm."): v for k, v in tensors.items() if k.startswith("model.norm.")}
    base.norm.load_state_dict(norm, assign=True)
    sums: dict[str, list[float]] = {}
    for h, ids, name in zip(hidden, eval_state["batches"], eval_state["sets"]):
        part, n = nll_sum(lambda x: F.linear(x, head), base.norm(h), ids)
        total = sums.setdefault(name, [0.0, 0])
        total[0], total[1] = total[0] + part, total[1] + n
    return {name: math.exp(total / count) for name, (total, count) in sums.items()}


__all__ = ["open_stream", "StreamSource", "StreamedLayers",
           "expected_shapes"]
