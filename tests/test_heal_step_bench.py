"""bench/heal_step.py --quick: the side-by-side heal step benchmark runs on tiny random models so that it cannot rot."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def test_quick_heal_step_bench_times_every_variant_and_measures_a_peak(tmp_path, monkeypatch):
    out = tmp_path / "heal_step.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    variants = ["plain", "heal_full", "heal_chunked", "heal_topk", "heal_chunked/micro=1/ckpt/teacher=fp32"]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "heal_step.py"), "--quick", "--threads", "1",
                           "--out", str(out), "--variants", ",".join(variants)],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    timing = result["models"]["smollm2-135m"]["timing"]
    assert list(timing) == variants
    for row in timing.values():
        assert row["tokens_per_s"] > 0 and abs(sum(v for k, v in row["wall_share"].items()
                                                   if k != "student_forward_backward") - 1) < 0.01
    # the same student and teacher: the whole-logit and the chunked KL start from the same loss
    assert abs(timing["heal_full"]["losses"][0] - timing["heal_chunked"]["losses"][0]) < 0.05
    peak = result["models"]["smollm2-135m"]["peak_rss"]["heal_chunked"]
    assert peak["status"] == "ok" and peak["peak_rss_mb"] >= peak["rss_before_steps_mb"] > 0
    assert result["precision"] in ("bf16", "fp32") and result["wall_s"] > 0
    memory = peak["memory_mb"]
    assert set(memory) == {"student_weights", "teacher_weights", "gradients", "adamw_moments"}
    assert set(peak["phase_peak_rss_mb"]) == {"teacher_forward", "student_forward", "loss", "backward", "optimizer"}
    spec = importlib.util.spec_from_file_location("heal_step", ROOT / "bench" / "heal_step.py")
    heal_step = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "heal_step", heal_step)  # its dataclasses look their module up
    spec.loader.exec_module(heal_step)
    with pytest.raises(SystemExit, match="unknown option 'micro=0'"):  # the message --variants prints
        heal_step.parse_variant("heal_chunked/micro=0")
