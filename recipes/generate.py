"""Writes the generated recipes (run: python recipes/generate.py; tests/test_train.py checks the files are current).

The YAML files are the recipes; this script keeps the 4 mixers x 2 schedules x 2 scales under recipes/scratch/
consistent, and writes recipes/cpt/smollm2-135m-heal.yaml from the heal of ``tlm-convert --heal-tokens``
(tlm_convert.heal.HEAL_RECIPE, its one source) plus what that file sets itself.
CPU scale: the shared small CPU config of the design notes (d 384, 6 layers, 6 heads / 2 KV heads, D 1024,
context 256, bytes as tokens, AdamW 1e-3, weight decay 0.1, cosine, clip 1.0, fp32).
GPU scale: the paper's recipe (AdamW peak 4e-4, cosine decay, weight decay 0.1, 4K context, 0.5M-token global
batch: 8 GPUs x 8 sequences x 2 accumulation x 4096 tokens = 524,288) at the 440M class (d 1024, 24 layers,
16 heads, D 4096, Llama-2 32K tokenizer; 435M parameters with attention).
"""

import copy
from pathlib import Path

import yaml

from tlm_convert.heal import HEAL_RECIPE

ROOT = Path(__file__).parent

MIXER_EXTRA = {
    "attention": {},
    "gated_attention": {"gate_type": "elementwise"},
    "titans": {"titans_num_heads": 6, "titans_head_dim": 64, "titans_memory_depth": 2, "titans_memory_expansion": 2,
               "titans_chunk_size": 16},
    "hope_attention": {"hope_level_shares": [0.3333333333333333, 0.3333333333333333, 0.3333333333333334],
                       "hope_level_modes": ["online", "static", "static"], "hope_chunk_size": 16},
}
SCHEDULES = {"uniform": {"schedule": "uniform"}, "cosine": {"schedule": "cosine", "ratio": "1.5/0.5"}}


def cpu(mixer: str, schedule: str) -> dict:
    return {
        "output_dir": f"runs/cpu/{mixer}-{schedule}",
        "tokenizer": "byte",
        "seed": 0,
        "model": {**SCHEDULES[schedule], "multiple_of": 16,
                  "config": {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6,
                             "num_key_value_heads": 2, "intermediate_size": 1024, "max_position_embeddings": 256,
                             "tie_word_embeddings": True, "mixer": mixer, **MIXER_EXTRA[mixer]}},
        "data": {"train": "default", "eval": "default-eval", "eval_tokens": 65536, "seq_len": 256},
        "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 100, "weight_decay": 0.1, "grad_clip": 1.0},
        "train": {"max_steps": 2000, "batch_size": 16, "precision": "fp32"},
        "log": {"every": 10, "eval_every": 250, "save_every": 500, "keep_last": 2},
    }


def gpu(mixer: str, schedule: str) -> dict:
    extra = dict(MIXER_EXTRA[mixer])
    if mixer == "titans":
        extra.update(titans_num_heads=16, titans_head_dim=64)
    return {
        "output_dir": f"runs/gpu/440m-{mixer}-{schedule}",
        "tokenizer": "hf-internal-testing/llama-tokenizer",  # Llama-2's 32K SentencePiece vocabulary
        "seed": 0,
        "model": {**SCHEDULES[schedule], "multiple_of": 256,
                  "config": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                             "num_key_value_heads": 16, "intermediate_size": 4096, "max_position_embeddings": 4096,
                             "tie_word_embeddings": True, "mixer": mixer, **extra}},
        "data": {"train": "HuggingFaceFW/fineweb-edu:sample-10BT", "max_train_tokens": 9_500_000_000,
                 "eval_tokens": 4_194_304, "seq_len": 4096, "num_proc": 16, "num_workers": 2},
        "optim": {"lr": 4e-4, "min_lr": 4e-5, "warmup_steps": 1000, "weight_decay": 0.1, "grad_clip": 1.0},
        "train": {"max_steps": 18000, "batch_size": 8, "grad_accum": 2, "precision": "bf16", "compile": True,
                  "parallel": "ddp"},
        "log": {"every": 10, "eval_every": 1000, "save_every": 1000, "keep_last": 3},
    }


HEAL_HEADER = """\
# The heal of `tlm-convert --heal-tokens N` as a recipe: logit distillation (pure KL, alpha 1) of the converted
# SmolLM2-135M from its source, on the bundled calibration sample, lr 5.2e-4 x the weights' RMS (lr_relative: about
# 1e-4 for SmolLM2) constant after a short warmup, 4 x 512 tokens a step, bf16 autocast where it is fast.
# Generated from tlm_convert.heal.HEAL_RECIPE by recipes/generate.py (edit it there); bench/STUDIES.md ("The heal's
# recipe") has the runs behind it. For long heals: smollm2-135m-heal-long.yaml.
# (tlm-convert's default also calibrates on text sampled from the source; this recipe trains on `default` only,
# point data.train at OUT/calibration_samples.txt joined with it for the same data as --heal-tokens.)
#   tlm-convert smollm2-135m -o out/smollm2-tlm
#   tlm train {path}                       # 25 steps x 2,048 tokens = 51,200 tokens
#   tlm train {path} --set data.train=YOUR_BLEND
#   tlm export runs/cpt/smollm2-135m-heal/final -o out/smollm2-tlm-healed --to hf
"""


def heal() -> dict:
    """HEAL_RECIPE with what --heal-tokens fills in per conversion set for the SmolLM2-135M conversion, a held-out
    evaluation and checkpoints every 25 steps."""
    spec = copy.deepcopy(HEAL_RECIPE)
    return {
        "output_dir": "runs/cpt/smollm2-135m-heal",
        "init_from": "out/smollm2-tlm",
        "distill": {"teacher": "smollm2-135m", **spec["distill"]},
        "data": {"train": "default", "eval": "default-eval", "eval_tokens": 16384, "seq_len": 512},
        "optim": spec["optim"],
        "train": {"max_steps": 25, **spec["train"]},
        "log": {**spec["log"], "eval_every": 25, "save_every": 25, "keep_last": 2, "tensorboard": True},
    }


def generated() -> dict[Path, str]:
    """Every generated recipe file: path -> text."""
    files = {}
    for scale, make, header in (("cpu", cpu, "# CPU scale, from scratch: tlm train {path}\n"),
                                ("gpu", gpu, "# 440M class on 8 GPUs, from scratch: torchrun --nproc_per_node 8 -m "
                                             "tlm_train train {path}\n# (fill the token cache first: tlm tokenize "
                                             "{path})\n")):
        for mixer in MIXER_EXTRA:
            for schedule in SCHEDULES:
                path = ROOT / "scratch" / scale / f"{mixer}-{schedule}.yaml"
                text = header.format(path=path.relative_to(ROOT.parent)) + "# generated by recipes/generate.py\n"
                files[path] = text + yaml.safe_dump(make(mixer, schedule), sort_keys=False)
    path = ROOT / "cpt" / "smollm2-135m-heal.yaml"
    files[path] = HEAL_HEADER.format(path=path.relative_to(ROOT.parent)) + yaml.safe_dump(heal(), sort_keys=False)
    return files


def main() -> None:
    for path, text in generated().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


if __name__ == "__main__":
    main()
