"""What the hostile-input tests share (tests/test_outputs_owned.py, test_manifests.py, test_interrupts.py,
test_bad_files.py, test_absurd_sizes.py, test_model_fit.py): a tiny source, a finished tiny training run, and ways to
look at a folder, copy a source, damage a file and check a one-line refusal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_faults import FAST, _convert, _one_error_line, _tiny_recipe, _tlm, _write_recipe
from tiny_sources import make_source, tiny_tokenizer


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny llama folder with its tokenizer (read only: tests that change it copy it first)."""
    return make_source(tmp_path_factory.mktemp("hostile") / "llama", "llama", tokenizer=tiny_tokenizer())


def _finished_run(tmp_path_factory, steps: int) -> Path:
    tmp = tmp_path_factory.mktemp(f"hostile-run{steps}")
    res = _tlm(["train", _write_recipe(tmp, _tiny_recipe(tmp, train={"max_steps": steps})), "--no-progress"])
    assert res.exit_code == 0, res.output
    return tmp / "run"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 3-step run folder (checkpoint-3, final/), copied by the tests that resume it."""
    return _finished_run(tmp_path_factory, 3)


@pytest.fixture(scope="module")
def trained6(tmp_path_factory) -> Path:
    """A finished 6-step run folder (checkpoint-3, checkpoint-6, final/), copied by the tests that damage it."""
    return _finished_run(tmp_path_factory, 6)


def listing(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder`` with its bytes (None for a folder, a link or a special file)."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() and not p.is_symlink() else None)
            for p in sorted(folder.rglob("*"))}


def copy_source(source: Path, folder: Path) -> Path:
    return Path(shutil.copytree(source, folder, symlinks=True))


def with_config(source: Path, folder: Path, **fields) -> Path:
    """A copy of ``source`` whose config.json has ``fields`` changed."""
    copy_source(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))
    return folder


def sparse(path: Path, size: int, head: bytes = b"") -> None:
    """A file of ``size`` bytes that takes no disk space (a hole after ``head``)."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


def refused(source_dir: Path, tmp_path: Path, *extra) -> str:
    """The one error line of converting ``source_dir`` into tmp_path/out, which must not exist afterwards."""
    line = _one_error_line(_convert([source_dir, "-o", tmp_path / "out", *FAST, *extra]))
    assert "internal error" not in line, line
    assert not (tmp_path / "out").exists()
    return line


def resume(trained: Path, tmp_path: Path, steps: int = 4, *extra):
    """``tlm train --resume`` of a copy of ``trained`` (links kept) into tmp_path/run (``trained`` itself when it is
    that folder), to ``steps`` steps."""
    if Path(trained) != tmp_path / "run":
        shutil.copytree(trained, tmp_path / "run", symlinks=True)
    recipe = _tiny_recipe(tmp_path, train={"max_steps": steps})
    recipe["data"]["cache_dir"] = str(tmp_path / "cache")
    return _tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress", "--resume", *extra])


__all__ = ["copy_source", "listing", "refused", "resume", "source", "sparse", "trained", "trained6", "with_config"]
