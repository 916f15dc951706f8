"""A run's folder and its checkpoints: locking output_dir, choosing the checkpoint a resume starts from, checking
that it belongs to this run, and writing and reading ``checkpoint-<step>/`` and ``final/``.

A checkpoint holds the model (safetensors, loads like any TLM), the optimizer, scheduler and every rank's RNG state
(``.json`` + ``.safetensors``, no pickle: tlm_train.state_io), ``trainer_state.json`` (step, tokens, the run's
fingerprint, the data position), the resolved ``recipe.yaml`` and ``manifest.json`` (sizes and SHA-256, written
last). Folders are written under a temporary name and swapped in (tlm_io.outputs.publish), so a kill or a full disk
never leaves a half-written checkpoint under its real name; ``resume=True`` skips, with a warning, checkpoints that
do not match their manifest and takes the newest complete one.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from tlm_io.errors import ConversionError, RecipeError, StateError, TrainError, first_few
from tlm_io.export import export_model
from tlm_io.outputs import (MARKER, OutputLock, check_run_folder, check_writable_parent, clean_stale_in, mark_run_folder,
                            publish, replace_problem, save_errors, write_marker)

from . import state_io
from .distributed import Dist, full_optim_state, full_state_dict, load_full_state, unwrap
from .recipe import Recipe, recipe_from_dict
from .recipe_file import read_recipe_file

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint-"
FINAL_DIR = "final"
STOP_FILE = "STOP"  # a file of this name in output_dir stops the run at the next step boundary
# what a run writes into output_dir (its clean-up touches only the temporary / set-aside forms of _OUTPUTS)
_OUTPUTS = rf"{CHECKPOINT_PREFIX}\d+|{FINAL_DIR}"
_OWNED = (rf"{_OUTPUTS}|\.(?:{_OUTPUTS})\.(?:tmp-train|old-\d+)|recipe\.yaml|metrics\.jsonl|run_summary\.json|"
          rf"tensorboard|{STOP_FILE}")
# recipe keys a resume may change (the rest must equal the checkpoint's recipe.yaml)
RESUMABLE = ("output_dir", "log", "train.max_steps", "optim.schedule_steps", "train.num_threads", "train.device",
             "train.compile", "train.gradient_checkpointing", "data.cache_dir", "data.num_proc", "data.num_workers",
             "trust_remote_code")
_FINGERPRINT_KEYS = ("parameters", "global_batch", "seq_len", "train_data", "seed", "skip_batches")


# ============================================================================================== the run folder


def lock_run_folder(out: Path, d: Dist, recipe_file: str | None = None) -> OutputLock | None:
    """Rank 0 locks ``out`` for the run (a second run into it is refused) and, holding the lock, removes the
    temporary folders of killed runs; every rank learns whether that worked (no rank waits forever).
    ``recipe_file``: the recipe's own path, which ``out`` must not hold."""
    lock, problem = None, None
    if d.main:
        try:
            check_writable_parent(out.absolute(), option="output_dir")
            lock = OutputLock(out, option="output_dir").acquire()
            check_run_folder(out, _OWNED, "output_dir", not_inside=recipe_file)
            check_own_files(out)
            mark_run_folder(out)
            clean_stale_in(out, _OUTPUTS)
        except (ConversionError, OSError) as err:
            problem = str(err)
    if d.any(problem is not None):
        if lock is not None:
            lock.release()
        raise TrainError(problem or "rank 0 could not lock output_dir (see its error)")
    return lock


_WRITTEN = ("recipe.yaml", "metrics.jsonl", "run_summary.json", "tensorboard")  # rewritten or appended by a run


def check_own_files(out: Path) -> None:
    """A run writes these names in output_dir; a symbolic link (or a device, pipe, ...) in the place of one would
    send the writes into a file the run does not own: refused."""
    for name in _WRITTEN:
        path = out / name
        if path.is_symlink() or (path.exists() and not (path.is_dir() if name == "tensorboard" else path.is_file())):
            what = "a symbolic link" if path.is_symlink() else "not a plain " + ("folder" if name == "tensorboard"
                                                                                 else "file")
            raise ConversionError(f"output_dir {out}: {name} is {what}, which a run never writes through; remove it "
                                  "or choose a new folder for output_dir")


def discard_new_folder(out: Path, refused: bool = False) -> None:
    """After a failed start: ``out``, when it holds nothing but the run's marker, is removed (a refused run leaves
    nothing behind). The caller asks only for a folder its run created, on rank 0. ``refused``: the run was refused
    by its time budget a few steps in; what it wrote there (the names a run writes, never a link) goes first."""
    try:
        if refused:
            for path in out.iterdir():
                if re.fullmatch(_OWNED, path.name) and not path.is_symlink():
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        if set(os.listdir(out)) <= {MARKER}:
            (out / MARKER).unlink(missing_ok=True)
            out.rmdir()
    except OSError:
        pass


def temp_dir(final: Path) -> Path:
    """Where ``final`` is written before it is swapped in (fixed: every rank writes its RNG state into it)."""
    return final.parent / f".{final.name}.tmp-train"


# ============================================================================================== choosing one


def list_checkpoints(output_dir: Path) -> list[Path]:
    """checkpoint-<step> folders, oldest first (temporary folders of unfinished writes are ignored)."""
    found = []
    for p in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}*"):
        suffix = p.name[len(CHECKPOINT_PREFIX):]
        if p.is_dir() and suffix.isdigit() and os.path.lexists(p / "trainer_state.json"):  # a damaged one is judged
            found.append((int(suffix), p))
    return [p for _, p in sorted(found)]


def checkpoint_problem(path: Path) -> str | None:
    """None when checkpoint ``path`` is complete and intact, else what is wrong with which file: its files against
    the manifest (confined to the folder: tlm_train.state_io.check), then its trainer_state.json against its own
    recipe.yaml (:func:`state_problem`)."""
    return (state_io.check(path, required=("trainer_state.json", "optimizer.pt", "scheduler.pt"))
            or state_problem(path))


def state_problem(path: Path) -> str | None:
    """None when ``path``'s trainer_state.json agrees with itself, its folder's name and the recipe.yaml written with
    it (a step within train.max_steps; tokens, samples and the data position the step and batch layout give); else
    the first disagreement. A checkpoint of the first format is checked on what it has."""
    try:
        state = read_trainer_state(path)
    except StateError as err:
        return str(err)
    step, fp = state["step"], state.get("fingerprint")
    suffix = path.name[len(CHECKPOINT_PREFIX):]
    if suffix.isdigit() and int(suffix) != step:
        return f"trainer_state.json says step {step}, its folder {path.name}"
    recipe = _saved_recipe(path)
    train = recipe.get("train") if isinstance(recipe, dict) else None
    max_steps = train.get("max_steps") if isinstance(train, dict) else None
    if type(max_steps) is int and step > max_steps:
        return f"trainer_state.json says step {step:,}, beyond the train.max_steps {max_steps:,} of its recipe.yaml"
    if not isinstance(fp, dict):
        return None if "fingerprint" not in state else "trainer_state.json has a malformed fingerprint"
    batch, seq_len, skip = fp.get("global_batch"), fp.get("seq_len"), fp.get("skip_batches", 0)
    if not all(type(v) is int and v >= 0 for v in (batch, seq_len, skip)) or batch == 0:
        return "trainer_state.json has a malformed fingerprint (global_batch, seq_len, skip_batches)"
    world = state.get("world_size", 1)
    per_rank = (train.get("batch_size"), train.get("grad_accum", 1)) if isinstance(train, dict) else (None, None)
    expected = {"tokens": step * batch * seq_len, "samples": step * batch}
    if all(type(v) is int for v in per_rank) and type(world) is int:
        expected["world_size"] = batch // max(1, per_rank[0] * per_rank[1])
    data = state.get("data")
    if isinstance(data, dict):
        expected["data.samples"] = (skip + step) * batch
    for key, want in expected.items():
        have = data.get("samples") if key == "data.samples" else state.get(key)
        if have is not None and have != want:
            return (f"trainer_state.json's {key} is {have!r}, not the {want:,} that step {step:,} gives (a tampered or "
                    "damaged state)")
    return None


def _saved_recipe(path: Path):
    """The recipe.yaml written with checkpoint ``path`` as data (None when it has none or it cannot be read)."""
    try:
        return read_recipe_file(path / "recipe.yaml") if (path / "recipe.yaml").is_file() else None
    except RecipeError:
        return None


def newest_complete(checkpoints: list[Path]) -> Path:
    """The newest checkpoint that passes :func:`checkpoint_problem`; a warning names each newer one skipped."""
    skipped = []
    for path in reversed(checkpoints):
        problem = checkpoint_problem(path)
        if problem is None:
            for bad, why in skipped:
                warnings.warn(f"{bad} is incomplete or damaged ({why}); resuming from {path.name} instead",
                              stacklevel=2)
            return path
        skipped.append((path, problem))
    listed = "; ".join(f"{p.name}: {why}" for p, why in skipped)
    raise TrainError(f"--resume: no complete checkpoint in {checkpoints[-1].parent} ({listed}); start a new "
                     "output_dir")


def resume_path(out: Path, resume: bool | str | None, max_steps: int | None = None) -> Path | None:
    """The checkpoint a run into ``out`` starts from: None for a new run (refused when ``out`` has checkpoints),
    the newest complete one for ``resume=True``, else the folder ``resume`` names (checked). What the run to
    ``max_steps`` would replace must be its own (:func:`check_replaceable`)."""
    existing = list_checkpoints(out) if out.exists() else []
    if resume is None or resume is False:
        if existing:
            raise TrainError(f"{out} already has checkpoints (latest {existing[-1].name}); pass --resume to "
                             "continue that run, or choose a new output_dir")
        return None
    if resume is True:
        if not existing:
            raise TrainError(f"--resume: no checkpoint-<step> folder in {out}; run without --resume to start")
        path = newest_complete(existing)
        check_replaceable(out, path, max_steps)
        return path
    path = Path(resume)
    if not os.path.lexists(path / "trainer_state.json"):
        raise TrainError(f"--resume {path}: not a checkpoint folder (no trainer_state.json); pass a "
                         f"{CHECKPOINT_PREFIX}<step> folder or --resume alone for the latest")
    problem = checkpoint_problem(path.resolve())
    if problem is not None:
        raise TrainError(f"--resume {path}: the checkpoint is incomplete or damaged ({problem}); resume from an "
                         f"earlier {CHECKPOINT_PREFIX}<step> folder, or --resume alone for the newest complete one")
    check_replaceable(out, path, max_steps)
    return path


def check_replaceable(out: Path, start: Path, max_steps: int | None = None) -> None:
    """A run resumed from ``start`` to ``max_steps`` may replace the checkpoints of ``out`` after its step (up to
    ``max_steps``) and ``final/``: each must be a folder a run wrote (tlm_io.outputs.replace_problem), or the run is
    refused now rather than at that save."""
    step, last = _step_of(start), max_steps if max_steps is not None else float("inf")
    later = [p for p in _checkpoint_folders(out) if step is not None and step < _step_of(p) <= last]
    later.append(out / FINAL_DIR)
    for path in later:
        if os.path.lexists(path) and (problem := replace_problem(path)) is not None:
            raise TrainError(f"{path} {problem}; a run resumed from {start.name} replaces it: move it (or what was "
                             "added to it) away, or start a new output_dir")


def _checkpoint_folders(out: Path) -> list[Path]:
    return sorted((p for p in Path(out).glob(f"{CHECKPOINT_PREFIX}*") if _step_of(p) is not None), key=_step_of)


def _step_of(path: Path) -> int | None:
    suffix = Path(path).name[len(CHECKPOINT_PREFIX):]
    return int(suffix) if Path(path).name.startswith(CHECKPOINT_PREFIX) and suffix.isdigit() else None


# ============================================================================================== belongs to this run?


def fingerprint(model, recipe: Recipe, world: int) -> dict:
    """What a checkpoint must share with the run that resumes it."""
    core = unwrap(model)
    return {"parameters": {k: list(v.shape) for k, v in core.state_dict().items()},
            "global_batch": recipe.train.batch_size * recipe.train.grad_accum * world,
            "seq_len": recipe.data.seq_len, "train_data": recipe.data.train, "seed": recipe.seed,
            "skip_batches": recipe.data.skip_batches}


def check_fingerprint(path: Path, theirs: dict, ours: dict) -> None:
    for key in _FINGERPRINT_KEYS:
        if theirs.get(key) != ours[key]:
            what = "model shapes" if key == "parameters" else key
            raise TrainError(f"checkpoint {path} does not match this recipe ({what} differ: "
                             f"{_brief(theirs.get(key))} vs {_brief(ours[key])}); resume with the recipe it was "
                             "written with (its recipe.yaml) or start a new output_dir")


def check_recipe(path: Path, recipe: Recipe) -> None:
    """Refuse a resume whose recipe changes the run (model config, data, optimizer, ...) beyond what a resume
    may change (:data:`RESUMABLE`: max_steps and the schedule's length, logging, threads, caches); names the differing keys. The
    checkpoint's recipe is read with today's defaults, so a key added to the format since it was written (at its
    default) is no change."""
    theirs = _saved_recipe(path)  # None: a checkpoint of the first format, without its recipe
    if not isinstance(theirs, dict):
        return
    try:
        theirs = recipe_from_dict(theirs).to_dict()
    except RecipeError:
        pass  # compared as written
    old, new = _flat(theirs), _flat(recipe.to_dict())
    changed = sorted(k for k in old.keys() | new.keys()
                     if old.get(k) != new.get(k) and not any(k == a or k.startswith(a + ".") for a in RESUMABLE))
    if changed:
        detail = first_few((f"{k}: {_brief(old.get(k))} -> {_brief(new.get(k))}" for k in changed), sep="; ")
        raise TrainError(f"checkpoint {path} was written by a different recipe ({detail}); resume with the recipe "
                         "it was written with (its recipe.yaml) or start a new output_dir")


def data_position(order, step: int, seq_len: int) -> dict:
    """Where the data order (tlm_train.data.BatchOrder) stands after ``step`` steps (the step alone decides it; the
    rest is checked on resume)."""
    samples = (order.skip_batches + step) * order.global_batch
    return {"samples": samples, "epoch": samples // len(order.blocks), "block_in_epoch": samples % len(order.blocks),
            "train_blocks": len(order.blocks), "train_tokens": len(order.blocks) * seq_len}


def check_data_position(path: Path, saved: dict | None, order) -> None:
    """The order of a resumed run is that of the checkpoint's only over the same training blocks."""
    if saved is not None and saved["train_blocks"] != len(order.blocks):
        raise TrainError(f"checkpoint {path} was trained on {saved['train_blocks']} blocks of data, this run has "
                         f"{len(order.blocks)} (data.train or data.max_train_tokens changed); resume with "
                         "the same data or start a new output_dir")


def _flat(tree, prefix: str = "") -> dict:
    """{'a.b': value} of a nested mapping."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


def _brief(value) -> str:
    if isinstance(value, dict):
        return f"{len(value)} tensors"
    return repr(value)


# ============================================================================================== reading


def read_trainer_state(path: Path) -> dict:
    """trainer_state.json of checkpoint ``path`` (bounded, no link followed), its step a non-negative integer."""
    file = path / "trainer_state.json"
    state = state_io.read_json_state(file)
    if not isinstance(state, dict) or type(state.get("step")) is not int or state["step"] < 0:
        raise StateError(f"{file} has no step (a non-negative integer)")
    return state


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model weights of checkpoint ``path``: every safetensors file its manifest lists (all of them in a
    checkpoint of the first format) but the optimizer's, scheduler's and RNG's."""
    from safetensors.torch import load_file

    weights = {}
    names = state_io.listed(path)
    for file in sorted(path.glob("*.safetensors")):
        if file.name.startswith(("optimizer", "scheduler", "rng_state_")) or names is not None and file.name not in names:
            continue
        try:
            weights.update(load_file(str(file)))
        except Exception as err:  # safetensors raises its own error type
            raise StateError(f"{file} cannot be read ({str(err).splitlines()[0][:200]})") from None
    return weights


# ============================================================================================== random state


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)


def rng_state() -> dict:
    """This process's random state (Python, torch, numpy, CUDA): a checkpoint keeps every rank's."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ============================================================================================== writing and restoring


class CheckpointStore:
    """The checkpoints of one run into ``out``: :meth:`save` (checkpoint-<step>), :meth:`save_final` (final/: the
    trained model and its tokenizer) and :meth:`restore`. Every rank calls each method (they meet at barriers);
    rank 0 writes the files. ``model`` is the trained (possibly DDP/FSDP-wrapped) module, ``config`` its TLMConfig;
    ``order`` the run's tlm_train.data.BatchOrder; ``fingerprint`` what a resume must share (:func:`fingerprint`)."""

    def __init__(self, out: Path, recipe: Recipe, d: Dist, model, optimizer, scheduler, config, tokenizer, order,
                 fingerprint: dict):
        self.out, self.recipe, self.d = out, recipe, d
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.config, self.tokenizer, self.order, self.fingerprint = config, tokenizer, order, fingerprint

    def save(self, step: int) -> Path:
        """checkpoint-<step>: written into a temporary folder, checksummed (manifest.json), then swapped in."""
        final = self.out / f"{CHECKPOINT_PREFIX}{step}"
        with save_errors(final, self._checkpoint_bytes(), "output_dir"), self._removed_on_failure(final):
            return self._save(step, final)

    def save_final(self) -> Path:
        final = self.out / FINAL_DIR
        with save_errors(final, self._checkpoint_bytes() // 3, "output_dir"), self._removed_on_failure(final):
            return self._save_final(final)

    @contextmanager
    def _removed_on_failure(self, final: Path):
        """A failed save leaves no temporary folder behind (a killed one is removed by the next run)."""
        try:
            yield
        except BaseException:
            if self.d.main:
                shutil.rmtree(temp_dir(final), ignore_errors=True)
            raise

    def _checkpoint_bytes(self) -> int:
        """About what a checkpoint takes on disk: the fp32 weights and AdamW's two moments."""
        return sum(p.numel() for p in self.model.parameters()) * 4 * 3

    def _save(self, step: int, final: Path) -> Path:
        r, d = self.recipe, self.d
        tmp = temp_dir(final)
        weights = full_state_dict(self.model, r.train.parallel)
        optim = full_optim_state(self.model, self.optimizer, r.train.parallel)
        if d.main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        d.barrier()
        state_io.save_state(tmp, f"rng_state_{d.rank}", rng_state())
        if d.main:
            self._write_model(tmp, weights)
            state_io.save_state(tmp, "optimizer", optim)
            state_io.save_state(tmp, "scheduler", self.scheduler.state_dict())
            r.save(tmp / "recipe.yaml")
            tokens_per_step = self.order.global_batch * r.data.seq_len
            state = {"step": step, "tokens": step * tokens_per_step, "samples": step * self.order.global_batch,
                     "world_size": d.world, "fingerprint": self.fingerprint,
                     "data": data_position(self.order, step, r.data.seq_len)}
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        d.barrier()
        if d.main:
            state_io.write_manifest(tmp)  # last: a folder without it (or not matching it) is incomplete
            write_marker(tmp, "tlm train")
            publish(tmp, final)
            self._prune(list_checkpoints(self.out)[: -r.log.keep_last])
            logger.info("saved %s", final)
        d.barrier()
        return final

    def _save_final(self, final: Path) -> Path:
        weights = full_state_dict(self.model, self.recipe.train.parallel)
        if self.d.main:
            tmp = temp_dir(final)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            self._write_model(tmp, weights)
            self.recipe.save(tmp / "recipe.yaml")
            write_marker(tmp, "tlm train")
            publish(tmp, final)
        self.d.barrier()
        return final

    @staticmethod
    def _prune(old: list[Path]) -> None:
        """Delete the checkpoints beyond log.keep_last, each only when a run wrote all of it (a folder holding
        something else is kept, with a warning)."""
        for path in old:
            problem = replace_problem(path)
            if problem is None:
                shutil.rmtree(path, ignore_errors=True)
            else:
                warnings.warn(f"{path} was kept, not pruned: it {problem}", stacklevel=2)

    def _write_model(self, folder: Path, weights: dict) -> None:
        """The weights as a loadable TLM folder (config, safetensors, remote code, tokenizer)."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no "Writing model shards" bar inside the training bar
        export_model((self.config, {k: v.detach().cpu() for k, v in weights.items()}), folder, "tlm")
        self.tokenizer.save_pretrained(str(folder))

    def restore(self, path: Path) -> int:
        """Load checkpoint ``path`` (model, optimizer, scheduler, this rank's RNG) after checking that it belongs
        to this run; returns its step."""
        try:
            return self._restore(path)
        except StateError as err:
            raise TrainError(f"cannot resume from {path}: {err}; resume from an earlier {CHECKPOINT_PREFIX}<step> "
                             "folder") from None

    def _restore(self, path: Path) -> int:
        state = read_trainer_state(path)
        check_fingerprint(path, state.get("fingerprint", {}), self.fingerprint)
        check_recipe(path, self.recipe)
        check_data_position(path, state.get("data"), self.order)
        weights = read_weights(path)
        if self.recipe.train.parallel == "fsdp" and self.d.world > 1:
            load_full_state(self.model, self.optimizer, weights, state_io.load_state(path, "optimizer"))
        else:
            core = unwrap(self.model)
            missing, unexpected = core.load_state_dict(weights, strict=False)
            missing = [k for k in missing if not (core.config.tie_word_embeddings and k == "lm_head.weight")]
            if missing or unexpected:
                raise TrainError(f"checkpoint {path} weights do not match the model (missing {missing[:2]}, "
                                 f"unexpected {unexpected[:2]}); start a new output_dir")
            self.optimizer.load_state_dict(state_io.load_state(path, "optimizer", map_location=self.d.device))
        self.scheduler.load_state_dict(state_io.load_state(path, "scheduler"))
        rng = f"rng_state_{self.d.rank}"
        if (path / f"{rng}.json").is_file() or (path / f"{rng}.pt").is_file():
            set_rng_state(state_io.load_state(path, rng))
        step = int(state["step"])
        logger.info("resumed from %s at step %d", path, step)
        return step


__all__ = ["check_own_files", "discard_new_folder", "CHECKPOINT_PREFIX", "FINAL_DIR", "STOP_FILE", "RESUMABLE", "CheckpointStore", "lock_run_folder",
           "temp_dir", "list_checkpoints", "checkpoint_problem", "state_problem", "check_replaceable", "newest_complete",
           "resume_path", "fingerprint",
           "check_fingerprint", "check_recipe", "data_position", "check_data_position", "read_trainer_state",
           "read_weights", "seed_everything", "rng_state", "set_rng_state"]
