"""Interrupts are one line at any moment (issues 25 and 53): SIGTERM exits 143, Ctrl-C (SIGINT) 130, with one
``error:`` line and nothing half-written, in every command and from the first moment of start-up.

The start-up cases run the real console entry point in a subprocess and signal it at a moment read from /proc (its
signal handler just installed, or torch's library being mapped in), so they take as long as that start-up and
never sleep; the rest signal the test process itself from inside a command (CliRunner).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hostile_helpers import source  # noqa: F401 - fixture
from test_faults import ENV, FAST, ROOT, _convert, _one_error_line, _tiny_recipe, _tlm, _write_recipe
from tiny_sources import DATA
# ============================================================================ SIGTERM in every command


def _sigterm_self_once(monkeypatch, owner, name):
    """Make ``owner.name`` send this process SIGTERM the first time it is called (a real signal, in process)."""
    real, sent = getattr(owner, name), []

    def wrapper(*args, **kwargs):
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)


def test_sigterm_during_calibration_exits_143_with_its_line(source, tmp_path, monkeypatch):
    from tlm_convert import samples

    _sigterm_self_once(monkeypatch, samples._Advance, "__call__")
    res = _convert([source, "-o", tmp_path / "out", *FAST[2:], "--calibration-data", "self"])
    assert res.exit_code == 143, res.output
    line = _one_error_line(res)
    assert "stopped by SIGTERM during sample" in line and "nothing was written" in line, line
    assert not list(tmp_path.iterdir())


def test_sigterm_during_a_heal_exits_143_with_its_line(source, tmp_path, monkeypatch):
    from tlm_train import trainer

    _sigterm_self_once(monkeypatch, trainer._Run, "train_step")
    res = _convert([source, "-o", tmp_path / "out", *FAST, "--heal-tokens", "1024"])
    assert res.exit_code == 143, res.output
    line = _one_error_line(res)
    assert "stopped by SIGTERM during the heal" in line and "nothing was written" in line, line
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("reason, code", [("SIGTERM", 143), ("STOP", 143), ("SIGINT", 130)])
def test_a_stopped_run_is_one_line_with_128_plus_the_signal(reason, code, capsys):
    from tlm_cli.common import report_failure
    from tlm_io.errors import Stopped

    with pytest.raises(SystemExit) as exit_:
        report_failure(Stopped(reason, "calibrate"), stopped="nothing was written")
    assert exit_.value.code == code
    assert capsys.readouterr().err == f"error: stopped by {reason} during calibrate; nothing was written\n"


def _sigterm_when_called(monkeypatch, module, name, signum=signal.SIGTERM):
    """``module.name`` sends this process a real SIGTERM (or ``signum``), then does what it did."""
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        os.kill(os.getpid(), signum)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)


def test_sigterm_while_a_conversion_loads_exits_143(source, tmp_path, monkeypatch):
    import tlm_convert.convert

    _sigterm_when_called(monkeypatch, tlm_convert.convert, "load_source")
    res = _convert([source, "-o", tmp_path / "out", *FAST])
    assert res.exit_code == 143 and "stopped by SIGTERM during load" in _one_error_line(res), res.output
    assert not list(tmp_path.iterdir())


def test_sigterm_during_eval_exits_143(source, monkeypatch):
    import tlm_cli.main

    _sigterm_when_called(monkeypatch, tlm_cli.main, "strided_perplexity")
    res = _tlm(["eval", source, "--data", str(DATA), "--seq-len", "32", "--max-tokens", "64"])
    assert res.exit_code == 143 and "stopped by SIGTERM" in _one_error_line(res), res.output


def test_sigterm_during_export_exits_143_and_writes_nothing(source, tmp_path, monkeypatch):
    import tlm_io.export

    _sigterm_when_called(monkeypatch, tlm_io.export, "export_model")
    res = _tlm(["export", source, "--to", "tlm", "-o", tmp_path / "out"])
    assert res.exit_code == 143 and "nothing was written" in _one_error_line(res), res.output
    assert not list(tmp_path.iterdir())


def test_sigterm_during_tokenize_exits_143(tmp_path, monkeypatch):
    import tlm_train.shards

    _sigterm_when_called(monkeypatch, tlm_train.shards, "groups")
    res = _tlm(["tokenize", _write_recipe(tmp_path, _tiny_recipe(tmp_path))])
    assert res.exit_code == 143 and "run it again to continue" in _one_error_line(res), res.output


def test_sigterm_while_a_training_run_sets_up_exits_143(tmp_path, monkeypatch):
    import tlm_train.trainer

    _sigterm_when_called(monkeypatch, tlm_train.trainer, "student_and_tokenizer")
    res = _tlm(["train", _write_recipe(tmp_path, _tiny_recipe(tmp_path)), "--no-progress"])
    assert res.exit_code == 143 and "nothing was trained" in _one_error_line(res), res.output
    assert not (tmp_path / "run").exists()



def test_sigterm_during_analyze_exits_143(source, tmp_path, monkeypatch):
    import tlm_cli.main

    _sigterm_when_called(monkeypatch, tlm_cli.main, "residual_alignment")
    res = _tlm(["analyze", source, "--data", str(DATA), "--seq-len", "32", "--max-tokens", "64", "-o", tmp_path / "a"])
    assert res.exit_code == 143 and "stopped by SIGTERM" in _one_error_line(res), res.output
    assert not (tmp_path / "a").exists()


def test_sigterm_during_compare_exits_143(tmp_path, monkeypatch):
    import yaml
    from test_compare import tiny_base

    import tlm_cli.main

    _sigterm_when_called(monkeypatch, tlm_cli.main, "run_comparison")
    spec = {"base": tiny_base(tmp_path), "output_dir": str(tmp_path / "study"), "splits": ["3+2"], "rewarm_steps": 1}
    (tmp_path / "compare.yaml").write_text(yaml.safe_dump(spec))
    res = _tlm(["compare", tmp_path / "compare.yaml", "--no-progress"])
    assert res.exit_code == 143, res.output
    assert "stopped by SIGTERM; finished runs are kept; run it again to continue" in _one_error_line(res)


# ============================================================================ from the first moment (start-up)

PROC = Path("/proc/self/status").is_file()


def _handler_installed(pid: int) -> bool:
    """The launcher's handler is in place: the process catches SIGTERM (bit 15 of SigCgt)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def _importing_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _signal_at(args: list, when, signum: int, cwd: Path) -> tuple[int, str]:
    """(exit status, stderr) of ``python -m ARGS`` sent ``signum`` as soon as ``when(pid)`` holds."""
    proc = subprocess.Popen([sys.executable, "-m", *map(str, args)], cwd=cwd, env={**ENV, "TLM_DEBUG": ""},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if when(proc.pid):
                    break
            except (OSError, StopIteration):
                pass
            time.sleep(0.002)
        assert proc.poll() is None, f"it ended before the moment came: {proc.communicate()}"
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, err


@pytest.mark.skipif(not PROC, reason="reads /proc")
@pytest.mark.parametrize("signum, moment", [(signal.SIGINT, _handler_installed), (signal.SIGTERM, _handler_installed),
                                            (signal.SIGINT, _importing_torch), (signal.SIGTERM, _importing_torch)],
                         ids=["sigint-first-moment", "sigterm-first-moment", "sigint-importing-torch",
                              "sigterm-importing-torch"])
def test_tlm_convert_is_one_line_when_stopped_while_starting(source, tmp_path, signum, moment):
    """Issue case: Ctrl-C while tlm-convert imported printed a 25-line KeyboardInterrupt traceback and exited by the
    signal; SIGTERM there said nothing."""
    code, err = _signal_at(["tlm_convert", source, "-o", tmp_path / "out", *FAST], moment, signum, ROOT)
    name = signal.Signals(signum).name
    assert code == 128 + signum, (code, err)
    # torch loads in the command's body once every option and path has passed: the command's own stop line then
    assert err.count("\n") == 1 and err.startswith(f"error: stopped by {name}") and "nothing was written" in err, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.skipif(not PROC, reason="reads /proc")
@pytest.mark.parametrize("signum, moment", [(signal.SIGINT, _handler_installed), (signal.SIGTERM, _importing_torch)],
                         ids=["sigint-first-moment", "sigterm-importing-torch"])
def test_tlm_train_is_one_line_when_stopped_while_starting(tmp_path, signum, moment):
    """Issue cases: Ctrl-C and SIGTERM while tlm train started (the same two moments as tlm-convert's, one each)."""
    recipe = _write_recipe(tmp_path, _tiny_recipe(tmp_path))
    code, err = _signal_at(["tlm_cli", "train", recipe, "--no-progress"], moment, signum, ROOT)
    name = signal.Signals(signum).name
    assert code == 128 + signum and err == f"error: stopped by {name} while starting; nothing was written\n", (code, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


@pytest.mark.parametrize("process, handlers", [("MainProcess", "start-up start-up"), ("SpawnPoolWorker-1", "ignored default")])
def test_only_the_command_itself_installs_the_start_up_handler(process, handlers):
    """multiprocessing's spawn imports the main module (the launcher) again in each worker: only the main process
    installs the start-up handler; a worker ignores SIGINT (a Ctrl-C reaches the whole group), so one Ctrl-C is one
    line, not a traceback per worker."""
    code = (f"import multiprocessing, signal, sys; multiprocessing.current_process().name = {process!r}; "
            "sys.argv = ['/usr/bin/tlm-convert']; import tlm_cli.launch; "
            "name = lambda h: {signal.SIG_IGN: 'ignored', signal.SIG_DFL: 'default'}.get(h, 'start-up'); "
            "print(name(signal.getsignal(signal.SIGINT)), name(signal.getsignal(signal.SIGTERM)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert done.stdout.split() == handlers.split(), done


def _ignores_sigint(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGINT (its SigIgn mask in /proc), as a set-up pool worker does."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), "0")
    return bool(int(mask, 16) & (1 << (signal.SIGINT - 1)))


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return found


@pytest.mark.skipif(not PROC, reason="reads /proc")
def test_ctrl_c_to_tokenize_and_its_worker_processes_is_one_line(tmp_path):
    """Ctrl-C reaches every process of the terminal's group: tlm tokenize's pool workers ignore it, the command
    stops them and prints its one line (the workers printed a traceback each)."""
    recipe = _tiny_recipe(tmp_path, data={"num_proc": 2, "train": str(tmp_path / "big.txt")})
    (tmp_path / "big.txt").write_text(DATA.read_text() * 200)
    proc = subprocess.Popen([sys.executable, "-m", "tlm_cli", "tokenize", _write_recipe(tmp_path, recipe)], cwd=ROOT,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        while proc.poll() is None and sum(map(_ignores_sigint, _children(proc.pid))) < 2:  # the workers are set up
            time.sleep(0.005)
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err == "error: stopped by SIGINT; the shards written so far are kept; run it again to continue\n", err


# ============================================================================ Ctrl-C inside a command


def test_sigint_while_a_conversion_loads_exits_130_and_writes_nothing(source, tmp_path, monkeypatch):
    import tlm_convert.convert

    _sigterm_when_called(monkeypatch, tlm_convert.convert, "load_source", signal.SIGINT)
    res = _convert([source, "-o", tmp_path / "out", *FAST])
    assert res.exit_code == 130, res.output
    line = _one_error_line(res)
    assert line == f"error: stopped by SIGINT during load; nothing was written ({tmp_path / 'out'} is as it was)"
    assert not list(tmp_path.iterdir())


def test_sigint_during_eval_exits_130(source, monkeypatch):
    import tlm_cli.main

    _sigterm_when_called(monkeypatch, tlm_cli.main, "strided_perplexity", signal.SIGINT)
    res = _tlm(["eval", source, "--data", str(DATA), "--seq-len", "32", "--max-tokens", "64"])
    assert res.exit_code == 130 and "stopped by SIGINT" in _one_error_line(res), res.output


def test_a_second_signal_while_stopping_is_ignored():
    """The command's clean-up (removing its temporary folder) is not cut short by a second Ctrl-C or SIGTERM."""
    from tlm_cli.common import stop_on_signals
    from tlm_io.errors import Stopped

    cleaned = []
    with pytest.raises(Stopped) as stop:
        with stop_on_signals():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)  # the handler raises on the next bytecode, long before this ends
            finally:
                os.kill(os.getpid(), signal.SIGTERM)  # a second signal during the clean-up
                cleaned.append(True)
    assert stop.value.reason == "SIGINT" and cleaned == [True]
    assert signal.getsignal(signal.SIGINT) is not None  # the previous handlers are back


# ============================================================================ processes a command forks


def test_a_worker_forked_inside_a_command_ends_on_its_pools_sigterm():
    """Found running `tlm eval --tasks`: lm-eval bootstraps a stderr in a fork pool whose terminate() sends its
    workers SIGTERM; a worker that inherited the command's handler raised instead of ending, and one left the command
    waiting on it for good. A forked worker takes the signal's default action. (A training run's own handler stays
    inherited: its DataLoader workers must outlive a Ctrl-C to the group, as the run steps on to its checkpoint.)"""
    import multiprocessing

    from tlm_cli.common import stop_on_signals

    fork = multiprocessing.get_context("fork")
    running = fork.Event()
    with stop_on_signals():
        worker = fork.Process(target=_wait_for_work, args=(running,))
        worker.start()
        assert running.wait(30)  # past the fork (CPython drops a signal that arrives during it)
        worker.terminate()
        worker.join(30)
    assert worker.exitcode == -signal.SIGTERM, worker.exitcode


def _wait_for_work(running) -> None:
    running.set()
    time.sleep(60)
