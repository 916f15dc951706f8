"""Faults: the thirteen cases of issue 13, each kept as a regression test.

Nothing lost (an input never deleted or written into; an output replaced so that a kill at any point leaves the
old or the new one), nothing run (no pickle on resume, no custom tokenizer code without --trust-remote-code, even
when stdin says yes), no silent clash (a second run into a locked output is refused; a dead run's lock and temp
folders do not get in the way), clear failures (disk full, bad output paths found before the work, corrupt
checkpoints skipped or named, recipe typos under model.config), and a stopped training run that says so in its
exit status and prints a resume command that repeats its overrides.

Kills are real: SIGKILL of a forked child at each file-system step of a replace, SIGKILL/SIGTERM of subprocesses.
A full disk is a fault-injecting writer (the exact error safetensors raises on ENOSPC); no small file system is
needed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from test_train import tiny_recipe
from tiny_sources import DATA, make_source, tiny_tokenizer

from tlm_cli.convert import convert_main
from tlm_cli.main import tlm_main

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--calibration-data", str(DATA), "--calibration-tokens", "256", "--seq-len", "64", "--batch-size", "4",
        "--set", "multiple_of=1", "--set", "importance=activation"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT),
       "OMP_NUM_THREADS": "1"}


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def _convert(args, **kwargs):
    return CliRunner().invoke(convert_main, [str(a) for a in args], **kwargs)


def _one_error_line(result) -> str:
    text = result.output
    assert result.exit_code not in (0, None), text
    assert "Traceback" not in text, text
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, text
    return errors[0]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_source(tmp_path_factory.mktemp("faults") / "llama", "llama", tokenizer=tiny_tokenizer())


# ============================================================================ 1-2: the input is never touched


def test_overwrite_never_deletes_an_input_inside_the_output(source, tmp_path):
    """Case 1: `-o PARENT_OF_INPUT --overwrite` (also through a symlink) is refused before any work."""
    parent = tmp_path / "p"
    src = Path(shutil.copytree(source, parent / "in"))
    before = _digest(parent)
    (tmp_path / "link").symlink_to(parent)
    for out in (parent, tmp_path / "link", tmp_path):
        line = _one_error_line(_convert([src, "-o", out, *FAST, "--overwrite"]))
        assert "contains the input" in line, line
        assert _digest(parent) == before


def test_output_inside_the_input_is_refused(source, tmp_path):
    """Case 2: `-o INPUT/sub` would write into the input, which is never modified."""
    src = Path(shutil.copytree(source, tmp_path / "in"))
    before = _digest(src)
    line = _one_error_line(_convert([src, "-o", src / "sub", *FAST]))
    assert "inside the input" in line, line
    assert _digest(src) == before and not (src / "sub").exists()


# ============================================================================ 3: atomic replace, kill at every step


def _fake_output(folder: Path, tag: str, files: int = 4) -> dict:
    """An output of ours (its .tapered-lm marker lists its files) with ``files`` small files."""
    from tlm_io.outputs import write_marker

    folder.mkdir(parents=True)
    for i in range(files):
        (folder / f"f{i}.txt").write_text(f"{tag} {i}")
    write_marker(folder, "tlm-convert")
    return _digest(folder)


_FS_CALLS = ("rename", "replace", "unlink", "rmdir", "remove")


def _publish_killed_at(step: int, tmp: Path, out: Path) -> bool:
    """Fork a child that runs publish(tmp, out) and SIGKILLs itself just before its ``step``-th file-system call
    (rename/unlink/rmdir); True when it was killed, False when it finished first."""
    pid = os.fork()
    if pid == 0:  # the child: count the calls, die at the chosen one
        try:
            from tlm_io.outputs import publish

            count = [0]

            def counted(fn):
                def wrapper(*args, **kwargs):
                    count[0] += 1
                    if count[0] == step:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return fn(*args, **kwargs)
                return wrapper

            for name in _FS_CALLS:
                setattr(os, name, counted(getattr(os, name)))
            publish(tmp, out)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_a_kill_while_replacing_leaves_the_old_or_the_new_output(tmp_path, monkeypatch, exchange):
    """Case 3: at every kill point the path holds the complete old or the complete new output (with two renames,
    after the next run's clean-up, which puts a set-aside old output back); nothing stale is left."""
    if not exchange:
        monkeypatch.setenv("TLM_NO_RENAME_EXCHANGE", "1")
    step, outcomes = 0, set()
    while True:
        step += 1
        case = tmp_path / f"k{step}"
        out, tmp = case / "out", case / ".out.tmp-x"
        old, new = _fake_output(out, "old"), _fake_output(tmp, "new")
        killed = _publish_killed_at(step, tmp, out)
        if not exchange:
            from tlm_io.outputs import clean_stale

            clean_stale(out)  # what the next run does first, holding the lock
        assert out.is_dir() and _digest(out) in (old, new), f"kill at step {step}: {sorted(_digest(out))}"
        outcomes.add("old" if _digest(out) == old else "new")
        if not killed:
            assert _digest(out) == new
            break
        assert step < 50
    assert outcomes == {"old", "new"} if not exchange else "new" in outcomes


def test_stale_output_folders_are_cleaned_and_a_set_aside_output_restored(tmp_path):
    from tlm_io.outputs import clean_stale

    out = tmp_path / "out"
    old = _fake_output(tmp_path / ".out.old-123", "old")
    _fake_output(tmp_path / ".out.tmp-abc", "partial", files=2)
    _fake_output(tmp_path / ".other.tmp-abc", "someone else's")
    clean_stale(out)
    assert _digest(out) == old
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-abc", "out"]


# ============================================================================ 4: no pickle on resume


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _tiny_recipe(tmp_path, name="run", **sections) -> dict:
    """test_train's tiny recipe, without the periodic evaluations (faster)."""
    return tiny_recipe(tmp_path, name, **{"log": {"eval_every": 0}, **sections})


def _write_recipe(tmp_path, recipe: dict, name="r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(recipe))
    return path


def _tlm(args, **kwargs):
    return CliRunner().invoke(tlm_main, [str(a) for a in args], **kwargs)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(recipe.yaml, output_dir) of a finished 6-step run with checkpoint-3 and checkpoint-6."""
    tmp = tmp_path_factory.mktemp("trained")
    path = _write_recipe(tmp, _tiny_recipe(tmp))
    res = _tlm(["train", path, "--no-progress"])
    assert res.exit_code == 0, res.output
    return path, tmp / "run"


def _copy_run(trained, tmp_path) -> tuple[Path, Path]:
    recipe, out = trained
    data = yaml.safe_load(recipe.read_text())
    data["output_dir"] = str(tmp_path / "run")
    data["train"]["max_steps"] = 9
    shutil.copytree(out, tmp_path / "run")
    return _write_recipe(tmp_path, data), tmp_path / "run"


def test_resume_never_unpickles_a_handed_over_checkpoint(trained, tmp_path):
    """Case 4: a checkpoint whose state files are pickles that would run code: resume refuses, naming the file."""
    recipe, out = _copy_run(trained, tmp_path)
    ckpt = out / "checkpoint-6"
    marker = tmp_path / "pwned"
    for file in list(ckpt.iterdir()):  # the first format: state in .pt files (here crafted), no manifest
        if file.name.startswith(("optimizer", "scheduler", "rng_state_", "manifest")):
            file.unlink()
    for name in ("optimizer.pt", "scheduler.pt", "rng_state_0.pt"):
        torch.save({"state": _Evil(marker)}, ckpt / name)
    res = _tlm(["train", recipe, "--resume", ckpt, "--no-progress"])
    line = _one_error_line(res)
    assert not marker.exists(), "pickled code ran"
    assert "optimizer.pt" in line or "scheduler.pt" in line or "rng_state_0.pt" in line, line


def test_no_source_file_loads_with_pickle():
    """Case 4, statically: nothing in the packages calls torch.load without weights_only=True, or pickle.load."""
    offenders = []
    for package in ("tlm", "tlm_io", "tlm_train", "tlm_convert", "tlm_cli"):
        for file in (ROOT / package).rglob("*.py"):
            text = file.read_text(encoding="utf-8")
            if "weights_only=False" in text or "pickle.load" in text:
                offenders.append(str(file.relative_to(ROOT)))
            for i, line in enumerate(text.splitlines()):
                if "torch.load(" in line and "weights_only=True" not in line:
                    offenders.append(f"{file.relative_to(ROOT)}:{i + 1}")
    assert not offenders, offenders


# ============================================================================ 5: no custom code from stdin


def test_custom_tokenizer_code_is_refused_even_when_stdin_says_yes(source, tmp_path):
    """Case 5: a source whose tokenizer_config has an auto_map; `echo y | tlm-convert SRC -o OUT` runs nothing."""
    src = Path(shutil.copytree(source, tmp_path / "src"))
    marker = tmp_path / "ran"
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["evil_tok.EvilTokenizer", None]})
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    (src / "evil_tok.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                     "from transformers import PreTrainedTokenizerFast\n"
                                     "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    out = tmp_path / "out"
    res = _convert([src, "-o", out, *FAST], input="y\ny\n")  # CliRunner feeds this to sys.stdin
    assert not marker.exists(), "the source's tokenizer code ran"
    line = _one_error_line(res)
    assert "--trust-remote-code" in line and "[y/N]" not in res.output and not out.exists(), res.output


# ============================================================================ 6 + 11: concurrent runs, dead runs


def test_a_second_run_into_the_same_output_is_refused_and_a_dead_run_does_not_block(source, tmp_path):
    """Case 6: while another process holds OUTPUT, a run into it is refused naming the holder. Case 11: once that
    process is killed (SIGKILL: its lock file stays), the next run goes ahead and removes a dead run's temp folder."""
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom tlm_io.outputs import OutputLock\n"
                               f"OutputLock({str(out)!r}).acquire()\nprint('locked', flush=True)\ntime.sleep(600)"],
                              stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert holder.stdout.readline().strip() == "locked"
        line = _one_error_line(_convert([source, "-o", out, *FAST]))
        assert "being written by another run" in line and f"pid {holder.pid}" in line, line
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / ".out.lock").exists()  # SIGKILL: nothing was released
    (tmp_path / ".out.tmp-deadrun").mkdir()  # what a run killed while saving leaves
    (tmp_path / ".out.tmp-deadrun" / "model.safetensors").write_bytes(b"\0" * 100)
    res = _convert([source, "-o", out, *FAST])
    assert res.exit_code == 0, res.output
    assert (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_second_training_run_into_the_same_output_dir_is_refused(tmp_path):
    from tlm_io.outputs import OutputLock

    path = _write_recipe(tmp_path, _tiny_recipe(tmp_path))
    with OutputLock(tmp_path / "run"):
        line = _one_error_line(_tlm(["train", path, "--no-progress"]))
    assert "being written by another run" in line and f"pid {os.getpid()}" in line and "output_dir" in line, line
    assert not (tmp_path / "run").exists()


# ============================================================================ 7: corrupt latest checkpoint


@pytest.mark.parametrize("damaged", ["model.safetensors", "optimizer", "scheduler", "rng_state_0",
                                     "trainer_state.json"])
def test_resume_skips_a_damaged_latest_checkpoint(trained, tmp_path, damaged):
    """Case 7: one truncated file in the latest checkpoint: resume warns naming it and continues from the one
    before, to the same result as resuming from that one directly."""
    recipe, out = _copy_run(trained, tmp_path)
    victim = sorted((out / "checkpoint-6").glob(f"{damaged}*"))[-1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    res = _tlm(["train", recipe, "--resume", "--no-progress"])
    assert res.exit_code == 0, res.output
    warning = [ln for ln in res.output.splitlines() if ln.startswith("warning:")]
    assert warning and "checkpoint-6" in warning[0] and victim.name in warning[0] and "checkpoint-3" in warning[0]
    assert json.loads(res.output.strip().splitlines()[-1])["steps"] == 9
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 10)) + [9]  # steps 4..6 logged again from checkpoint-3, then the final eval


def test_resume_from_a_named_damaged_checkpoint_is_one_line(trained, tmp_path):
    recipe, out = _copy_run(trained, tmp_path)
    victim = out / "checkpoint-6" / "model.safetensors"
    victim.write_bytes(victim.read_bytes()[:100])
    line = _one_error_line(_tlm(["train", recipe, "--resume", out / "checkpoint-6", "--no-progress"]))
    assert "model.safetensors" in line and "checkpoint-6" in line, line


# ============================================================================ 8 + 10: disk space, output paths


def test_too_little_disk_space_is_refused_before_calibrating(source, tmp_path, monkeypatch):
    """Case 10 (space): the room needed is estimated from the parameter count and dtype after loading."""
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    res = _convert([source, "-o", tmp_path / "out", *FAST])
    line = _one_error_line(res)
    assert "not enough disk space" in line and "MiB" in line, line
    assert "calibrate" not in res.output and not (tmp_path / "out").exists()


def test_disk_full_while_saving_is_one_clear_line(source, tmp_path, monkeypatch):
    """Case 8: the writer fails as safetensors does on a full disk: one line with what, where and how much; the
    previous output is kept, no temp folder is left."""
    import safetensors.torch
    from safetensors import SafetensorError

    out = tmp_path / "out"
    previous = _fake_output(out, "previous run")

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "serialize_file", full_disk)  # under every save_file
    line = _one_error_line(_convert([source, "-o", out, *FAST, "--overwrite"]))
    assert "disk full while writing" in line and str(out) in line and "needed" in line and "free" in line, line
    assert _digest(out) == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_disk_full_while_checkpointing_is_one_clear_line(tmp_path, monkeypatch):
    """Case 8 for `tlm train`: the checkpoint is not published, the error names it."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "serialize_file", full_disk)
    path = _write_recipe(tmp_path, _tiny_recipe(tmp_path))
    line = _one_error_line(_tlm(["train", path, "--no-progress"]))
    assert "disk full while writing" in line and "checkpoint-3" in line and "needed" in line, line
    assert not list((tmp_path / "run").glob("checkpoint-*")) and not list((tmp_path / "run").glob(".*tmp*"))


@pytest.mark.parametrize("where", ["under-a-file", "unreadable-parent"])
def test_an_unwritable_output_path_is_refused_before_any_work(source, tmp_path, monkeypatch, where):
    """Case 10 (paths): found before loading, not after the whole conversion."""
    if where == "under-a-file":
        (tmp_path / "file").write_text("x")
        out = tmp_path / "file" / "out"
    else:  # root ignores permission bits: simulate the read-only parent at the access check
        out = tmp_path / "ro" / "out"
        (tmp_path / "ro").mkdir()
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, m, **k: False if Path(p) == tmp_path / "ro" else real(p, m, **k))
    res = _convert([source, "-o", out, *FAST])
    line = _one_error_line(res)
    assert "cannot create" in line, line
    assert "[load]" not in res.output and "calibrate" not in res.output


# ============================================================================ 9: recipe typos


def test_a_typo_under_model_config_is_reported(tmp_path):
    recipe = _tiny_recipe(tmp_path)
    recipe["model"]["config"]["num_hidden_layer"] = 2
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress"]))
    assert "model.config.num_hidden_layer: unknown key (did you mean num_hidden_layers?)" in line, line
    assert not (tmp_path / "run").exists()


# ============================================================================ 12-13: stopping


def test_stop_file_exits_143_and_the_hint_repeats_the_overrides(tmp_path):
    """Cases 12 and 13 with the STOP file: a stopped run is not a finished one."""
    path = _write_recipe(tmp_path, _tiny_recipe(tmp_path, "ignored"))
    run = tmp_path / "other dir"
    run.mkdir()
    (run / "STOP").touch()
    res = _tlm(["train", path, "--set", f"output_dir={run}", "--set", "optim.lr=1e-3", "--no-progress"])
    assert res.exit_code == 143, res.output
    hint = res.output.strip().splitlines()[-1]
    assert f"--set 'output_dir={run}' --set optim.lr=1e-3 --resume" in hint, hint


def test_sigterm_exits_143_with_a_checkpoint_and_a_resume_command(tmp_path):
    """Case 12 with a real SIGTERM to a real `tlm train` process."""
    recipe = _tiny_recipe(tmp_path, train={"max_steps": 100000}, log={"save_every": 100000, "eval_every": 0})
    path = _write_recipe(tmp_path, recipe)
    proc = subprocess.Popen([sys.executable, "-m", "tlm_train", "train", str(path), "--set", "seed=4",
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stdout + stderr
    assert "--set seed=4 --resume" in stdout and "SIGTERM" in stdout, stdout
    assert len(list((tmp_path / "run").glob("checkpoint-*"))) == 1


def test_checkpoints_of_the_first_format_still_resume(trained, tmp_path):
    """Backward compatibility: optimizer.pt / scheduler.pt / rng_state_0.pt as the first versions wrote them
    (torch.save of the state dicts) resume through the weights-only unpickler to the same losses."""
    from tlm_train import state_io
    from tlm_train.recipe import load_recipe
    from tlm_train.trainer import train

    recipe, out = _copy_run(trained, tmp_path)
    reference = train(load_recipe(recipe), resume=str(out / "checkpoint-6"))
    shutil.rmtree(out)
    recipe, out = _copy_run(trained, tmp_path)
    ckpt = out / "checkpoint-6"
    for name in ("optimizer", "scheduler", "rng_state_0"):
        torch.save(state_io.load_state(ckpt, name), ckpt / f"{name}.pt")
        (ckpt / f"{name}.json").unlink()
        (ckpt / f"{name}.safetensors").unlink()
    (ckpt / state_io.MANIFEST).unlink()
    legacy = train(load_recipe(recipe), resume=True)
    assert legacy.steps == 9 and legacy.losses == reference.losses
