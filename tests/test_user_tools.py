"""Our checkpoints in the tools users already run, each on a tiny model: lm-eval's stock HF model class loading a
``tlm`` export by path (``trust_remote_code=True``, in a fresh process that never imports this project), two
optimizer steps of transformers' ``Trainer`` on a converted TLM (the loss falls, it saves and reloads), and the
``deci`` view's exact per-layer widths for consumers that read ``ffn.intermediate_size`` beside ``ffn_mult``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

from tiny_sources import DATA, make_source
from tlm import TLMForCausalLM
from tlm_convert.convert import ConvertOptions, convert
from tlm_convert.options import Method
from tlm_io.archs import family_of, tlm_config_from_hf
from tlm_io.checkpoint import Source
from tlm_io.export import deci_width, export_model
from tlm_io.load import load_model

TOL = 1e-5
PAIRS = [("To be, or not to be", " that is the question"), ("Friends, Romans", " countrymen"), ("A", " b")]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """A tiny Llama converted by tlm-convert (cosine 1.5/0.5) into a ``tlm`` folder."""
    root = tmp_path_factory.mktemp("user_tools")
    src = make_source(root / "src", "llama", seed=5)
    opts = ConvertOptions(calibration_data="default", calibration_tokens=1024, seq_len=32, method=Method(multiple_of=1))
    convert(str(src), str(root / "tlm"), opts)
    return root / "tlm"


def test_lm_eval_stock_hf_model_loads_a_tlm_export(converted):
    from lm_eval.api.instance import Instance

    from tlm_io.harness import hf_model

    model, tokenizer, _ = load_model(str(converted))
    ours = [ll for ll, _ in hf_model(model, tokenizer, batch_size=2).loglikelihood(
        [Instance("loglikelihood", {}, p, i) for i, p in enumerate(PAIRS)], disable_tqdm=True)]
    script = ("import json, sys\nfrom lm_eval.api.instance import Instance\nfrom lm_eval.models.huggingface import HFLM\n"
              f"lm = HFLM(pretrained={str(converted)!r}, trust_remote_code=True, dtype='float32', device='cpu', "
              "batch_size=2)\n"
              f"pairs = {PAIRS!r}\n"
              "out = [ll for ll, _ in lm.loglikelihood([Instance('loglikelihood', {}, tuple(p), i) "
              "for i, p in enumerate(pairs)], disable_tqdm=True)]\n"
              "assert 'tlm' not in sys.modules, 'the project was imported'\n"
              "print(json.dumps({'ll': out, 'module': type(lm.model).__module__}))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", script], cwd=converted.parent, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    stock = json.loads(result.stdout.strip().splitlines()[-1])
    assert stock["module"].startswith("transformers_modules.")  # the folder's own code, not the project's
    assert max(abs(a - b) for a, b in zip(stock["ll"], ours)) <= TOL, (stock["ll"], ours)


def test_transformers_trainer_two_steps_on_a_converted_tlm(converted, tmp_path):
    model, tokenizer, _ = load_model(str(converted))
    model.train()
    ids = torch.tensor(tokenizer(DATA.read_text()[:4000])["input_ids"][:8 * 32]).view(8, 32)  # (8, 32)
    data = [{"input_ids": row, "labels": row} for row in ids]

    def loss() -> float:
        with torch.no_grad():
            return float(model(input_ids=ids, labels=ids).loss)

    before = loss()
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4,
                             learning_rate=3e-3, lr_scheduler_type="constant", warmup_steps=0, report_to="none",
                             save_strategy="no", logging_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    after = loss()
    assert after < before, (before, after)
    trainer.save_model(str(tmp_path / "saved"))
    back, _, _ = load_model(str(tmp_path / "saved"), with_tokenizer=False)
    with torch.no_grad():
        assert (back(ids).logits - model.eval()(ids).logits).abs().max() <= TOL
    assert back.config.intermediate_sizes == model.config.intermediate_sizes


def _deci_model():
    cfg = LlamaConfig(vocab_size=99, hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(2)
    model = TLMForCausalLM(tlm_config_from_hf(cfg, intermediate_sizes=[512, 256, 256])).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    source = Source(kind="hf", path="", hf_config=cfg, family=family_of(cfg), tlm_config=tlm_config_from_hf(cfg),
                    state_dict={}, tokenizer_source=None, num_params=0)
    return model, source


def test_deci_view_carries_exact_widths_for_both_readers(tmp_path):
    """Each layer's ``ffn`` holds the exact width (``intermediate_size``, what vLLM reads) and the ``ffn_mult`` the
    other engines derive it from; a consumer that has only one of them loads the same model."""
    model, source = _deci_model()
    export_model(model, tmp_path / "deci", "deci", source)
    config = json.loads((tmp_path / "deci" / "config.json").read_text())
    ffn = [b["ffn"] for b in config["block_configs"]]
    assert [f["intermediate_size"] for f in ffn] == [512, 256, 256] == model.config.intermediate_sizes
    assert [deci_width(f["ffn_mult"], 64) for f in ffn] == [512, 256, 256]
    ids = torch.randint(0, 99, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    for drop in ("ffn_mult", "intermediate_size"):  # a reader of the other key only
        view = tmp_path / f"without_{drop}"
        view.mkdir()
        for f in (tmp_path / "deci").iterdir():
            (view / f.name).write_bytes(f.read_bytes())
        reduced = {**config, "block_configs": [{**b, "ffn": {k: v for k, v in b["ffn"].items() if k != drop}}
                                               for b in config["block_configs"]]}
        (view / "config.json").write_text(json.dumps(reduced))
        back = AutoModelForCausalLM.from_pretrained(str(view), trust_remote_code=True, dtype=torch.float32).eval()
        sizes = [layer.mlp.gate_proj.out_features for layer in back.model.layers]
        assert sizes == [512, 256, 256], (drop, sizes)
        with torch.no_grad():
            assert (back(ids).logits - ref).abs().max() <= TOL, drop
