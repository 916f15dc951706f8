"""What a command writes, replaces and deletes is its own (issues 25 and 53): each case a tiny, fast, offline test.

Every output folder holds a ``.tapered-lm`` marker listing what it wrote. ``tlm-convert --overwrite`` replaces only
such a folder (or an earlier version's output, recognised by what it always held), never a user's folder, a folder
with a file added, a training output_dir or a symbolic link; a training run prunes and replaces only its own
checkpoints; ``tlm analyze`` and ``tlm compare`` replace only their own report files. A training output_dir is
refused unless new, empty or a previous run's; clean-up touches exact names only; locks follow no symlink and two
names of one folder share one lock.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from hostile_helpers import listing, resume, source, trained, trained6  # noqa: F401 - fixtures
from test_faults import FAST, _convert, _one_error_line, _tiny_recipe, _tlm, _write_recipe
from tiny_sources import DATA

from tlm_io.errors import ConversionError
from tlm_io.outputs import MARKER, OutputLock, clean_stale, clean_stale_in, publish, read_marker
# ============================================================================ a training folder owns what it wrote


def _users_folder(folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".notes.tmp").write_text("my notes")
    (folder / ".cache.tmp-abc").mkdir()
    (folder / ".cache.tmp-abc" / "x").write_text("cached")
    (folder / ".build.old").mkdir()
    (folder / ".env.old").write_text("SECRET=1")
    return listing(folder)


def test_train_refuses_a_users_folder_and_touches_nothing_in_it(tmp_path):
    before = _users_folder(tmp_path / "mine")
    path = _write_recipe(tmp_path, _tiny_recipe(tmp_path, "mine"))
    line = _one_error_line(_tlm(["train", path, "--no-progress"]))
    assert "holds files a run did not write" in line and "output_dir" in line, line
    assert listing(tmp_path / "mine") == before


def test_train_refuses_the_recipes_own_folder(tmp_path):
    recipe = tmp_path / "proj"
    recipe.mkdir()
    path = _write_recipe(recipe, _tiny_recipe(tmp_path, "proj"), name="recipe.yaml")
    before = path.read_bytes()
    line = _one_error_line(_tlm(["train", path, "--no-progress"]))
    assert "folder of the recipe" in line, line
    assert path.read_bytes() == before and sorted(p.name for p in recipe.iterdir()) == ["recipe.yaml"]


@pytest.mark.parametrize("where", ["/", "~"])
def test_train_refuses_root_and_home(tmp_path, where, monkeypatch):
    if where == "~":
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        (tmp_path / "home").mkdir()
    recipe = _tiny_recipe(tmp_path)
    recipe["output_dir"] = os.path.expanduser(where)
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress"]))
    assert "never writes into" in line, line
    if where == "~":
        assert sorted(p.name for p in (tmp_path / "home").iterdir()) == []


def test_training_clean_up_removes_only_its_own_stale_entries(tmp_path):
    before = _users_folder(tmp_path)
    (tmp_path / ".checkpoint-3.tmp-train").mkdir()  # a run killed while saving checkpoint-3
    (tmp_path / ".final.old-77").mkdir()  # ... or between the two renames of final/
    (tmp_path / ".final.old-77" / "config.json").write_text("{}")
    (tmp_path / ".checkpoint-4.tmp-train").write_text("a file, not what a run leaves")
    found = clean_stale_in(tmp_path, r"checkpoint-\d+|final")
    assert sorted(p.name for p in found) == [".checkpoint-3.tmp-train", ".final.old-77"]
    assert (tmp_path / "final" / "config.json").is_file()
    after = listing(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before
    assert (tmp_path / ".checkpoint-4.tmp-train").is_file()


def test_convert_clean_up_leaves_a_users_look_alike_file(tmp_path):
    (tmp_path / ".out.tmp-notes").write_text("mine")  # a file: a run only ever leaves folders
    (tmp_path / ".out.old-env").mkdir()  # not a pid
    clean_stale(tmp_path / "out")
    assert (tmp_path / ".out.tmp-notes").read_text() == "mine" and (tmp_path / ".out.old-env").is_dir()
    assert not (tmp_path / "out").exists()


def test_a_previous_run_is_still_resumable(tmp_path):
    path = _write_recipe(tmp_path, _tiny_recipe(tmp_path, train={"max_steps": 3}))
    assert _tlm(["train", path, "--no-progress"]).exit_code == 0
    (tmp_path / "run" / "my-notes.txt").write_text("the folder is ours now; a user file inside is left alone")
    path = _write_recipe(tmp_path, _tiny_recipe(tmp_path, train={"max_steps": 6}))
    res = _tlm(["train", path, "--no-progress", "--resume"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "run" / "my-notes.txt").is_file() and (tmp_path / "run" / MARKER).is_file()


@pytest.mark.parametrize("name", ["metrics.jsonl", "recipe.yaml", "run_summary.json", "tensorboard"])
def test_a_run_never_writes_through_a_link_in_its_folder(trained, tmp_path, name):
    precious = tmp_path / "precious.txt"
    precious.write_text('{"step": 1, "mine": true}\n{"step": 99, "mine": true}\n')
    before = precious.read_bytes()
    shutil.copytree(trained, tmp_path / "copy")
    (tmp_path / "copy" / name).unlink(missing_ok=True)
    (tmp_path / "copy" / name).symlink_to(precious)
    line = _one_error_line(resume(tmp_path / "copy", tmp_path))
    assert f"{name} is a symbolic link" in line and "output_dir" in line, line
    assert precious.read_bytes() == before


def test_a_run_never_writes_into_a_pipe_in_its_folder(trained, tmp_path):
    run = Path(shutil.copytree(trained, tmp_path / "run"))
    (run / "metrics.jsonl").unlink()
    os.mkfifo(run / "metrics.jsonl")
    line = _one_error_line(resume(run, tmp_path))
    assert "metrics.jsonl is not a plain file, which a run never writes through" in line, line


def test_a_failed_start_leaves_no_new_folder(tmp_path):
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, _tiny_recipe(tmp_path)), "--no-progress",
                                 "--resume"]))
    assert "no checkpoint" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


# ============================================================================ locks


def test_a_lock_file_symlink_is_never_followed(source, tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("do not touch")
    (tmp_path / ".out.lock").symlink_to(precious)
    line = _one_error_line(_convert([source, "-o", tmp_path / "out"]))
    assert "symbolic link" in line and ".out.lock" in line, line
    assert precious.read_text() == "do not touch" and (tmp_path / ".out.lock").is_symlink()


def test_a_hard_linked_lock_file_is_not_truncated(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("do not touch")
    os.link(precious, tmp_path / ".out.lock")
    with pytest.raises(ConversionError, match="hard links"):
        OutputLock(tmp_path / "out").acquire()
    assert precious.read_text() == "do not touch"


def test_two_names_of_one_folder_share_one_lock(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    with OutputLock(tmp_path / "real" / "out"):
        with pytest.raises(ConversionError, match="being written by another run"):
            OutputLock(tmp_path / "alias" / "out").acquire()
        with pytest.raises(ConversionError, match="being written by another run"):
            OutputLock(tmp_path / "real" / "x" / ".." / "out").acquire()


def test_a_lock_that_cannot_be_created_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConversionError, match="does not take new files .*lock file .* choose another -o"):
        OutputLock(tmp_path / "file" / "sub" / "out").acquire()


# ============================================================================ output paths


def test_export_onto_an_existing_folder_names_no_option_it_lacks(source, tmp_path):
    (tmp_path / "out").mkdir()
    line = _one_error_line(_tlm(["export", source, "--to", "tlm", "-o", tmp_path / "out"]))
    assert "already exists" in line and "--overwrite" not in line and "choose another -o" in line, line


def test_analyze_into_a_folder_under_a_file_fails_before_the_model_is_loaded(source, tmp_path, monkeypatch):
    import tlm_cli.main

    monkeypatch.setattr(tlm_cli.main, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "file").write_text("x")
    line = _one_error_line(_tlm(["analyze", source, "--data", str(DATA), "-o", tmp_path / "file" / "sub"]))
    assert "is a file, not a folder" in line and "choose another -o" in line, line


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
def test_an_output_where_no_file_can_be_created_names_the_option(source):
    line = _one_error_line(_convert([source, "-o", "/proc/x", *FAST]))
    assert "cannot write /proc/x: its folder '/proc' does not take new files" in line and "another -o" in line, line


def test_an_empty_output_option_is_named(source, tmp_path):
    line = _one_error_line(_convert([source, "-o", "", *FAST]))
    assert "option -o is empty" in line, line



# ============================================================================ --overwrite replaces only our own output


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory) -> Path:
    """A finished conversion of ``source`` (copied by the tests that overwrite it)."""
    out = tmp_path_factory.mktemp("converted") / "out"
    res = _convert([source, "-o", out, *FAST])
    assert res.exit_code == 0, res.output
    return out


def _overwrite(source: Path, out: Path):
    return _convert([source, "-o", out, *FAST, "--overwrite"])


def test_overwrite_never_deletes_a_users_folder(source, tmp_path, monkeypatch):
    """The issue's data loss: `tlm-convert SRC -o MY_FOLDER --overwrite` deleted the user's files and exited 0.
    Refused before the source is loaded."""
    import tlm_convert.convert

    monkeypatch.setattr(tlm_convert.convert, "load_source", lambda *a, **k: pytest.fail("the source was loaded"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("four years of work")
    (mine / "config.json").write_text("{}")  # even with a name an output has
    before = listing(mine)
    line = _one_error_line(_overwrite(source, mine))
    assert f"output {mine} was not written by tapered-lm (it has no .tapered-lm marker)" in line, line
    assert "--overwrite replaces only a folder tapered-lm wrote: move it away or choose another -o" in line, line
    assert listing(mine) == before and sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_every_output_is_marked_and_overwrite_replaces_it(source, converted, tmp_path):
    marker = read_marker(converted)
    assert marker["tool"] == "tlm-convert" and marker["kind"] == "output" and marker["version"]
    assert sorted(marker["files"]) == sorted(p.name for p in converted.iterdir() if p.name != MARKER)
    assert len((converted / MARKER).read_bytes()) < 2048  # tiny
    out = Path(shutil.copytree(converted, tmp_path / "out"))
    (out / "model.safetensors").write_bytes(b"stale")  # our own file, changed: still ours
    res = _overwrite(source, out)
    assert res.exit_code == 0, res.output
    assert (out / "model.safetensors").stat().st_size > 5 and read_marker(out)["tool"] == "tlm-convert"


def test_overwrite_refuses_an_output_with_a_file_added(source, converted, tmp_path):
    out = Path(shutil.copytree(converted, tmp_path / "out"))
    (out / "my-eval-notes.md").write_text("results I wrote down")
    before = listing(out)
    line = _one_error_line(_overwrite(source, out))
    assert "holds files tapered-lm did not write there (my-eval-notes.md)" in line and "move it away" in line, line
    assert listing(out) == before


@pytest.mark.parametrize("kind", ["tlm", "healed", "gguf"])
def test_overwrite_recognises_an_output_of_an_earlier_version(source, converted, tmp_path, kind):
    """No marker (written before it existed): conversion_report.json beside config.json (or model.gguf) and only
    such files (a healed one's heal/ log folder included)."""
    out = Path(shutil.copytree(converted, tmp_path / "out"))
    (out / MARKER).unlink()
    if kind == "healed":
        (out / "heal").mkdir()
        (out / "heal" / "metrics.jsonl").write_text('{"step": 1}\n')
    elif kind == "gguf":
        for file in out.glob("*.*"):
            if file.name not in ("conversion_report.json", "report.md", "widths.png"):
                file.unlink()
        (out / "model.gguf").write_bytes(b"GGUF")
    res = _overwrite(source, out)
    assert res.exit_code == 0, res.output
    assert read_marker(out)["tool"] == "tlm-convert"


@pytest.mark.parametrize("stranger", ["folder", "link", "notes", "notes-in-heal"])
def test_overwrite_refuses_an_earlier_versions_output_with_a_stranger_inside(source, converted, tmp_path, stranger):
    out = Path(shutil.copytree(converted, tmp_path / "out"))
    (out / MARKER).unlink()
    if stranger == "folder":
        (out / "runs").mkdir()
    elif stranger == "notes-in-heal":
        (out / "heal").mkdir()
        (out / "heal" / "notes.txt").write_text("mine")
    elif stranger == "link":
        (out / "tokenizer.model").symlink_to(tmp_path)
    else:
        (out / "notes.txt").write_text("mine")
    before = listing(out)
    line = _one_error_line(_overwrite(source, out))
    assert "has no .tapered-lm marker (an earlier version's output?) and holds what no tapered-lm output holds" in line
    assert listing(out) == before


@pytest.mark.parametrize("marker", ["legacy", "current"])
def test_overwrite_never_replaces_a_training_run(source, trained, tmp_path, marker):
    run = Path(shutil.copytree(trained, tmp_path / "run"))
    if marker == "legacy":  # the .tlm-run of earlier versions
        (run / MARKER).rename(run / ".tlm-run")
    before = listing(run)
    line = _one_error_line(_overwrite(source, run))
    assert "is a training run's output_dir (checkpoints, metrics), which is never replaced whole" in line, line
    assert listing(run) == before


def _forge(out: Path, how: str) -> None:
    (out / MARKER).unlink()
    if how == "link":
        (out / MARKER).symlink_to(out / "conversion_report.json")
    elif how == "fifo":
        os.mkfifo(out / MARKER)
    elif how == "garbage":
        (out / MARKER).write_text('{"files": ')
    else:  # a marker whose files are not a list
        (out / MARKER).write_text(json.dumps({"tool": "x", "files": "everything"}))
    (out / "conversion_report.json").unlink()  # not an earlier version's output either


@pytest.mark.parametrize("how", ["link", "fifo", "garbage", "files-not-a-list"])
def test_a_forged_marker_counts_as_none(source, converted, tmp_path, how):
    """A marker is trusted only as we write it: a link, a FIFO (never opened: no hang), malformed JSON."""
    out = Path(shutil.copytree(converted, tmp_path / "out"))
    _forge(out, how)
    line = _one_error_line(_overwrite(source, out))
    assert f"output {out} was not written by tapered-lm" in line, line
    assert (out / "model.safetensors").is_file()


def test_an_output_that_is_a_link_is_refused_and_kept(source, converted, tmp_path):
    out = Path(shutil.copytree(converted, tmp_path / "real"))
    (tmp_path / "link").symlink_to(out)
    before = listing(out)
    line = _one_error_line(_overwrite(source, tmp_path / "link"))
    assert "is a symbolic link to" in line and f"pass -o '{out}' itself" in line, line
    assert (tmp_path / "link").is_symlink() and listing(out) == before


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_dangling_output_link_is_named_as_one(source, tmp_path, overwrite):
    """Issue case: a dangling symlink given as -o was called "exists and is not a folder"."""
    (tmp_path / "out").symlink_to(tmp_path / "nowhere")
    res = _convert([source, "-o", tmp_path / "out", *FAST, *(["--overwrite"] if overwrite else [])])
    line = _one_error_line(res)
    assert f"is a symbolic link to '{tmp_path / 'nowhere'}', which does not exist; remove the link" in line, line
    assert (tmp_path / "out").is_symlink() and not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("where", ["out", "loop/out"])
def test_a_symlink_loop_on_the_output_path_is_named(source, tmp_path, where):
    """Issue case: a symlink loop under -o was an "internal error: RuntimeError"."""
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    out = tmp_path / where if where != "out" else tmp_path / "loop"
    line = _one_error_line(_convert([source, "-o", out, *FAST]))
    assert "internal error" not in line and "loops" in line, line


def test_a_dangling_link_above_the_output_is_named(source, tmp_path):
    (tmp_path / "models").symlink_to(tmp_path / "unmounted-disk")
    line = _one_error_line(_convert([source, "-o", tmp_path / "models" / "out", *FAST]))
    assert f"'{tmp_path / 'models'}' is a symbolic link to" in line and "which does not exist" in line, line
    assert not (tmp_path / "unmounted-disk").exists()


def test_a_conversion_is_not_a_training_output_dir(converted, tmp_path):
    out = Path(shutil.copytree(converted, tmp_path / "out"))
    before = listing(out)
    recipe = _tiny_recipe(tmp_path, "out")
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress"]))
    assert "is the output of tlm-convert, not a training run's folder" in line, line
    assert listing(out) == before


def test_an_export_is_marked_and_a_conversion_may_replace_it(source, tmp_path):
    res = _tlm(["export", source, "--to", "tlm", "-o", tmp_path / "out"])
    assert res.exit_code == 0, res.output
    assert read_marker(tmp_path / "out")["tool"] == "tlm export"
    res = _overwrite(source, tmp_path / "out")
    assert res.exit_code == 0, res.output


def test_publish_checks_the_output_again_before_the_swap(tmp_path):
    """A file added to OUTPUT while the run worked (after the check at its start) stops the swap."""
    out, new = tmp_path / "out", tmp_path / ".out.tmp-1"
    for folder in (out, new):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    (out / MARKER).write_text(json.dumps({"tool": "tlm-convert", "kind": "output", "files": ["config.json"]}))
    (out / "added-meanwhile.txt").write_text("mine")
    with pytest.raises(ConversionError, match="holds files tapered-lm did not write there .added-meanwhile.txt."):
        publish(new, out)
    assert (out / "added-meanwhile.txt").read_text() == "mine" and new.is_dir()


# ============================================================================ a run prunes and replaces only its own


def test_a_checkpoint_holding_a_users_file_is_kept_not_pruned(trained, tmp_path):
    (notes := tmp_path / "notes.txt").write_text("mine")
    shutil.copytree(trained, tmp_path / "copy")
    shutil.copy(notes, tmp_path / "copy" / "checkpoint-3" / "notes.txt")
    res = resume(tmp_path / "copy", tmp_path, 6, "--set", "log.keep_last=1")
    assert res.exit_code == 0, res.output
    assert "checkpoint-3 was kept, not pruned: it holds files tapered-lm did not write there (notes.txt)" in res.output
    assert (tmp_path / "run" / "checkpoint-3" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "run" / "checkpoint-6").is_dir()


def test_a_resume_that_would_replace_a_foreign_final_is_refused_before_it_starts(trained, tmp_path):
    shutil.copytree(trained, tmp_path / "copy")
    (tmp_path / "copy" / "final" / "eval.json").write_text('{"mine": 1}')
    before = listing(tmp_path / "copy")
    line = _one_error_line(resume(tmp_path / "copy", tmp_path, 6))
    assert "final holds files tapered-lm did not write there (eval.json)" in line, line
    assert "a run resumed from checkpoint-3 replaces it" in line, line
    assert listing(tmp_path / "run") == before


def test_a_resume_that_would_replace_a_later_checkpoint_with_a_users_file_is_refused(trained6, tmp_path):
    shutil.copytree(trained6, tmp_path / "copy")
    (tmp_path / "copy" / "checkpoint-6" / "notes.txt").write_text("mine")
    before = listing(tmp_path / "copy")
    line = _one_error_line(resume(tmp_path / "copy", tmp_path, 6, tmp_path / "run" / "checkpoint-3"))
    assert "checkpoint-6 holds files tapered-lm did not write there (notes.txt)" in line, line
    assert listing(tmp_path / "run") == before


def test_checkpoints_and_final_of_an_earlier_version_are_still_pruned_and_replaced(trained, tmp_path):
    """Written before the marker: a checkpoint (trainer_state.json + manifest.json) and final/ (recipe.yaml +
    config.json) holding only such files are a run's own."""
    shutil.copytree(trained, tmp_path / "copy")
    for folder in ("checkpoint-3", "final"):
        (tmp_path / "copy" / folder / MARKER).unlink()
    res = resume(tmp_path / "copy", tmp_path, 6, "--set", "log.keep_last=1")
    assert res.exit_code == 0 and "kept" not in res.output, res.output
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-6"]
    assert read_marker(tmp_path / "run" / "final")["tool"] == "tlm train"


def test_a_run_folder_of_an_earlier_version_is_still_resumable(trained, tmp_path):
    shutil.copytree(trained, tmp_path / "copy")
    (tmp_path / "copy" / MARKER).rename(tmp_path / "copy" / ".tlm-run")
    res = resume(tmp_path / "copy", tmp_path, 4)
    assert res.exit_code == 0, res.output
    assert read_marker(tmp_path / "run")["kind"] == "run"


# ============================================================================ report files of analyze and compare


def _analyze(source, out):
    return _tlm(["analyze", source, "--data", str(DATA), "--seq-len", "32", "--max-tokens", "128", "-o", out])


def test_analyze_never_replaces_a_users_alignment_json(source, tmp_path, monkeypatch):
    import tlm_cli.main

    (tmp_path / "alignment.json").write_text('{"my": "own analysis"}')
    monkeypatch.setattr(tlm_cli.main, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    line = _one_error_line(_analyze(source, tmp_path))
    assert f"{tmp_path / 'alignment.json'} exists and was not written by tapered-lm" in line, line
    assert (tmp_path / "alignment.json").read_text() == '{"my": "own analysis"}'


def test_analyze_replaces_its_own_report_but_does_not_claim_the_folder(source, tmp_path):
    (tmp_path / "thesis.tex").write_text("mine")
    for _ in range(2):
        res = _analyze(source, tmp_path)
        assert res.exit_code == 0, res.output
    assert sorted(read_marker(tmp_path)["files"]) == ["alignment.json", "alignment.png"]
    line = _one_error_line(_overwrite(source, tmp_path))  # the folder still holds the user's file
    assert "holds files tapered-lm did not write there (thesis.tex)" in line, line


def test_analyze_replaces_an_earlier_versions_report(source, tmp_path):
    """No marker, but an alignment.json with the keys tlm analyze writes: an earlier version's report."""
    (tmp_path / "alignment.json").write_text(json.dumps({"num_layers": 4, "h": {}, "z": {}}))
    (tmp_path / "alignment.png").write_bytes(b"old plot")
    res = _analyze(source, tmp_path)
    assert res.exit_code == 0, res.output
    assert "model" in json.loads((tmp_path / "alignment.json").read_text())  # the new report
    assert (tmp_path / "alignment.png").read_bytes() != b"old plot"


@pytest.mark.parametrize("keys, allowed", [(("plan", "spec", "studies"), True), (("plan",), False)])
def test_an_earlier_compare_report_is_recognised_by_its_keys(tmp_path, keys, allowed):
    from tlm_io.outputs import check_files_owned

    (tmp_path / "compare.json").write_text(json.dumps({key: 1 for key in keys}))
    (tmp_path / "compare.md").write_text("| table |")
    check = lambda: check_files_owned(tmp_path, ["compare.json", "compare.md"], "output_dir",  # noqa: E731
                                      legacy=("compare.json", ("plan", "spec", "studies")))
    if allowed:
        check()
    else:
        with pytest.raises(ConversionError, match="compare.json exists and was not written by tapered-lm"):
            check()


def test_eval_writes_nothing(source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = listing(source)
    res = _tlm(["eval", source, "--data", str(DATA), "--seq-len", "32", "--max-tokens", "64"])
    assert res.exit_code == 0, res.output
    assert not list(tmp_path.iterdir()) and listing(source) == before


def test_compare_never_replaces_a_users_report(tmp_path):
    from test_compare import tiny_base

    out = tmp_path / "study"
    out.mkdir()
    (out / "compare.md").write_text("# my notes on the study")
    spec = {"base": tiny_base(tmp_path), "output_dir": str(out), "splits": ["3+2"], "rewarm_steps": 1}
    (tmp_path / "compare.yaml").write_text(yaml.safe_dump(spec))
    line = _one_error_line(_tlm(["compare", tmp_path / "compare.yaml", "--no-progress"]))
    assert f"{out / 'compare.md'} exists and was not written by tapered-lm" in line, line
    assert sorted(p.name for p in out.iterdir()) == ["compare.md"]  # no run was started


def test_a_write_error_while_saving_names_the_file(tmp_path):
    """Any OSError of the save phase (here permission denied) is one line naming the file, not a traceback."""
    from tlm_io.outputs import save_errors

    failed = tmp_path / ".out.tmp-x" / "model.safetensors"
    with pytest.raises(ConversionError, match=rf"cannot write {failed}: Permission denied; nothing was published"):
        with save_errors(tmp_path / "out"):
            raise PermissionError(13, "Permission denied", str(failed))
