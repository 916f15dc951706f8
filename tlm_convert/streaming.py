"""Low-memory conversion (``tlm-convert SRC -o OUT --low-memory``): the checkpoint is streamed one layer at a time.

At any moment only one decoder layer's weights are in memory. The calibration activations (N tokens × hidden,
fp32, in the batches the in-memory path uses) are carried from layer to layer, and each converted layer is
written as soon as it is done, as its own safetensors shard::

    read the safetensors headers (no data) -> names and shapes checked against the TLM the config describes
    embeddings -> calibration (and evaluation) hidden states; shard 1 = the embeddings
    for every layer i:  read layer i (fp32)  ->  [eval: the source layer on the eval hidden states]
        -> mix -> MLP forward with the activation hook -> scores -> plan -> refit (shrinking) / resize
        -> [mixer upcycling, cast to --dtype]  ->  [eval: the converted layer]  ->  shard i + 2
    final norm (+ lm_head) -> last shard; model.safetensors.index.json, config.json + the TLM remote code
    (auto_map), tokenizer, generation config, conversion_report.json, report.md, widths.png

Everything is written into a temporary folder next to OUT and renamed onto OUT at the end; on any failure the
temporary folder is removed and OUT is left as it was.

The arithmetic is that of :func:`tlm_convert.calibrate.calibrate_and_plan` (same functions, seeds, batches and
order of operations: ``neuron_scores``, ``plan_from_scores``, ``obs_prune``, ``resize_layer``, ``_mix``,
``_feed_forward_reusing``, ``upcycle._split_mlp``; ``refit_target="residual"`` carries the source layers' residual
stream alongside from the first shrinking layer on), so both paths write the same tensors up to floating-point
rounding (the in-memory path forms the refit's system from the kept neurons only and skips the full-width MLP
output of shrinking layers; this one keeps its frugal routes below; tests/test_streaming.py: per tensor, max |Δ|
<= 2e-4 of its largest entry, as the refit's solve amplifies fp32 summation-order differences):

* tensors are read with plain file reads, not memory maps (a mapped checkpoint's pages count in the RSS);
* a shrinking layer's statistics pass keeps its activations (as the in-memory path does);
  the scores come first, then the Gram matrix AᵀA (I × I, fp64) is built from the kept activations in row blocks
  (the in-memory path's additions, in its order), so the scores' fp64 temporaries and the Gram matrix never meet;
  the residual target's AᵀY is formed only for the kept rows, in row blocks;
* the least-squares refit builds G_KK inside the Gram matrix's own storage and factors and solves it in place with
  LAPACK (``refit_down_proj_inplace``), the right-hand side in blocks (no fp64 copy of the down projection);
* the layer's gate/up projections are released after the statistics pass (for metrics that only read the down
  projection) and read again for the resize; the attention weights are released once the calibration tokens are
  mixed and read again when the layer is written;
* activations larger than ``KEEP_ACTIVATIONS_BYTES`` are not kept: the Gram matrix and AᵀY are then summed batch by
  batch in the hook and the resized MLP is run again (a higher peak: the Gram matrix, AᵀY and the whole MLP at once);
* perplexity logits are formed one sequence at a time; freed heap pages go back to the OS after every layer.

For an MLP of width I (kept K) and hidden size d the peak is about 8·I² (the Gram matrix) + 8·K·d (the right-hand
side) bytes plus the layer's down projection and the process itself, or the resize of the widest growing layer
(old and new MLP together): about 2.3-2.5 GB for a 7B-class Llama layer shape (I = 11008, d = 4096,
bench/low_memory.py). ``--importance obs`` keeps ``obs_prune``'s dense I × I inverse and is not memory-frugal.
``--mixer titans`` (fresh weights drawn from the whole model's seeded init), exports other than ``tlm``, GGUF and
.bin sources are refused with the fix: they need the whole model in memory.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import math
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.nn import functional as F

from tlm import TLMConfig, TLMForCausalLM
from tlm.modeling_tlm import TLMDecoderLayer
from tlm.modules import rope_inv_freq

from . import calibrate
from .archs import (
    CONV1D,
    COPY,
    DROPPED_TENSORS,
    QKV_BIAS,
    QKV_CONV1D,
    SUPPORTED_ARCHITECTURES,
    TENSOR_TABLES,
    _layer_template,
    _transform,
    canonical_source_state_dict,
    family_of,
    tlm_config_from_hf,
)
from .checkpoint import read_hf_config, weight_files
from .compensate import obs_prune, refit_kept
from .convert import PhaseTimer, _eval_blocks, _report_head, peak_rss_mb, plan_widths, publish
from .data import load_text, token_blocks
from .errors import ConversionError, one_line
from .importance import ActivationStats, neuron_scores
from .surgery import LayerPlan, plan_from_scores, resize_layer
from .upcycle import _split_mlp, carry_scores

logger = logging.getLogger(__name__)

SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"
INDEX_NAME = "model.safetensors.index.json"
BLOCK_BYTES = 64 << 20  # the largest temporary of the blocked Gram update and of the refit
KEEP_ACTIVATIONS_BYTES = 256 << 20  # keep first-pass activations (for the resized layer's output) up to this size
_CALIBRATE_DEFAULTS = inspect.signature(calibrate.calibrate_and_plan).parameters
NOISE_SCALE = _CALIBRATE_DEFAULTS["noise_scale"].default  # the values the in-memory path runs with
DAMP = _CALIBRATE_DEFAULTS["damp"].default
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                    "spiece.model")
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the in-memory path's second MLP pass of a resized layer reuses the first pass's activations when it can
_REUSE = getattr(calibrate, "_feed_forward_reusing", None)
# importance metrics whose scores read only the down projection (importance.neuron_scores): with them a layer that
# accumulates a Gram matrix releases its gate/up projections before scoring, not after
DOWN_ONLY_METRICS = ("activation", "obs", "wanda_sp", "wifv", "random")


# ============================================================================================== entry point


@torch.no_grad()
def convert_streaming(source, out: Path, opts, on_phase=None, on_layer=None) -> dict:
    """``convert(source, out, opts)`` for ``opts.low_memory``: same output, one layer in memory at a time."""
    opts.validate()
    check_options(opts)
    out = Path(out)
    if out.exists() and not opts.overwrite:
        raise ConversionError(f"output {out} already exists; pass --overwrite or choose another -o")
    timer = PhaseTimer(on_phase)
    quiet = PhaseTimer(None)  # interleaved reads and evaluation: counted, but not announced as a phase change
    quiet.seconds = timer.seconds
    torch.manual_seed(opts.seed)
    with timer("load"):
        src = open_source(source)
        if any(m == "hope_attention" for m in src.tlm_config.mixer):
            raise ConversionError("this TLM has hope_attention layers, whose MLP is split into memory levels and "
                                  "cannot be resized; convert the attention checkpoint it came from instead")
        widths = plan_widths(src.tlm_config, opts)
        final_config = _final_config(src.tlm_config, widths, opts.mixer)
        tokenizer = _load_tokenizer(src)
        calib = token_blocks(tokenizer, load_text(opts.calibration_data), opts.seq_len, opts.calibration_tokens)
        evalb = _eval_blocks(tokenizer, opts)
    report = _report_head(SimpleNamespace(path=src.path, kind=src.kind, family=src.family,
                                          tlm_config=src.tlm_config), opts, widths, calib)
    report["notes"] = list(src.notes)
    out.parent.mkdir(parents=True, exist_ok=True)
    _check_disk_space(out.parent, src.num_params, opts.dtype)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        run = _Run(src, final_config, widths, opts, tmp, calib, evalb, timer, quiet, on_layer)
        run.convert()
        with timer("save"):
            run.finish(tokenizer)
        report.update(run.param_report())
        if evalb is not None:
            report["perplexity_before"] = run.perplexity_before
            report["perplexity_after"] = run.perplexity_after
            report["perplexity_ratio"] = run.perplexity_after / run.perplexity_before
        report["importance_profile"] = [float(s.mean()) for s in run.scores]
        report["low_memory"] = True
        report["shards"] = run.num_shards
        with timer("save"):
            _write_reports(tmp, report, timer)
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def check_options(opts) -> None:
    """The options --low-memory cannot honour, refused before anything is read (one line each)."""
    if opts.export != "tlm":
        raise ConversionError(f"the low-memory path writes --export tlm only (--export {opts.export} needs the whole "
                              "model in memory); drop --low-memory, or use --export tlm")
    if opts.mixer == "titans":
        raise ConversionError("the titans mixer draws its new memory weights from the whole model's seeded init, "
                              "which the low-memory path never builds; drop --low-memory, or use another --mixer")
    if str(opts.device) != "cpu":
        raise ConversionError(f"the low-memory path runs on the CPU; drop --device {opts.device} or --low-memory")


# ============================================================================================== source


@dataclass
class StreamSource:
    """A safetensors checkpoint read tensor by tensor: TLM name -> (source name, transform, part) in ``targets``."""

    kind: str  # "hf" or "tlm"
    path: str
    family: str
    tlm_config: TLMConfig
    tensors: SafetensorsFiles
    targets: dict[str, tuple[str, str, int]]
    shapes: dict[str, tuple[int, ...]]  # TLM name -> shape
    tokenizer_path: str | None
    generation_config: object | None
    notes: list[str]  # what was adjusted while reading (as checkpoint.Source.notes)

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.shapes.values())

    def layer_names(self, i: int) -> list[str]:
        prefix = f"model.layers.{i}."
        return [n for n in self.targets if n.startswith(prefix)]

    def other_names(self) -> list[str]:
        return [n for n in self.targets if not _LAYER.match(n)]

    def read(self, names) -> dict[str, torch.Tensor]:
        """The TLM tensors ``names`` in fp32, each source tensor read (and checked) once."""
        groups: dict[tuple[str, str], list[tuple[str, int]]] = {}
        for name in names:
            source, kind, part = self.targets[name]
            groups.setdefault((source, kind), []).append((name, part))
        out = {}
        for (source, kind), wanted in groups.items():
            parts = _transform(kind, self._load(source))
            for name, part in wanted:
                out[name] = parts[part]
        return out

    def _load(self, name: str) -> torch.Tensor:
        tensor = self.tensors[name]
        if not tensor.is_floating_point():
            return tensor
        if not _all_finite(tensor):
            raise ConversionError(f"tensor '{name}' in '{self.tensors.file(name)}' contains NaN or Inf values; the "
                                  "checkpoint is damaged (re-download it or fix the model that produced it)")
        return tensor.to(torch.float32)


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}


class SafetensorsFiles(Mapping):
    """name -> tensor of a set of safetensors files, each tensor read on access with plain file reads.

    No memory map: the pages of a mapped file stay in the process's resident set while it is mapped (safetensors'
    ``safe_open`` keeps its mapping for the life of the handle), so streaming a 10 GB checkpoint through mapped
    handles would count all of it in the peak RSS. Reads go through the page cache, which is not the process's.
    Headers are read and checked (lengths, offsets, file sizes) up front; problems are ConversionErrors.
    """

    def __init__(self, files):
        self._where: dict[str, tuple[Path, torch.dtype, tuple[int, ...], int, int]] = {}
        for file in files:
            self._read_header(Path(file))

    def _read_header(self, file: Path) -> None:
        try:
            size = file.stat().st_size
            with open(file, "rb") as f:
                head = f.read(8)
                length = int.from_bytes(head, "little") if len(head) == 8 else -1
                if not 0 < length <= size - 8:
                    raise ValueError("the header length does not fit the file")
                header = json.loads(f.read(length))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except FileNotFoundError:
            raise ConversionError(f"weights file '{file}' is missing; re-download the checkpoint") from None
        except (OSError, ValueError) as err:
            raise _corrupt(file, err) from None
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
                shape = tuple(int(n) for n in info["shape"])
                start, end = (int(n) for n in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as err:
                raise _corrupt(file, f"bad header entry for {name}: {one_line(err)}") from None
            if dtype is None:
                raise ConversionError(f"tensor '{name}' in '{file}' has dtype {info['dtype']}, which tlm-convert does "
                                      "not read; convert a bf16/fp16/fp32 checkpoint")
            nbytes = math.prod(shape) * dtype.itemsize
            if end - start != nbytes or start < 0 or 8 + length + end > size:
                raise _corrupt(file, f"the data of {name} lies outside the file")
            if name in self._where:
                raise ConversionError(f"tensor '{name}' appears in both '{self._where[name][0]}' and '{file}'; the "
                                      "shards overlap, re-download the checkpoint")
            self._where[name] = (file, dtype, shape, 8 + length + start, nbytes)

    def __getitem__(self, name: str) -> torch.Tensor:
        file, dtype, shape, offset, nbytes = self._where[name]
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        view, done = memoryview(buffer.numpy()), 0
        try:
            with open(file, "rb", buffering=0) as f:
                f.seek(offset)
                while done < nbytes:
                    got = f.readinto(view[done:])
                    if not got:
                        raise OSError("unexpected end of file")
                    done += got
        except OSError as err:
            raise _corrupt(file, err) from None
        return buffer.view(dtype).reshape(shape)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name][2]

    def file(self, name: str) -> str:
        return str(self._where[name][0])


def _corrupt(file, err) -> ConversionError:
    return ConversionError(f"'{file}' is corrupt or truncated ({one_line(err)}); re-download it")


def _all_finite(tensor: torch.Tensor, block: int = 1 << 22) -> bool:
    # in blocks: torch.isfinite on a whole tensor briefly takes about 1.7x the tensor's own size
    flat = tensor.reshape(-1)
    return all(bool(torch.isfinite(flat[s : s + block]).all()) for s in range(0, flat.numel(), block))


def open_source(source) -> StreamSource:
    """Open a local transformers (or TLM) safetensors folder for streaming; everything else is refused."""
    text = os.fspath(source)
    path = Path(os.path.expanduser(text))
    if not path.exists():
        if _HUB_ID.fullmatch(text) and ".." not in text:
            raise ConversionError(f"'{text}' is not a local folder; --low-memory streams a local safetensors folder: "
                                  f"download it first (hf download {text} --local-dir DIR) and pass DIR, or drop "
                                  "--low-memory")
        raise ConversionError(f"path '{text}' does not exist; pass a transformers model folder (config.json + "
                              "model.safetensors)")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            raise _gguf_refused(path)
        if path.name != "config.json":
            raise ConversionError(f"'{path}' is a file; --low-memory streams a transformers model folder (config.json "
                                  "+ *.safetensors): pass the folder, or drop --low-memory")
        path = path.parent
    if not (path / "config.json").is_file():
        if any(path.glob("*.gguf")):
            raise _gguf_refused(path)
        raise ConversionError(f"folder '{path}' has no config.json; pass a transformers model folder (config.json + "
                              "model.safetensors)")
    raw = _read_json(path / "config.json")
    kind, files = weight_files(path)
    if kind != "safetensors":
        raise ConversionError(f"'{path}' holds PyTorch .bin weights; --low-memory streams safetensors only: drop "
                              "--low-memory, or re-save the model with save_pretrained(..., safe_serialization=True)")
    tokenizer_path = str(path) if any((path / n).is_file() for n in _TOKENIZER_FILES) else None
    generation_config = _generation_config(path)
    tensors, notes = SafetensorsFiles(files), []
    if raw.get("model_type") == "tlm":
        config, targets = _tlm_targets(path, tensors, notes)
        kind, family = "tlm", "tlm"
    else:
        config, targets, family = _hf_targets(path, raw, tensors, notes)
        kind = "hf"
    shapes = {name: _target_shape(kind_, tensors.shape(src), part)
              for name, (src, kind_, part) in targets.items()}
    _check_shapes(config, shapes, path)
    return StreamSource(kind=kind, path=str(path), family=family, tlm_config=config, tensors=tensors, targets=targets,
                        shapes=shapes, tokenizer_path=tokenizer_path, generation_config=generation_config,
                        notes=notes)


def _gguf_refused(path) -> ConversionError:
    return ConversionError(f"'{path}' is a GGUF checkpoint, which transformers dequantises whole into memory; "
                           "--low-memory streams transformers safetensors folders only: drop --low-memory")


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConversionError(f"'{file}' is not valid JSON ({one_line(err)}); re-download or fix it") from None
    if not isinstance(data, dict):
        raise ConversionError(f"'{file}' does not hold a JSON object; re-download or fix it")
    return data


def _generation_config(path: Path):
    if not (path / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(path))
    except Exception:  # a broken generation config must not block a conversion
        return None


def _hf_targets(path: Path, raw: dict, tensors, notes: list):
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        arch = f" ({', '.join(map(str, raw.get('architectures') or []))})" if raw.get("architectures") else ""
        raise ConversionError(f"unsupported architecture: model_type {model_type!r}{arch} in '{path}'; tlm-convert "
                              f"imports the model types {', '.join(SUPPORTED_ARCHITECTURES)} and TLM checkpoints")
    hf_config = read_hf_config(path, raw)
    family = family_of(hf_config)
    try:
        canonical = canonical_source_state_dict(hf_config, {name: name for name in tensors})  # canonical -> file name
    except ValueError as err:
        raise ConversionError(f"'{path}': {one_line(err)}; re-download the checkpoint") from None
    if "lm_head.weight" not in canonical and not getattr(hf_config, "tie_word_embeddings", False):
        hf_config.tie_word_embeddings = True  # as load_source: no head in the file means a tied head
        notes.append(_TIED_NOTE)
    try:
        config = tlm_config_from_hf(hf_config)
    except ValueError as err:
        raise ConversionError(f"{one_line(err)} (tlm-convert only imports models it reproduces exactly; use a "
                              "checkpoint without these settings)") from None
    table, drops = TENSOR_TABLES[family], [re.compile(p) for p in DROPPED_TENSORS[family]]
    targets, unexpected = {}, []
    for name, file_name in canonical.items():
        if any(p.fullmatch(name) for p in drops):
            continue
        template, layer = _layer_template(name)
        if template not in table or (layer is not None and layer >= config.num_hidden_layers):
            unexpected.append(name)
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the file's copy is ignored, as transformers does
        outs, kind = table[template]
        for part, out in enumerate((outs,) if isinstance(outs, str) else outs):
            targets[out.format(i=layer)] = (file_name, kind, part)
    if unexpected:
        more = f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else ""
        raise ConversionError(f"the weights in '{path}' do not match its config: unexpected source tensor(s) "
                              f"{', '.join(unexpected[:3])}{more}; re-download the checkpoint or fix config.json")
    return config, targets, family


def _tlm_targets(path: Path, tensors, notes: list):
    try:
        config = TLMConfig.from_pretrained(str(path))
    except Exception as err:
        raise ConversionError(f"the TLM config in '{path}' is invalid ({one_line(err)}); fix config.json") from None
    names = set(tensors)
    if "lm_head.weight" not in names and "model.embed_tokens.weight" in names and not config.tie_word_embeddings:
        config.tie_word_embeddings = True
        notes.append(_TIED_NOTE)
    targets = {n: (n, COPY, 0) for n in tensors if not (n == "lm_head.weight" and config.tie_word_embeddings)}
    return config, targets


_TIED_NOTE = "the checkpoint has no lm_head.weight: the output layer is tied to the input embeddings"


def _target_shape(kind: str, shape: tuple[int, ...], part: int) -> tuple[int, ...]:
    if kind == COPY:
        return tuple(shape)
    if kind == CONV1D:
        return tuple(reversed(shape))
    if kind == QKV_CONV1D:  # (d, 3d): three column blocks, each transposed
        return (shape[1] // 3, shape[0])
    if kind == QKV_BIAS:
        return (shape[0] // 3,)
    raise AssertionError(kind)


def expected_shapes(config: TLMConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a checkpoint of ``config`` stores (a tied lm_head is not stored)."""
    with torch.device("meta"):
        model = TLMForCausalLM(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def _check_shapes(config: TLMConfig, shapes: dict, path) -> None:
    expected = expected_shapes(config)
    problems = [f"missing {k}" for k in expected if k not in shapes]
    problems += [f"unexpected {k}" for k in shapes if k not in expected]
    problems += [f"{k} has shape {shapes[k]}, expected {expected[k]}" for k in expected
                 if k in shapes and shapes[k] != expected[k]]
    if problems:
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise ConversionError(f"the weights in '{path}' do not match its config: {'; '.join(problems[:3])}{more}; "
                              "re-download the checkpoint or fix config.json")


def _load_tokenizer(src: StreamSource):
    if src.tokenizer_path is None:
        raise ConversionError(f"{src.path} has no tokenizer files; add the source tokenizer to the folder")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(src.tokenizer_path)


def _final_config(config: TLMConfig, widths: list[int], mixer: str) -> TLMConfig:
    """The converted model's config: ``intermediate_sizes`` set as the in-memory path does, then the mixer."""
    new = copy.deepcopy(config)
    new.intermediate_sizes = list(widths)
    if mixer == "attention":
        return new
    if any(m != "attention" for m in new.mixer):  # the checks of upcycle.upcycle
        raise ConversionError(f"--mixer {mixer} upcycles attention layers only; this model has "
                              f"{sorted(set(new.mixer))}")
    if mixer == "hope_attention" and (new.mlp_bias or not new.mlp_gated):
        raise ConversionError("--mixer hope_attention needs a gated MLP without biases (Llama, Qwen, Gemma); "
                              "GPT-2-style MLPs cannot be split into continuum-memory levels")
    new.mixer = [mixer] * new.num_hidden_layers
    if mixer == "hope_attention":
        new.hope_topology, new.hope_inner_lr = "sum", 0.0
    return new


def _check_disk_space(folder: Path, num_params: int, dtype: str) -> None:
    need = num_params * torch.empty(0, dtype=_DTYPES[dtype]).element_size() + (64 << 20)
    free = shutil.disk_usage(folder).free
    if need > free:
        raise ConversionError(f"not enough disk space in '{folder}': the output needs about {need / 2**30:.1f} GiB, "
                              f"{free / 2**30:.1f} GiB are free; free some space or choose another -o")


# ============================================================================================== the streamed run


class _Run:
    """One streamed conversion into ``tmp``: embeddings, layers one by one, final shard, model files."""

    def __init__(self, src: StreamSource, final_config, widths, opts, tmp: Path, calib, evalb, timer, quiet,
                 on_layer):
        self.src, self.widths, self.opts, self.tmp = src, widths, opts, tmp
        self.timer, self.quiet, self.on_layer = timer, quiet, on_layer
        self.dtype = _DTYPES[opts.dtype]
        with torch.device("meta"):  # structure only: configs, rope, norms and the embedding code path
            self.src_model = TLMForCausalLM(src.tlm_config)
            self.final_model = TLMForCausalLM(final_config)
        self.base, self.base_after = self.src_model.model, self.final_model.model
        _real_rope(self.base, torch.float32)
        _real_rope(self.base_after, self.dtype)  # the in-memory path casts the whole final model, buffers too
        self.expected = expected_shapes(self.final_model.config)
        self.num_layers = src.tlm_config.num_hidden_layers
        self.num_shards = self.num_layers + 2
        self.weight_map: dict[str, str] = {}
        self.total_bytes = self.params_written = 0
        self.scores: list[torch.Tensor] = []
        self.calib_tokens = int(calib.numel())
        bs = opts.batch_size
        self.batches = [calib[i : i + bs] for i in range(0, len(calib), bs)]
        self.positions = [torch.arange(b.shape[1]).expand(b.shape[0], -1) for b in self.batches]
        self.eval_batches = None if evalb is None else [evalb[i : i + bs] for i in range(0, len(evalb), bs)]
        self.eval_positions = None if evalb is None else [torch.arange(b.shape[1]).expand(b.shape[0], -1)
                                                          for b in self.eval_batches]
        self.perplexity_before = self.perplexity_after = None
        # calibrate_and_plan's refit_target="residual": refit to the source model's residual stream, carried too
        self.residual = (opts.refit and getattr(opts, "refit_target", "local") == "residual"
                         and not src.tlm_config.sandwich_norm)
        self.source_hidden = None

    # ------------------------------------------------------------------------------------------ the loop

    def convert(self) -> None:
        self._embeddings()
        for i in range(self.num_layers):
            self._layer(i)
            if self.on_layer is not None:
                self.on_layer(i)
        self._final_shard()

    def _embeddings(self) -> None:
        first = [n for n in self.src.other_names() if n.startswith("model.embed")]
        with self.quiet("load"):
            tensors = self.src.read(first)
            self.hidden = self._embed(self.base, tensors, self.batches, self.positions)
            cast = {k: v.to(self.dtype) for k, v in tensors.items()}
            if self.eval_batches is not None:
                self.eval_before = self._embed(self.base, tensors, self.eval_batches, self.eval_positions)
                self.eval_after = self._embed(self.base_after, cast, self.eval_batches, self.eval_positions)
        del tensors
        with self.timer("save"):
            self._write_shard(1, cast)

    @staticmethod
    def _embed(base, tensors, batches, positions) -> list[torch.Tensor]:
        if "model.embed_positions.weight" in tensors:  # GPT-2's learned positions
            base.embed_positions.load_state_dict({"weight": tensors["model.embed_positions.weight"]}, assign=True)
        weight = tensors["model.embed_tokens.weight"]
        return [base.embed(F.embedding(b, weight), p) for b, p in zip(batches, positions)]

    def _layer(self, i: int) -> None:
        """calibrate_and_plan's loop body for layer i, then the layer's shard."""
        opts, src, prefix = self.opts, self.src, f"model.layers.{i}."
        with self.quiet("load"):
            layer = _build_layer(self.src_model.config, i, _strip(src.read(src.layer_names(i)), prefix))
        width, source_width = self.widths[i], layer.mlp.down_proj.in_features
        shrinking = width < source_width
        if self.eval_batches is not None:
            with self.quiet("eval"):
                self.eval_before = [_run_layer(self.base, layer, h, p)
                                    for h, p in zip(self.eval_before, self.eval_positions)]
        keep = (_REUSE is not None and width != source_width
                and self.calib_tokens * source_width * 4 <= KEEP_ACTIVATIONS_BYTES)
        gram = shrinking and (opts.refit or opts.importance == "obs")
        # with the activations kept, the Gram matrix (and the residual target's AᵀY) are built from them after the
        # scores: the scores' fp64 temporaries and the I × I Gram matrix are then never in memory together
        late = gram and keep
        with self.timer("calibrate"):
            if self.residual and shrinking and self.source_hidden is None:  # the source stream starts here
                self.source_hidden = list(self.hidden)
            mixed = [calibrate._mix(self.base, layer, h, p) for h, p in zip(self.hidden, self.positions)]
            if self.source_hidden is not None:  # the source layer (not yet resized) on the source stream
                self.source_hidden = [layer.feed_forward(calibrate._mix(self.base, layer, h, p))
                                      for h, p in zip(self.source_hidden, self.positions)]
            layer.self_attn = None  # read again when the layer is written
            cross = None  # the residual target's AᵀY: batch by batch in the hook, or later from kept activations
            if self.residual and shrinking and opts.refit and not late:
                cross = _CrossAccumulator(layer, mixed, self.source_hidden)
            with _activation_stats(layer.mlp.down_proj, gram=gram and not late, keep=keep,
                                   on_batch=cross.add if cross is not None else None) as stats:
                hidden = [layer.feed_forward(z) for z in mixed]
            if gram and opts.importance in DOWN_ONLY_METRICS:
                _release_inputs(layer.mlp)  # not needed until the resize, which reads them again
        with self.timer("rank"):
            weights = {n: getattr(layer.mlp, n).weight for n in ("gate_proj", "up_proj", "down_proj")
                       if getattr(layer.mlp, n, None) is not None}
            score = neuron_scores(opts.importance, stats, weights, seed=opts.seed + i)
            down = weights["down_proj"]
            weights = None
        if late:
            with self.timer("calibrate"):
                stats.gram = torch.zeros(source_width, source_width, dtype=torch.float64)
                for a in stats.kept:  # the hook's additions, in the hook's order
                    _add_gram(stats.gram, a)
        start = down  # OBS prunes from the least-squares optimum of the target: D (local), D* (residual)
        if shrinking and opts.importance == "obs" and self.residual:
            if cross is None:
                with self.timer("calibrate"):
                    cross = _CrossAccumulator(layer, mixed, self.source_hidden)
                    for a in stats.kept:
                        cross.add(a)
            with self.timer("rank"):
                start = refit_kept(stats.gram, cross.take(), damp=DAMP)
            cross = None
        with self.timer("rank"):
            if shrinking and opts.importance == "obs":
                keep_idx, new_down = obs_prune(stats.gram, start, width, damp=DAMP)
                start = None
                plan = LayerPlan(keep=keep_idx, down_override=new_down.to(down.dtype))
            else:
                plan = plan_from_scores([score], [width])[0]
        if shrinking and opts.refit and opts.importance != "obs":
            _release_inputs(layer.mlp)  # gate/up: read again for the resize
            if self.residual and late:
                with self.timer("calibrate"):
                    cross = _CrossAccumulator(layer, mixed, self.source_hidden, rows=plan.keep)
                    for a in stats.kept:
                        cross.add(a)
            with self.timer("rank"):  # the sums are handed over (no reference kept here): the refit frees them
                if cross is None:
                    plan.down_override = refit_down_proj_inplace(stats.gram, down, plan.keep, damp=DAMP)
                elif cross.rows is None:
                    plan.down_override = refit_down_proj_inplace(stats.gram, down, plan.keep, damp=DAMP,
                                                                 cross=cross.take())
                else:
                    plan.down_override = refit_down_proj_inplace(stats.gram, down, plan.keep, damp=DAMP,
                                                                 rhs_t=cross.take())
                cross = None
        down = None
        stats.gram = None
        if width != source_width:
            with self.timer("resize"):
                sd = {prefix + "mlp." + k: v for k, v in layer.mlp.state_dict().items()}
                sd.update(src.read([n for n in src.layer_names(i) if n.startswith(prefix + "mlp.") and n not in sd]))
                _resize_assign(layer, i, plan, sd, self.src_model.config, opts.grow_init, opts.seed)
                del sd
                kept = getattr(stats, "kept", None)
                if kept is not None:
                    hidden = [_REUSE(layer, z, a, plan) for z, a in zip(mixed, kept)]
                else:
                    hidden = [layer.feed_forward(z) for z in mixed]
        stats = mixed = None
        self.hidden = hidden
        self.scores.append(score.float())
        with self.quiet("load"):
            state = {prefix + k: v for k, v in layer.state_dict().items()}
            del layer
            state.update(src.read([n for n in src.layer_names(i) if n not in state]))
        state = _upcycle_layer(state, i, self.opts.mixer, self.final_model.config, self.widths[i],
                               carry_scores(self.scores[-1], plan.keep, plan.grow), self.expected)
        state = {k: v.to(self.dtype) for k, v in state.items()}
        if self.eval_batches is not None:
            with self.quiet("eval"):
                after = _build_layer(self.final_model.config, i, _strip(state, prefix))
                self.eval_after = [_run_layer(self.base_after, after, h, p)
                                   for h, p in zip(self.eval_after, self.eval_positions)]
                del after
        with self.timer("save"):
            self._write_shard(i + 2, state)
        _trim_heap()
        logger.info("layer %d: width %d -> %d, peak RSS %.0f MB", i, source_width, width, peak_rss_mb())

    def _final_shard(self) -> None:
        last = [n for n in self.src.other_names() if not n.startswith("model.embed")]
        with self.quiet("load"):
            tensors = self.src.read(last)
        cast = {k: v.to(self.dtype) for k, v in tensors.items()}
        if self.eval_batches is not None:
            with self.quiet("eval"):
                head = tensors.get("lm_head.weight")
                if head is None:  # tied
                    head = self.src.read(["model.embed_tokens.weight"])["model.embed_tokens.weight"]
                norm = {k.removeprefix("model.norm."): v for k, v in tensors.items() if k.startswith("model.norm.")}
                self.perplexity_before = _perplexity(self.base, norm, head, self.eval_before, self.eval_batches)
                norm = {k.removeprefix("model.norm."): v for k, v in cast.items() if k.startswith("model.norm.")}
                self.perplexity_after = _perplexity(self.base_after, norm, head.to(self.dtype), self.eval_after,
                                                    self.eval_batches)
                self.eval_before = self.eval_after = None
        with self.timer("save"):
            self._write_shard(self.num_shards, cast)

    # ------------------------------------------------------------------------------------------ output

    def _write_shard(self, k: int, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        name = SHARD_NAME.format(k, self.num_shards)
        clean = {}
        for key, tensor in tensors.items():
            if key not in self.expected or key in self.weight_map:
                raise ConversionError(f"internal error: tensor {key} has no place in the converted model")
            if tensor.is_floating_point() and tensor.dtype != self.dtype:
                raise ConversionError(f"internal error: {key} is {tensor.dtype}, the output is {self.opts.dtype}")
            if tuple(tensor.shape) != self.expected[key]:
                raise ConversionError(f"internal error: {key} has shape {tuple(tensor.shape)}, the converted model "
                                      f"expects {self.expected[key]}")
            clean[key] = tensor.detach().contiguous()
        save_file(clean, str(self.tmp / name), metadata={"format": "pt"})
        for key, tensor in clean.items():
            self.weight_map[key] = name
            self.total_bytes += tensor.numel() * tensor.element_size()
            self.params_written += tensor.numel()

    def finish(self, tokenizer) -> None:
        """Index, config + remote code (as save_pretrained writes them), generation config, tokenizer."""
        from transformers.dynamic_module_utils import custom_object_save

        missing = [k for k in self.expected if k not in self.weight_map]
        if missing:
            raise ConversionError(f"internal error: the converted model lacks {', '.join(missing[:3])}")
        index = {"metadata": {"total_size": self.total_bytes, "total_parameters": self.params_written},
                 "weight_map": dict(sorted(self.weight_map.items()))}
        (self.tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        model = self.final_model
        model.config.dtype = self.opts.dtype
        model.config.architectures = [type(model).__name__]
        custom_object_save(model, self.tmp, config=model.config)  # modeling_tlm.py and its imports, auto_map
        model.config.save_pretrained(str(self.tmp))
        _save_generation_config(self.src.generation_config, model.generation_config, self.tmp)
        _save_tokenizer(tokenizer, self.src.tokenizer_path, self.tmp)

    def param_report(self) -> dict:
        before, after = self.src.num_params, self.params_written
        if self.opts.mixer == "attention" and after != before:
            raise ConversionError(f"internal error: {after} parameters written, {before} in the source")
        return {"params_before": before, "params_after": after, "params_added_by_mixer": after - before}


def _real_rope(base, dtype) -> None:
    for name in ("rotary_emb", "local_rotary_emb"):
        rotary = getattr(base, name, None)
        if rotary is not None:
            rotary.inv_freq = rope_inv_freq(rotary.params, rotary.head_dim).to(dtype)


def _strip(tensors: dict, prefix: str) -> dict:
    return {k.removeprefix(prefix): v for k, v in tensors.items()}


def _build_layer(config, i: int, tensors: dict) -> TLMDecoderLayer:
    """Decoder layer i holding ``tensors`` (names relative to the layer) as its parameters, without copies."""
    with torch.device("meta"):
        layer = TLMDecoderLayer(config, i)
    layer.load_state_dict(tensors, strict=True, assign=True)
    return layer.eval()


def _run_layer(base, layer, h, positions):
    """One layer of TLMModel.forward (no cache, no padding)."""
    rope, masks = base.block_context(h, positions)
    return layer(h, rope.get(layer.layer_type), masks[layer.layer_type], None)


def _trim_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc malloc_trim) so that freed layers leave the RSS."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes

            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None


def _release_inputs(mlp) -> None:
    for name in ("gate_proj", "up_proj"):
        if getattr(mlp, name, None) is not None:
            setattr(mlp, name, None)


def _resize_assign(layer, idx: int, plan: LayerPlan, sd: dict, cfg, grow_init: str, seed: int) -> None:
    """calibrate._resize_in_place without its second copy: the resized tensors become the parameters."""
    prefix = f"model.layers.{idx}.mlp."
    new = resize_layer(sd, idx, plan, grow_init, NOISE_SCALE, seed, cfg.mlp_gated)
    mlp = layer.mlp
    for name in ("gate_proj", "up_proj", "down_proj"):
        key = prefix + name + ".weight"
        if key not in new:
            continue
        old = getattr(mlp, name, None)
        bias = new.get(prefix + name + ".bias", old.bias if old is not None else None)
        with torch.device("meta"):
            linear = torch.nn.Linear(new[key].shape[1], new[key].shape[0], bias=bias is not None)
        linear.weight = torch.nn.Parameter(new[key], requires_grad=False)
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias, requires_grad=False)
        setattr(mlp, name, linear)
    mlp.intermediate_size = plan.width


def _upcycle_layer(state: dict, i: int, mixer: str, final_config, width: int, score, expected) -> dict:
    """upcycle.upcycle restricted to layer i (attention, gated_attention, hope_attention)."""
    prefix = f"model.layers.{i}."
    if mixer == "gated_attention":
        for part in ("weight", "bias"):
            key = prefix + "self_attn.gate_proj." + part
            state[key] = torch.zeros(expected[key], dtype=torch.float32)
        state[prefix + "self_attn.o_proj.weight"] = 2 * state[prefix + "self_attn.o_proj.weight"]
    elif mixer == "hope_attention":
        levels = _split_mlp(state, prefix, final_config, width, score)
        state = {k: v for k, v in state.items() if not k.startswith(prefix + "mlp.")}
        state.update(levels)
    return state


@torch.no_grad()
def _perplexity(base, norm_state: dict, head: torch.Tensor, hidden, batches) -> float:
    """convert.perplexity's formula on carried last-layer hidden states; logits one sequence at a time."""
    base.norm.load_state_dict(norm_state, assign=True)
    total, count = 0.0, 0
    for h, ids in zip(hidden, batches):
        h = base.norm(h)
        for b in range(h.shape[0]):
            logits = F.linear(h[b : b + 1], head)  # (1, S, V)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[b : b + 1, 1:].flatten(),
                                   ignore_index=-100)
            n = ids.shape[1] - 1
            total, count = total + float(loss) * n, count + n
    return math.exp(total / count)


def _save_generation_config(source_config, model_config, out: Path) -> None:
    for config in (source_config, model_config):  # the source's when it has one (as export_model does)
        if config is None:
            continue
        try:
            config.save_pretrained(str(out))
            return
        except Exception as err:  # an invalid source generation config must not sink the conversion
            warnings.warn(f"generation_config.json not written from the source ({one_line(err)})", stacklevel=3)


def _save_tokenizer(tokenizer, source_folder: str | None, out: Path) -> None:
    try:
        tokenizer.save_pretrained(str(out))
        return
    except Exception as err:
        problem = one_line(err)
    copied = [n for n in _TOKENIZER_FILES if source_folder and (Path(source_folder) / n).is_file()]
    for name in copied:
        shutil.copyfile(Path(source_folder) / name, out / name)
    if not copied:
        warnings.warn(f"the tokenizer could not be saved ({problem}); add the tokenizer files to the output by hand",
                      stacklevel=3)


def _write_reports(tmp: Path, report: dict, timer) -> None:
    from .report import write_markdown, write_plot

    write_plot(report, tmp / "widths.png")  # the plot does not show seconds: drawn first, so they count
    report["seconds"] = timer.snapshot()
    report["peak_rss_mb"] = peak_rss_mb()
    (tmp / "conversion_report.json").write_text(json.dumps(report, indent=2))
    write_markdown(report, tmp / "report.md")


# ============================================================================================== frugal statistics


def _block_rows(bytes_per_row: int) -> int:
    return max(1, BLOCK_BYTES // max(1, bytes_per_row))


class BlockedGramStats(ActivationStats):
    """ActivationStats whose Gram matrix is accumulated in row blocks.

    ``ActivationStats.update`` forms the whole fp32 product AᵀA and an fp64 copy of it per batch (12·I² bytes on
    top of the 8·I² accumulator); here the temporaries are at most ``BLOCK_BYTES``. Each block is the same
    fp32 product, added in fp64; a layer narrow enough for one block takes exactly the in-memory path's steps.
    """

    @torch.no_grad()
    def update(self, a: torch.Tensor) -> None:
        gram, self.gram = self.gram, None
        try:
            super().update(a)  # every other statistic exactly as the in-memory path
        finally:
            self.gram = gram
        if gram is None:
            return
        _add_gram(gram, a)


def _add_gram(gram: torch.Tensor, a: torch.Tensor) -> None:
    """gram += AᵀA for one batch of activations (B, S, I), as ActivationStats.update adds it, in row blocks."""
    a = a.float() if a.dim() == 3 else a.float()[None]
    flat = a.reshape(-1, a.shape[-1])  # (B*S, I)
    width = flat.shape[1]
    rows = _block_rows(12 * width)
    if rows >= width:
        gram += (flat.T @ flat).double()
        return
    for r in range(0, width, rows):
        gram[r : r + rows] += (flat[:, r : r + rows].T @ flat).double()


class _CrossAccumulator:
    """The residual target's right-hand side, Σ_batches aᵀ(h_src − z − b) (I, d) fp64, one batch at a time and in place; with
    ``rows`` only those rows, stored transposed (d, K): the refit's right-hand side as it solves it.

    Products in fp32, additions in fp64 in batch order (0 + X₀ + X₁ + ...); a layer narrow enough for one block
    forms all rows (and then picks the wanted ones), a wider one forms only the wanted rows, in blocks of at most
    BLOCK_BYTES.
    """

    def __init__(self, layer, mixed, source_hidden, rows: list[int] | None = None):
        self.layer, self.mixed, self.source_hidden = layer, mixed, source_hidden
        self.rows = None if rows is None else torch.tensor(rows, dtype=torch.long)
        self.total, self.batch = None, 0

    def add(self, a: torch.Tensor) -> None:
        z, h = self.mixed[self.batch], self.source_hidden[self.batch]
        self.batch += 1
        bias = self.layer.mlp.down_proj.bias
        target = (h - z) if bias is None else (h - z - bias)  # (B, S, d)
        acts, target = a.flatten(0, 1).T.float(), target.flatten(0, 1).float()  # (I, N), (N, d)
        width, d = acts.shape[0], target.shape[1]
        block = _block_rows(12 * d)
        if block >= width:
            product = (acts @ target).double()  # (I, d)
            if self.rows is not None:
                product = product[self.rows].T  # (d, K)
            self.total = product.contiguous() if self.total is None else self.total.add_(product)
            return
        if self.total is None:  # 0 + X₀ = X₀
            self.total = torch.zeros(width, d, dtype=torch.float64) if self.rows is None else \
                torch.zeros(d, len(self.rows), dtype=torch.float64)
        for r in range(0, width if self.rows is None else len(self.rows), block):
            if self.rows is None:
                self.total[r : r + block] += (acts[r : r + block] @ target).double()
            else:
                self.total[:, r : r + block] += (acts[self.rows[r : r + block]] @ target).double().T

    def take(self) -> torch.Tensor:
        """The sum, handed over (the accumulator lets go of it, so that the refit can free it early)."""
        total, self.total = self.total, None
        return total


@contextmanager
def _activation_stats(down_proj, gram: bool = False, keep: bool = False, on_batch=None):
    stats = BlockedGramStats(down_proj.in_features, gram=gram, **({"keep": True} if keep else {}))

    def hook(_module, args):
        stats.update(args[0].detach())
        if on_batch is not None:
            on_batch(args[0].detach())

    handle = down_proj.register_forward_pre_hook(hook)
    try:
        yield stats
    finally:
        handle.remove()


def refit_down_proj_inplace(gram: torch.Tensor, down: torch.Tensor, keep: list[int], damp: float = DAMP,
                            cross: torch.Tensor | None = None, rhs_t: torch.Tensor | None = None) -> torch.Tensor:
    """``compensate.refit_down_proj`` (the same solution up to rounding) with no K × K or I × I temporaries.

    gram: (I, I) fp64, contiguous, DESTROYED (its storage holds G_KK + λI and then its Cholesky factor);
    down: (d, I); keep: ascending kept indices; cross: (I, d) = AᵀY for another target Y than A Dᵀ (the residual
    target), or directly rhs_t = cross[keep]ᵀ (d, K) fp64 contiguous, which is solved in place (DESTROYED)
    -> the new down projection (d, |K|) in ``down.dtype``. A ``cross`` handed over without another reference is
    freed before the solve.
    """
    import numpy as np
    from scipy.linalg import lapack

    if not gram.is_contiguous() or gram.dtype != torch.float64:
        raise ValueError("refit_down_proj_inplace needs a contiguous float64 Gram matrix")
    n, k, d = gram.shape[0], len(keep), down.shape[0]
    idx = torch.tensor(keep, dtype=torch.long)
    # right-hand side G_K: Dᵀ (K, d) (or cross[K]), held transposed (d, K) so that LAPACK solves it in place
    if rhs_t is not None:
        if tuple(rhs_t.shape) != (d, k) or not rhs_t.is_contiguous() or rhs_t.dtype != torch.float64:
            raise ValueError(f"rhs_t must be a contiguous float64 ({d}, {k}) tensor")
    elif cross is not None:
        rhs_t = cross[idx].T.contiguous()
        del cross
    else:
        rhs_t = torch.empty(d, k, dtype=torch.float64)
        rows = _block_rows(8 * (n + d))
        if rows >= k:  # one block: refit_down_proj's own product
            rhs_t.copy_((gram[idx] @ down.double().T).T)
        else:  # blocks of kept rows × blocks of output columns: no (I, d) fp64 copy of the down projection
            cols = _block_rows(8 * n)
            for c in range(0, d, cols):
                down_t = down[c : c + cols].double().T  # (I, c)
                for s in range(0, k, rows):
                    rhs_t[c : c + cols, s : s + rows] = (gram[idx[s : s + rows]] @ down_t).T
            del down_t
    # G_KK compacted into the first K·K entries of the Gram storage: kept row j = keep[r] >= r goes to offset r·K,
    # which ends at (r+1)·K <= keep[r+1]·I, so no row is overwritten before it has been read
    flat = gram.view(-1)
    rows = _block_rows(8 * (n + k))
    for s in range(0, k, rows):
        block = gram[idx[s : s + rows]][:, idx]  # (b, K), a copy
        flat[s * k : (s + block.shape[0]) * k] = block.reshape(-1)
    system = flat[: k * k].view(k, k)
    lam = damp * system.diagonal().mean().clamp(min=1e-12)
    system.diagonal().add_(lam)  # = g_kk + lam·I, entry for entry
    diagonal = system.diagonal().clone()
    # the symmetric system seen column-major; Cholesky writes its lower triangle (row-major: the upper one) only
    factor, info = lapack.dpotrf(system.numpy().T, lower=1, clean=0, overwrite_a=1)
    if info < 0:
        raise RuntimeError(f"LAPACK dpotrf: illegal argument {-info}")
    if info > 0:  # not positive definite even with damping: least squares, as refit_down_proj falls back to
        full = torch.tril(system, -1)  # the row-major lower triangle is untouched
        full = full + full.T
        full.diagonal().copy_(diagonal)
        solution = torch.linalg.lstsq(full, rhs_t.T).solution  # (K, d)
        return solution.T.to(down.dtype).contiguous()
    rhs = rhs_t.numpy().T  # (K, d), column-major view
    x, info = lapack.dpotrs(factor, rhs, lower=1, overwrite_b=1)
    if info != 0:
        raise RuntimeError(f"LAPACK dpotrs failed (info {info})")
    solution_t = torch.from_numpy(np.asarray(x).T)  # (d, K)
    return solution_t.to(down.dtype).contiguous()


__all__ = ["convert_streaming", "check_options", "open_source", "StreamSource", "BlockedGramStats",
           "refit_down_proj_inplace", "expected_shapes"]
