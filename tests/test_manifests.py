"""A checkpoint reads nothing outside itself, and state that cannot be true is damage (issues 25 and 53).

Every name a checkpoint's manifest.json lists is confined to the checkpoint folder (relative, no ``..``, no
symbolic link, a regular file) and read only up to its recorded size; a manifest of the wrong shape, a checkpoint
folder that is a link and a trainer_state.json that contradicts its own recipe.yaml mark the checkpoint damaged,
and ``--resume`` falls back to the previous complete one. A resume that changes the run is refused; a damaged
metrics line is named, a damaged run summary or token-cache manifest is rebuilt.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from hostile_helpers import listing, resume, sparse, trained, trained6  # noqa: F401 - fixtures
from test_faults import _one_error_line, _tiny_recipe, _tlm, _write_recipe

from tlm_io.errors import TrainError
from tlm_train import state_io
from tlm_train.checkpoints import checkpoint_problem, newest_complete
# ============================================================================ resume


def test_resume_with_a_changed_non_shape_setting_is_refused(tmp_path):
    path = _write_recipe(tmp_path, _tiny_recipe(tmp_path, train={"max_steps": 3}))
    assert _tlm(["train", path, "--no-progress"]).exit_code == 0
    before = listing(tmp_path / "run")
    changed = _tiny_recipe(tmp_path, train={"max_steps": 6}, optim={"lr": 1e-2})
    changed["model"]["config"]["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, changed), "--no-progress", "--resume"]))
    assert "different recipe" in line and "optim.lr" in line and "model.config.rope_parameters" in line, line
    assert "train.max_steps" not in line  # what a resume may change
    after = listing(tmp_path / "run")
    assert {k: v for k, v in after.items() if k != "recipe.yaml"} == {k: v for k, v in before.items()
                                                                       if k != "recipe.yaml"}


def test_a_damaged_metrics_line_is_named_on_resume(trained, tmp_path):
    shutil.copytree(trained, tmp_path / "copy")
    with open(tmp_path / "copy" / "metrics.jsonl", "a") as f:
        f.write("garbage{\n")
    line = _one_error_line(resume(tmp_path / "copy", tmp_path))
    assert "metrics.jsonl line" in line and "not a metrics record" in line, line


def test_a_damaged_run_summary_does_not_block_a_resume(trained, tmp_path):
    shutil.copytree(trained, tmp_path / "copy")
    (tmp_path / "copy" / "run_summary.json").write_text("[1, 2]")
    res = resume(tmp_path / "copy", tmp_path)
    assert res.exit_code == 0 and "run_summary.json was damaged" in res.output, res.output
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    assert summary["steps"] == 4 and len(summary["invocation_seconds"]) == 1


def test_a_damaged_token_cache_manifest_is_rebuilt(tmp_path):
    recipe = _tiny_recipe(tmp_path, train={"max_steps": 2})
    assert _tlm(["tokenize", _write_recipe(tmp_path, recipe)]).exit_code == 0
    (manifest,) = (tmp_path / "cache").glob("*/manifest.json")
    manifest.write_text("garbage{")
    res = _tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert json.loads(manifest.read_text())["complete"] is True



# ============================================================================ a manifest stays inside its checkpoint


@pytest.fixture
def run(trained6, tmp_path) -> Path:
    """A copy of a 6-step run (checkpoint-3, checkpoint-6, final/) whose checkpoint-6 a test damages."""
    return Path(shutil.copytree(trained6, tmp_path / "copy", symlinks=True))


def _manifest(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "manifest.json").read_text())


def _write_manifest(checkpoint: Path, manifest: dict) -> None:
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def _list_extra(checkpoint: Path, name: str, size: int = 5) -> None:
    """Add ``name`` to the manifest, with a size and a checksum (as an attacker re-hashing it would)."""
    manifest = _manifest(checkpoint)
    manifest["files"][name] = {"size": size, "sha256": "0" * 64}
    _write_manifest(checkpoint, manifest)


def _falls_back(run: Path, tmp_path: Path, why: str) -> None:
    """checkpoint-6 is judged damaged for ``why``; the newest complete checkpoint is checkpoint-3."""
    problem = checkpoint_problem(run / "checkpoint-6")
    assert problem is not None and why in problem, problem
    with pytest.warns(UserWarning, match="checkpoint-6 is incomplete or damaged .*resuming from checkpoint-3"):
        assert newest_complete([run / "checkpoint-3", run / "checkpoint-6"]) == run / "checkpoint-3"


@pytest.mark.parametrize("name", ["../../secret.txt", "/etc/hostname", "sub/../../secret.txt"])
def test_a_manifest_entry_outside_the_checkpoint_is_never_opened(run, tmp_path, name):
    """Issue case: `../../x` and absolute paths were stat'ed and hashed, their sizes told in the warning."""
    (tmp_path / "secret.txt").write_text("not the run's" * 1000)
    _list_extra(run / "checkpoint-6", name, size=13000)
    _falls_back(run, tmp_path, f"manifest.json names {name!r}, outside the checkpoint folder")


def test_a_resume_from_a_manifest_that_reaches_outside_falls_back_end_to_end(run, tmp_path):
    (tmp_path / "secret.txt").write_text("x" * 4321)
    _list_extra(run / "checkpoint-6", "../../secret.txt", size=4321)
    res = resume(run, tmp_path, 5)
    assert res.exit_code == 0, res.output
    assert "outside the checkpoint folder); resuming from checkpoint-3 instead" in res.output, res.output
    assert "4321" not in res.output and (tmp_path / "run" / "checkpoint-5").is_dir()


def test_a_manifest_entry_naming_a_fifo_never_blocks_the_resume(run, tmp_path):
    """Issue case: an entry naming a FIFO blocked the resume forever."""
    import threading

    run = Path(shutil.copytree(run, tmp_path / "run"))
    os.mkfifo(run / "checkpoint-6" / "pipe")
    _list_extra(run / "checkpoint-6", "pipe", size=0)  # a size that matches: only opening it would tell
    found = []
    judge = threading.Thread(target=lambda: found.append(checkpoint_problem(run / "checkpoint-6")), daemon=True)
    judge.start()
    judge.join(timeout=30)  # opening the FIFO would wait for a writer forever
    assert found and "pipe is not a regular file" in found[0], found
    res = resume(run, tmp_path, 5)
    assert res.exit_code == 0, res.output
    assert "pipe is not a regular file (a folder, pipe or device)" in res.output, res.output


@pytest.mark.parametrize("files", [["model.safetensors"], {"model.safetensors": "big"},
                                   {"model.safetensors": {"size": "83568", "sha256": "0" * 64}},
                                   {"model.safetensors": {"size": -1, "sha256": "0" * 64}}],
                         ids=["list", "entry-a-string", "size-a-string", "size-negative"])
def test_a_manifest_of_the_wrong_shape_is_damage_not_an_internal_error(run, tmp_path, files):
    """Issue case: a manifest entry of the wrong type was an "internal error"."""
    _write_manifest(run / "checkpoint-6", {"format": 2, "files": files})
    _falls_back(run, tmp_path, "manifest.json is malformed")


def test_a_manifest_entry_that_is_a_link_is_damage(run, tmp_path):
    """A link inside the checkpoint, even to one of its own files: a checkpoint never holds one."""
    ckpt = run / "checkpoint-6"
    (ckpt / "optimizer.safetensors").unlink()
    (ckpt / "optimizer.safetensors").symlink_to(run / "checkpoint-3" / "optimizer.safetensors")
    _falls_back(run, tmp_path, "optimizer.safetensors is a symbolic link, which a checkpoint never holds")


def test_a_manifest_that_is_a_link_is_damage(run, tmp_path):
    ckpt = run / "checkpoint-6"
    shutil.copy(ckpt / "manifest.json", tmp_path / "elsewhere.json")
    (ckpt / "manifest.json").unlink()
    (ckpt / "manifest.json").symlink_to(tmp_path / "elsewhere.json")
    _falls_back(run, tmp_path, "manifest.json is a symbolic link")


def test_a_giant_manifest_is_not_read(run, tmp_path):
    sparse(run / "checkpoint-6" / "manifest.json", 40 << 20, b'{"format": 2, "files": {')
    _falls_back(run, tmp_path, "manifest.json' is 40.0 MiB, more than the 16.0 MiB such a file can take")


def test_a_checkpoint_folder_that_is_a_link_is_damage(run, tmp_path, trained6):
    """checkpoint-6 replaced by a link to another run's checkpoint: never followed."""
    shutil.rmtree(run / "checkpoint-6")
    (run / "checkpoint-6").symlink_to(trained6 / "checkpoint-6")
    _falls_back(run, tmp_path, "the checkpoint folder is a symbolic link")


def test_a_trainer_state_that_is_a_fifo_is_damage(run, tmp_path):
    (run / "checkpoint-6" / "trainer_state.json").unlink()
    os.mkfifo(run / "checkpoint-6" / "trainer_state.json")
    _falls_back(run, tmp_path, "trainer_state.json is not a regular file")


def test_a_weights_file_added_beside_the_manifest_is_never_loaded(run, tmp_path):
    """A resume loads what the manifest lists: an added (here unreadable) .safetensors file is not read."""
    (run / "checkpoint-6" / "extra.safetensors").write_bytes(b"\xff" * 64)
    res = resume(run, tmp_path, 7)
    assert res.exit_code == 0 and "extra.safetensors" not in res.output, res.output


def test_resume_path_to_a_checkpoint_reaching_outside_is_one_line(run, tmp_path):
    _list_extra(run / "checkpoint-6", "/etc/hostname")
    shutil.copytree(run, tmp_path / "run", symlinks=True)
    recipe = _tiny_recipe(tmp_path, train={"max_steps": 7})
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress", "--resume",
                                 tmp_path / "run" / "checkpoint-6"]))
    assert "the checkpoint is incomplete or damaged (manifest.json names '/etc/hostname', outside" in line, line


# ============================================================================ state that cannot be true


def _tamper_state(checkpoint: Path, **changes) -> None:
    """Change trainer_state.json and re-hash the manifest (a tamperer who knows the format)."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    for key, value in changes.items():
        section, _, name = key.partition("__")
        if name:
            state[section][name] = value
        else:
            state[key] = value
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    (checkpoint / "manifest.json").unlink()
    state_io.write_manifest(checkpoint)


def test_a_step_beyond_max_steps_is_damage(run, tmp_path):
    """Issue case: a re-hashed trainer_state.json with a step far beyond max_steps was accepted and reported an
    absurd token count."""
    _tamper_state(run / "checkpoint-6", step=10**12, tokens=10**12 * 132, samples=4 * 10**12)
    (run / "checkpoint-6").rename(run / "checkpoint-1000000000000")
    problem = checkpoint_problem(run / "checkpoint-1000000000000")
    assert "says step 1,000,000,000,000, beyond the train.max_steps 6 of its recipe.yaml" in problem, problem
    res = resume(run, tmp_path, 5)
    assert res.exit_code == 0 and "resuming from checkpoint-3 instead" in res.output, res.output
    assert json.loads(res.output.strip().splitlines()[-1])["tokens"] == 5 * 4 * 33


@pytest.mark.parametrize("changes, why", [({"tokens": 10**9}, "tokens is 1000000000, not the 792"),
                                          ({"samples": 7}, "samples is 7, not the 24"),
                                          ({"world_size": 8}, "world_size is 8, not the 1"),
                                          ({"data__samples": 0}, "data.samples is 0, not the 24"),
                                          ({"step": 5}, "says step 5, its folder checkpoint-6"),
                                          ({"step": "6"}, "has no step")],
                         ids=["tokens", "samples", "world-size", "data-position", "step-vs-folder", "step-a-string"])
def test_counters_that_disagree_are_damage(run, tmp_path, changes, why):
    _tamper_state(run / "checkpoint-6", **changes)
    _falls_back(run, tmp_path, why)


def test_an_oversized_optimizer_state_is_refused_not_read(run, tmp_path):
    """The JSON half of a state is read within 64 MiB, also when the manifest was re-hashed to match it."""
    sparse(run / "checkpoint-6" / "optimizer.json", 65 << 20, b'{"format": 2, "state": "')
    (run / "checkpoint-6" / "manifest.json").unlink()
    state_io.write_manifest(run / "checkpoint-6")
    shutil.copytree(run, tmp_path / "run", symlinks=True)
    recipe = _tiny_recipe(tmp_path, train={"max_steps": 7})
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress", "--resume"]))
    assert "cannot resume from" in line and "optimizer.json' is 65.0 MiB, more than the 64.0 MiB" in line, line


def test_a_damaged_checkpoint_is_damage_with_every_other_checkpoint_damaged_too(run):
    """No complete checkpoint at all: one line listing each, not an internal error."""
    for ckpt in ("checkpoint-3", "checkpoint-6"):
        _list_extra(run / ckpt, "../x")
    with pytest.raises(TrainError, match="no complete checkpoint .*checkpoint-6: manifest.json names '../x'"):
        newest_complete([run / "checkpoint-3", run / "checkpoint-6"])


def test_a_file_is_hashed_only_up_to_its_recorded_size():
    """What a manifest check reads of a file is bounded by the size recorded for it (a file that grows while it is
    read is not read to its end)."""
    import hashlib
    import tempfile

    with tempfile.NamedTemporaryFile() as f:
        f.write(b"0123456789" * 1000)
        f.flush()
        assert state_io.sha256(Path(f.name), block=7, limit=4) == hashlib.sha256(b"01234").hexdigest()
        assert state_io.sha256(Path(f.name)) == hashlib.sha256(b"0123456789" * 1000).hexdigest()


def test_a_resume_with_a_lower_max_steps_leaves_its_checkpoint_as_it_was(run, tmp_path):
    """Resumed at or beyond train.max_steps, a run takes no step and does not write its checkpoint again (with a
    recipe.yaml whose max_steps is below its step, which the next resume would call damaged)."""
    before = listing(run / "checkpoint-6")
    for _ in range(2):
        res = resume(run, tmp_path, 4)
        assert res.exit_code == 0 and "damaged" not in res.output, res.output
        assert json.loads(res.output.strip().splitlines()[-1])["steps"] == 6
        run = tmp_path / "run"
    assert listing(run / "checkpoint-6") == before
