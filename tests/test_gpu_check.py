"""bench/gpu_check.sh --dry: the GPU readiness check runs on CPU (tiny shapes) so that it cannot rot."""

import importlib.util
import json
import math
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"
MIXERS = ("attention", "gated_attention", "hope_attention", "titans")


OOD_SETS = ("eval-fiction", "eval-code", "eval-legal", "eval-encyclopedic")


def run_check(*args, timeout=600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(["bash", str(SCRIPT), "--dry", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_dry_check_measures_every_mixer_both_schedules_the_conversion_and_the_heal(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = run_check("--peak-tflops", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-2]) == summary  # the printed JSON line is the file
    assert "| config | mode | params | batch x seq | tokens/s | MFU | peak GB |" in proc.stdout
    rows = {(r["config"], r["mode"]): r for r in summary["training"]}
    expected = {(f"{m}-{s}", "eager") for m in MIXERS for s in ("uniform", "cosine")}
    expected |= {(f"{m}-cosine", "compiled") for m in MIXERS}  # dry: torch.compile (eager backend) on the tapered
    assert set(rows) == expected
    for (config, mode), r in rows.items():
        assert r["status"] == "ok", (config, mode, r["status"])
        assert r["tokens_per_s"] > 0 and r["batch"] * r["seq_len"] == 64
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * r["flops_per_token"] / 1e12, rel=2e-3, abs=1e-4)
        assert r["peak_mem_gb"] is None  # CPU: no GPU memory figure
    uniform, cosine = rows[("attention-uniform", "eager")], rows[("attention-cosine", "eager")]
    assert uniform["params"] == cosine["params"] and cosine["intermediate_sizes"][0] > cosine["intermediate_sizes"][-1]
    conv = summary["convert"]
    assert conv["status"] == "ok" and conv["wall_s"] > 0 and conv["eval_s"] >= 0 and conv["peak_mem_gb"] is None
    assert conv["wall_s"] == pytest.approx(sum(conv["phases_s"].values()) - conv["phases_s"]["eval"], abs=1.5)
    recorded = json.loads((ROOT / "bench" / "results" / "convert_time.json").read_text())
    assert conv["cpu_wall_s_recorded"] == round(recorded["conversion_wall_seconds"], 1)
    check_heal(summary["heal"], proc.stdout)
    assert summary["wall_s"] < summary["budget_s"]


def check_heal(heal: dict, stdout: str) -> None:
    """The dry heal: the recipe's batch, point 0 from the conversion, then 3 timed parts, each evaluated."""
    assert heal["status"] == "ok" and heal["batch"] == 4 and heal["seq_len"] == 32
    assert 0 < heal["lr"] < 5.2e-4  # the recipe's relative 5.2e-4 times the tiny model's weight RMS (< 1)
    assert heal["planned_s"] == heal["requested_s"] == 3.0
    points = heal["points"]
    assert [p["point"] for p in points] == [0, 1, 2, 3] and all(p["status"] == "ok" for p in points)
    assert points[0]["tokens"] == 0 and points[0]["heal_wall_s"] == 0
    tokens = [p["tokens"] for p in points]
    assert all(a < b for a, b in zip(tokens, tokens[1:]))  # every part trains (its STOP waits for a logged step) and tokens[-1] == points[-1]["steps"] * 4 * 32
    for p in points:
        assert set(OOD_SETS) | {"default-eval"} == set(p["ratios"]) and p["in_domain"] == ["default-eval"]
        assert p["ood_ratio"] == pytest.approx(math.prod(p["ratios"][s] for s in OOD_SETS) ** 0.25, rel=1e-3)
    for before, p in zip(points, points[1:]):
        assert p["heal_wall_s"] >= before["heal_wall_s"] and p["loop_s"] <= p["heal_wall_s"]
        assert p["peak_mem_gb"] is None and p["epochs"] >= 0
        assert p["tokens_per_s_wall"] > 0, p  # cumulative tokens over cumulative heal wall
        assert p["tokens_per_s_wall"] == pytest.approx(p["tokens"] / p["heal_wall_s"], rel=0.05, abs=1), p
    assert points[-1]["heal_wall_s"] == pytest.approx(3.0, abs=2.5)  # stopped on time (one step, a checkpoint)
    assert "| point | heal wall s | step s | tokens | epochs | tokens/s (steps) | tokens/s (wall) | peak GB |" in stdout


def test_window_seconds_counts_the_logged_windows_of_one_part(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    records = [{"step": 5, "tokens": 500, "tokens_per_s": 100.0}, {"step": 5, "eval_loss": 1.0, "tokens": 500},
               {"step": 10, "tokens": 1000, "tokens_per_s": 250.0},  # part 1 ends at step 12 (steps 11-12 unlogged)
               {"step": 15, "tokens": 1500, "tokens_per_s": 300.0}, {"step": 20, "tokens": 2000,
                                                                     "tokens_per_s": 500.0}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
    assert gpu_check.window_seconds(metrics, 0, 12, 0) == (1000, pytest.approx(5 + 2))
    tokens, seconds = gpu_check.window_seconds(metrics, 12, 20, 1200)  # resumed at step 12: 300 tokens, then 500
    assert tokens == 800 and seconds == pytest.approx(1 + 1)
    assert gpu_check.window_seconds(tmp_path / "none.jsonl", 0, 0, 0) == (0, 0)  # stopped before its first log
    assert gpu_check.last_logged_step(metrics) == 20  # what a timed part's STOP waits to see pass its start
    assert gpu_check.last_logged_step(tmp_path / "none.jsonl") == 0


def test_a_config_over_its_budget_is_stopped_and_the_check_ends_on_time(tmp_path):
    proc = run_check("--only", "titans", "--skip-convert", "--budget-s", "12", "--out", str(tmp_path / "g.json"),
                     timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "g.json").read_text())
    assert summary["convert"]["status"] == summary["heal"]["status"] == "skipped"
    statuses = [r["status"] for r in summary["training"]]
    assert statuses[0].startswith("stopped: over its") and statuses[-1].startswith(("stopped", "skipped"))
    assert summary["wall_s"] < 12 + 5


def test_without_a_gpu_the_real_check_says_so_in_one_line():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: no CUDA device")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_the_full_check_refuses_the_cpu_in_one_line():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", str(SCRIPT), "--device", "cpu"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --device cpu runs only the tiny shapes; add --dry"
