"""tlm train with Hope's slow(m) levels: resume mid-cycle == uninterrupted, and 2 gloo FSDP processes == one."""

import json
import shutil
from pathlib import Path

import pytest
from test_train import _torchrun, metrics, tiny_recipe

from tlm_train.recipe import recipe_from_dict
from tlm_train.trainer import train


def hope_recipe(tmp_path, name, m, **sections):
    recipe = tiny_recipe(tmp_path, name, **sections)
    recipe["model"]["config"].update(mixer="hope_attention", hope_level_modes=["online", f"slow({m})", "static"],
                                     hope_chunk_size=4)
    return recipe


def test_resume_mid_slow_cycle_continues_the_exact_loss_curve(tmp_path):
    # slow(4): due at steps 0 and 4; the checkpoint after 3 steps holds the sum of steps 1 and 2
    full = train(recipe_from_dict(hope_recipe(tmp_path, "full", 4)))
    half = recipe_from_dict(hope_recipe(tmp_path, "half", 4))
    train(half)
    shutil.rmtree(Path(half.output_dir) / "checkpoint-6")
    shutil.rmtree(Path(half.output_dir) / "final")
    resumed = train(half, resume=True)
    assert resumed.losses == full.losses[3:]
    assert resumed.eval_loss == full.eval_loss


@pytest.mark.parametrize("parallel", ["fsdp"])
def test_slow_levels_under_fsdp_match_one_process(tmp_path, parallel):
    single = train(recipe_from_dict(hope_recipe(tmp_path, "single", 2, train={"max_steps": 4})))
    proc = _torchrun(tmp_path, hope_recipe(tmp_path, parallel, 2, train={"max_steps": 4, "batch_size": 2,
                                                                        "parallel": parallel}))
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = [m["loss"] for m in metrics(tmp_path / parallel) if "loss" in m]
    assert losses == pytest.approx(single.losses, abs=1e-5)
    assert json.loads(proc.stdout.strip().splitlines()[-1])["eval_loss"] == pytest.approx(single.eval_loss, abs=1e-5)
