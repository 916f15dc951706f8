"""The memory policies of the one conversion loop (tlm_convert.calibrate.convert_layers): the low-memory policy
(streamed source, one shard per layer) writes the in-memory policy's tensors; refusals; atomicity."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from tiny_sources import DATA, make_source, tiny_tokenizer
from transformers import AutoModelForCausalLM

import tlm_convert.convert as convert_module
from tlm_convert import report
from tlm_convert.calibrate import IN_MEMORY, LOW_MEMORY
from tlm_convert.compensate import refit_down_proj, refit_kept
from tlm_convert.options import options_from
from tlm_convert.convert import convert
from tlm_convert.importance import ActivationStats
from tlm_convert.stream import open_stream
from tlm_io.checkpoint import load_source
from tlm_io.errors import ConversionError

OPTS = dict(calibration_data=str(DATA), calibration_tokens=512, seq_len=64, batch_size=4, multiple_of=1,
            importance="activation")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    tokenizer = tiny_tokenizer()
    root = tmp_path_factory.mktemp("sources")
    return {family: make_source(root / family, family, tokenizer=tokenizer) for family in ("llama", "gpt2")}


@pytest.fixture(scope="module")
def in_memory(sources, tmp_path_factory):
    """The in-memory policy's outputs, one per (family, options) of the test below, made once."""
    root, made = tmp_path_factory.mktemp("in_memory"), {}

    def get(family, extra):
        key = (family, json.dumps(extra, sort_keys=True))
        if key not in made:
            out = root / str(len(made))
            with pytest.MonkeyPatch.context() as patch:  # the reference's plot is not under test here (saves time)
                patch.setattr(report, "write_plot", lambda _report, path: path.write_bytes(b""))
                made[key] = out, convert(str(sources[family]), str(out), options_from(**{**OPTS, **extra}))
        return made[key]

    return get


def _tensors(folder):
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _leftovers(parent, name):
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.tmp-")]


# the low-memory policy as it runs, with its limits forced down to the tiny layers (Gram matrix, AᵀY and the
# refit's right-hand side in blocks: "blocks"), and keeping the activations the tiny layers would sum ("kept")
POLICIES = {"low_memory": LOW_MEMORY, "blocks": replace(LOW_MEMORY, block_bytes=4096),
            "kept": replace(LOW_MEMORY, keep_activations_bytes=1 << 30)}
CASES = [
    ("llama", dict(eval_data=(str(DATA), "eval-code"), eval_tokens=192)),  # two evaluation sets
    ("gpt2", dict(refit_target="residual")),
    ("llama", dict(refit_target="local")),
    ("llama", dict(importance="obs", refit_target="residual")),
    ("gpt2", dict(importance="obs", refit_target="local")),
    ("llama", dict(mixer="gated_attention", grow_init="split")),
    ("llama", dict(mixer="hope_attention")),
]


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("family, extra", CASES)
def test_policies_write_the_same_tensors(policy, family, extra, sources, in_memory, tmp_path, monkeypatch):
    full_dir, full = in_memory(family, extra)
    monkeypatch.setattr(convert_module, "LOW_MEMORY", POLICIES[policy])
    seen = []
    low = convert(str(sources[family]), str(tmp_path / "low"), options_from(low_memory=True, **{**OPTS, **extra}),
                  on_layer=lambda done, total: seen.append((done, total)))
    assert seen == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]
    assert low["widths_after"] == full["widths_after"] == [72, 60, 36, 24]
    assert low["params_before"] == full["params_before"]
    assert low["params_after"] == full["params_after"]
    a, b = _tensors(full_dir), _tensors(tmp_path / "low")
    assert a.keys() == b.keys()
    for k in a:
        if policy == "low_memory":  # the same steps on layers this small: the same bits
            assert torch.equal(a[k], b[k]), k
        else:  # the same sums in another order, which the refit's solve amplifies (damping 1e-3)
            assert float((a[k] - b[k]).abs().max()) <= 1e-6 + 2e-4 * float(a[k].abs().max()), k
    assert sum(t.numel() for t in b.values()) == low["params_after"]
    config = {p: json.loads((p / "config.json").read_text()) for p in (full_dir, tmp_path / "low")}
    assert config[full_dir] == config[tmp_path / "low"]
    index = json.loads((tmp_path / "low" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(b)
    assert len(set(index["weight_map"].values())) == 6  # embeddings, one shard per layer, final norm (+ head)
    saved = json.loads((tmp_path / "low" / "conversion_report.json").read_text())
    assert saved["low_memory"] is True and saved["widths_after"] == full["widths_after"]
    for name in ("report.md", "tokenizer.json", "modeling_tlm.py", "configuration_tlm.py"):
        assert (tmp_path / "low" / name).is_file(), name
    assert (tmp_path / "low" / "widths.png").stat().st_size > 1000
    if "eval_data" in extra:
        assert [s["data"] for s in low["perplexity_sets"]] == [str(DATA), "eval-code"]
        for mine, theirs in zip(low["perplexity_sets"], full["perplexity_sets"]):  # the sets' sums kept apart
            for key in ("before", "after"):
                assert mine[key] == pytest.approx(theirs[key], rel=1e-5)
        assert low["perplexity_sets"][0]["before"] != pytest.approx(low["perplexity_sets"][1]["before"], rel=1e-3)
        assert low["perplexity_ratio_ood_geomean"] == pytest.approx(full["perplexity_ratio_ood_geomean"], rel=1e-5)
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "low", trust_remote_code=True).eval()
        assert model.config.intermediate_sizes == [72, 60, 36, 24]
        assert sum(p.numel() for p in model.parameters()) == low["params_before"]
    assert not _leftovers(tmp_path, "low")


def test_obs_beyond_the_budget_is_refused_or_not_the_default(sources, tmp_path, monkeypatch):
    monkeypatch.setattr(convert_module, "LOW_MEMORY", replace(LOW_MEMORY, obs_budget_bytes=1000))
    with pytest.raises(ConversionError, match="--set importance=obs needs about .* use --set importance=activation"):
        convert(str(sources["llama"]), str(tmp_path / "out"),
                options_from(low_memory=True, **{**OPTS, "importance": "obs"}))
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path, "out")
    low = convert(str(sources["llama"]), str(tmp_path / "out"), options_from(low_memory=True, **{**OPTS,
                                                                                                   "importance": "auto"}))
    assert low["importance"] == "activation" and any("obs needs" in n for n in low["notes"])
    monkeypatch.undo()
    low = convert(str(sources["llama"]), str(tmp_path / "fits"), options_from(low_memory=True, **{**OPTS,
                                                                                                    "importance": "auto"}))
    assert low["importance"] == "obs"


@pytest.mark.parametrize("change, message", [
    (dict(export="hf"), "writes --export tlm only \\(--export hf needs"),
    (dict(export="padded"), "drop --low-memory, or use --export tlm"),
    (dict(mixer="titans"), "titans mixer"),
    (dict(device="cuda"), "runs on the CPU; drop --device cuda or --low-memory"),
])
def test_unsupported_options_are_refused(change, message, sources, tmp_path):
    with pytest.raises(ConversionError, match=message):
        convert(str(sources["llama"]), str(tmp_path / "out"), options_from(low_memory=True, **{**OPTS, **change}))
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path, "out")


def _bin_copy(folder, out):
    out.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((folder / name).read_bytes())
    torch.save(load_file(folder / "model.safetensors"), out / "pytorch_model.bin")
    return out


def test_streamed_sources_read_the_loaded_tensors(sources, tmp_path):
    """Every source format streams (safetensors, .bin, llama GGUF): layer by layer, the tensors load_source reads."""
    from test_checkpoint import write_tiny_gguf

    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf)
    for source in (sources["llama"], sources["gpt2"], _bin_copy(sources["llama"], tmp_path / "bin"), gguf):
        whole, streamed = load_source(source), open_stream(source)
        assert (streamed.kind, streamed.family) == (whole.kind, whole.family)
        assert streamed.tlm_config.to_dict() == whole.tlm_config.to_dict()
        assert streamed.num_params == whole.num_params and streamed.notes == whole.notes
        assert streamed.tokenizer_kwargs() == whole.tokenizer_kwargs()
        names = [n for i in range(whole.tlm_config.num_hidden_layers) for n in streamed.layer_names(i)]
        names += streamed.other_names()
        expected = {k for k in whole.state_dict if not (k == "lm_head.weight" and whole.tlm_config.tie_word_embeddings)}
        assert sorted(names) == sorted(expected)
        for name, tensor in streamed.read(names).items():
            assert torch.equal(tensor, whole.state_dict[name]), (source, name)


def test_a_bin_checkpoint_streams_to_the_in_memory_tensors(sources, in_memory, tmp_path):
    full_dir, _ = in_memory("llama", {})
    convert(str(_bin_copy(sources["llama"], tmp_path / "bin")), str(tmp_path / "low"),
            options_from(low_memory=True, **OPTS))
    a, b = _tensors(full_dir), _tensors(tmp_path / "low")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sources_that_cannot_be_streamed_are_refused(sources, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    opts = options_from(low_memory=True, **OPTS)
    for source, message in ((gguf, "cannot be read as GGUF"), ("someorg/somemodel", "not a local folder")):
        with pytest.raises(ConversionError, match=message):
            convert(str(source), str(tmp_path / "out"), opts)
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path, "out")


def test_output_is_atomic_when_a_layer_fails(sources, tmp_path):
    from tlm_io.outputs import MARKER, write_marker

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("old output")
    write_marker(tmp_path / "out", "tlm-convert")  # an earlier output of ours, which --overwrite may replace

    def fail(done, total):
        if done == 2:
            raise RuntimeError("boom")

    opts = options_from(low_memory=True, overwrite=True, **OPTS)
    with pytest.raises(RuntimeError, match="boom"):
        convert(str(sources["llama"]), str(tmp_path / "out"), opts, on_layer=fail)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [MARKER, "keep.txt"]  # the old output, untouched
    assert not _leftovers(tmp_path, "out")


def test_refit_in_place_and_in_blocks_matches_the_copying_refit():
    gen = torch.Generator().manual_seed(0)
    acts = torch.randn(300, 90, generator=gen, dtype=torch.float64)
    down = torch.randn(12, 90, generator=gen)
    keep = sorted(torch.randperm(90, generator=gen)[:50].tolist())
    gram = acts.T @ acts
    idx = torch.tensor(keep)
    expected = refit_kept(gram[idx][:, idx], gram[idx] @ down.double().T).to(down.dtype)
    for rows in (None, 7):  # every block loop runs many times with 7 rows
        for in_place in (False, True):
            got = refit_down_proj(gram.clone(), down, keep, overwrite=True, block_rows=rows, in_place=in_place)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # another target (the residual one): AᵀY given whole
    cross = acts.T @ torch.randn(300, 12, generator=gen, dtype=torch.float64)
    expected = refit_kept(gram[idx][:, idx], cross[idx]).to(down.dtype)
    got = refit_down_proj(acts.T @ acts, down, keep, cross=cross, overwrite=True, block_rows=7, in_place=True)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # not positive definite even with damping: the least-squares fallback
    indefinite = -torch.eye(90, dtype=torch.float64) + 0.01 * (acts.T @ acts) / 300
    expected = refit_down_proj(indefinite.clone(), down, keep)
    for in_place in (False, True):
        got = refit_down_proj(indefinite.clone(), down, keep, overwrite=True, block_rows=7, in_place=in_place)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_refit_kept_in_place_gives_the_same_bits():
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(400, 70, generator=gen, dtype=torch.float64)
    g, rhs = a.T @ a, torch.randn(70, 9, generator=gen, dtype=torch.float64)
    copy = refit_kept(g, rhs)
    assert torch.equal(g, a.T @ a)  # not overwritten
    assert torch.equal(refit_kept(g.clone(), rhs, overwrite=True), copy)


def test_blocked_gram_matches_activation_stats():
    a = torch.randn(3, 11, 37, generator=torch.Generator().manual_seed(1))
    whole, blocked = ActivationStats(37, gram=True), ActivationStats(37, gram=True, block_rows=5)
    for part in (a[:2], a[2:]):
        whole.update(part)
        blocked.update(part)
    for name in ("sum", "sumsq", "seq_abs_sq", "gram"):
        torch.testing.assert_close(getattr(blocked, name), getattr(whole, name), rtol=1e-6, atol=1e-5)
    assert blocked.tokens == whole.tokens == 33
    flat = a.flatten(0, 1).double()
    torch.testing.assert_close(whole.gram, flat.T @ flat, rtol=1e-6, atol=1e-5)  # the triangle of blocks, mirrored


def test_a_layer_keeps_its_activations_only_when_they_take_less_memory_than_its_gram_matrix():
    for policy in (LOW_MEMORY, IN_MEMORY):
        assert policy.keeps(tokens=1024, width=11008)  # 45 MB of activations, a 970 MB Gram matrix
        assert not policy.keeps(tokens=65536, width=1536)  # 403 MB of activations, a 19 MB Gram matrix
    assert replace(LOW_MEMORY, keep_activations_bytes=1 << 30).keeps(tokens=65536, width=1536)
