"""Every export's tokenizer and config read with transformers' stock classes only (issue 12, item 3).

tokenizer_config.json names a class transformers 4.x and 5.x both have (not v5's "TokenizersBackend") and no
tokenizer auto_map; PreTrainedTokenizerFast reads it and tokenizes like the source. The config of `padded` loads
with the stock config class and `deci`'s config.json is plain JSON with the fields llama.cpp's converter and vLLM
read. In a fresh interpreter (no tlm imported, stdin answering the prompt) AutoTokenizer loads the hf, padded and
gguf exports without asking to run custom code, and the README's Python example loads a `tlm` export so.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tiny_sources import make_source
from tlm import TLMConfig, TLMForCausalLM
from tlm_io.checkpoint import load_source
from tlm_io.export import export_model

TEXT = "To be, or not to be: that is the question."
TAPERED = [72, 61, 36, 24]
FORMATS = {"tlm": TAPERED, "hf": TAPERED, "padded": TAPERED, "deci": [512, 256, 256, 256], "gguf": TAPERED}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("portable")
    src = load_source(make_source(root / "src"))
    fields = src.tlm_config.to_dict()
    for key in ("model_type", "transformers_version", "architectures", "auto_map", "_name_or_path"):
        fields.pop(key, None)
    for fmt, widths in FORMATS.items():
        model = TLMForCausalLM(TLMConfig(**{**fields, "intermediate_sizes": widths})).eval()
        export_model(model, root / fmt, fmt, src)
    return root


@pytest.mark.parametrize("fmt", FORMATS)
def test_tokenizer_config_names_a_class_both_versions_know(exports, fmt):
    out = exports / fmt
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] != "TokenizersBackend" and hasattr(transformers, config["tokenizer_class"])
    assert "auto_map" not in config
    source = PreTrainedTokenizerFast.from_pretrained(str(exports / "src"))
    assert PreTrainedTokenizerFast.from_pretrained(str(out))(TEXT)["input_ids"] == source(TEXT)["input_ids"]


def test_padded_and_deci_configs_with_stock_classes(exports):
    padded = AutoConfig.from_pretrained(str(exports / "padded"))  # no trust_remote_code
    assert type(padded).__name__ == "LlamaConfig" and padded.intermediate_size == max(TAPERED)
    model = LlamaForCausalLM.from_pretrained(str(exports / "padded"), dtype=torch.float32)
    assert model.model.layers[0].mlp.up_proj.out_features == max(TAPERED)
    deci = json.loads((exports / "deci" / "config.json").read_text())  # what llama.cpp's converter and vLLM read
    assert deci["architectures"] == ["DeciLMForCausalLM"]
    assert [b["ffn"]["intermediate_size"] for b in deci["block_configs"]] == FORMATS["deci"]
    assert all(b["attention"]["n_heads_in_group"] == 2 for b in deci["block_configs"])


_LOAD = ("import sys\nfrom transformers import AutoTokenizer\nfor folder in sys.argv[1:]:\n"
         "    AutoTokenizer.from_pretrained(folder)\n    print('loaded', folder.rsplit('/', 1)[-1])")
PORTABLE = ("hf", "padded", "gguf")  # the exports that load without trust_remote_code


def test_auto_tokenizer_does_not_prompt(exports):
    """A fresh interpreter that never imports tlm loads each portable export's tokenizer; a prompt would print its
    question before reading stdin (one interpreter for the three: its start-up is most of the cost)."""
    run = subprocess.run([sys.executable, "-c", _LOAD, *(str(exports / fmt) for fmt in PORTABLE)], input="\n",
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Do you wish to run the custom code" not in run.stdout
    assert run.stdout.split() == [w for fmt in PORTABLE for w in ("loaded", fmt)], run.stdout


def test_the_readme_python_example_loads_a_tlm_export_without_a_prompt(exports):
    """The README's Python example, on a tiny `tlm` export, in a fresh interpreter that never imports tlm and answers
    any prompt with no: it loads the model and the tokenizer and generates, asking nothing."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    [example] = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert '"out/smollm2-tlm"' in example
    code = example.replace('"out/smollm2-tlm"', repr(str(exports / "tlm")))
    run = subprocess.run([sys.executable, "-c", code], input="\n", capture_output=True, text=True, timeout=300,
                         cwd=exports)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Do you wish to run the custom code" not in run.stdout + run.stderr
    assert run.stdout.startswith("The capital of France is"), run.stdout[-500:]


def test_v5_only_class_rewritten(exports, tmp_path):
    """What transformers 5 writes after reading a GGUF tokenizer ("TokenizersBackend") becomes a class 4.x has."""
    from tlm_io.export import portable_tokenizer_config

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((exports / "hf" / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="TokenizersBackend", auto_map={"AutoTokenizer": ["x.Y", None]})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    portable_tokenizer_config(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and "auto_map" not in config
