"""bench/gpu_check.sh --dry: the GPU readiness check runs on CPU (tiny shapes) so that it cannot rot."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"
MIXERS = ("attention", "gated_attention", "hope_attention", "titans")


def run_check(*args, timeout=280) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(["bash", str(SCRIPT), "--dry", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_dry_check_measures_every_mixer_both_schedules_and_the_conversion(tmp_path):
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
    assert conv["status"] == "ok" and conv["wall_s"] > 0
    recorded = json.loads((ROOT / "bench" / "results" / "convert_time.json").read_text())
    assert conv["cpu_wall_s_recorded"] == round(recorded["conversion_wall_seconds"], 1)
    assert summary["wall_s"] < summary["budget_s"]


def test_a_config_over_its_budget_is_stopped_and_the_check_ends_on_time(tmp_path):
    proc = run_check("--only", "titans", "--skip-convert", "--budget-s", "12", "--out", str(tmp_path / "g.json"),
                     timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "g.json").read_text())
    statuses = [r["status"] for r in summary["training"]]
    assert statuses[0].startswith("stopped: over its") and statuses[-1].startswith(("stopped", "skipped"))
    assert summary["wall_s"] < 12 + 5


def test_without_a_gpu_the_real_check_says_so_in_one_line():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: no CUDA device")
    assert len(proc.stderr.strip().splitlines()) == 1
