"""Zero-shot accuracy through lm-evaluation-harness (tlm_io.harness, ``tlm eval --tasks``), the ``gptq`` perplexity
protocol, and our checkpoints in the users' tools: lm-eval's stock HF model class loading a ``tlm`` export by path,
transformers' Trainer on a converted TLM, the ``deci`` view's exact per-layer widths. Tiny fp32 models, offline."""

import inspect
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from tiny_sources import make_source, tiny_tokenizer
from tlm_cli.main import tlm_main
from tlm_io.load import load_model

from lm_eval.api.instance import Instance  # the eval extra is part of the test extra

from tlm_io.harness import LOCAL_TASKS, TASK_DATA, evaluate_tasks, hf_model, sample_scores

TOL = 1e-5
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_source(tmp_path_factory.mktemp("harness") / "src", "llama", seed=3)


def _run(args):
    kwargs = {"mix_stderr": False} if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters else {}
    return CliRunner(**kwargs).invoke(tlm_main, [str(a) for a in args], env=OFFLINE)


@torch.no_grad()
def _direct(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) by one unpadded fp64 log-softmax of the model's logits (no lm-eval code)."""
    ids = tokenizer(context + continuation)["input_ids"]
    n_ctx = len(tokenizer(context)["input_ids"])
    logp = F.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)  # (S, V)
    return sum(float(logp[t - 1, ids[t]]) for t in range(n_ctx, len(ids)))


def test_loglikelihoods_equal_a_direct_computation(source):
    model, tokenizer, _ = load_model(str(source))
    pairs = [("To be, or not to be", " that is the question"), ("Friends, Romans", " countrymen"),
             ("Friends, Romans", " lend"), ("Friends, Romans", " me"), ("A", " b"),
             ("Now is the winter of our discontent made glorious summer by this sun of York", " and all the clouds")]
    lm = hf_model(model, tokenizer, batch_size=3)  # padded batches, one-token continuations sharing a context
    ours = [ll for ll, _ in lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)],
                                              disable_tqdm=True)]
    direct = [_direct(model, tokenizer, c, x) for c, x in pairs]
    assert max(abs(a - b) for a, b in zip(ours, direct)) <= TOL, (ours, direct)


@torch.no_grad()
def test_rolling_loglikelihood_equals_a_direct_computation(source):
    model, tokenizer, _ = load_model(str(source))
    text = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate: rough winds do shake."
    window = 16
    lm = hf_model(model, tokenizer, batch_size=2, max_length=window)
    (ours,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    tokens, n = tokenizer(text)["input_ids"], 0
    assert len(tokens) > 3 * window  # several windows, the last one partial
    stream, total = [tokenizer.eos_token_id] + tokens, 0.0  # the first token is predicted from the prefix token
    while n < len(tokens):  # every token predicted once, from up to `window` tokens before it
        k = min(window, len(tokens) - n)
        begin = max(0, n + k - window)
        inputs = stream[begin:n + k]
        logp = F.log_softmax(model(torch.tensor([inputs])).logits[0].double(), -1)
        total += sum(float(logp[t - begin, stream[t + 1]]) for t in range(n, n + k))
        n += k
    assert abs(ours - total) <= TOL, (ours, total)


def test_a_bundled_task_runs_end_to_end(source, tmp_path):
    """``tlm eval --tasks piqa --limit 8 --log-samples``: the table, lm-eval's results JSON, an accuracy that a direct
    scoring of the same 8 bundled documents with lm-eval's prompt reproduces, and each document's logged record
    right or wrong as that scoring says."""
    result = _run(["eval", source, "--tasks", "piqa", "--limit", 8, "--batch-size", 4, "--output-path", tmp_path,
                   "--log-samples"])
    assert result.exit_code == 0, result.output + result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert rows[0] == ["task", "metric", "value", "stderr", "n"]
    acc = next(float(r[2]) for r in rows if r[:2] == ["piqa", "acc"])
    (written,) = tmp_path.rglob("results_*.json")
    data = json.loads(written.read_text())
    assert data["results"]["piqa"]["acc,none"] == pytest.approx(acc, abs=1e-4)
    assert data["n-samples"]["piqa"] == {"original": 500, "effective": 8}
    model, tokenizer, _ = load_model(str(source))
    docs = [json.loads(line) for line in (TASK_DATA / "piqa.jsonl").read_text().splitlines()[:8]]
    right = [max((0, 1), key=lambda i: _direct(model, tokenizer, f"Question: {d['goal']}\nAnswer:",
                                                " " + d[f"sol{i + 1}"])) == d["label"] for d in docs]
    assert acc == pytest.approx(sum(right) / len(right), abs=1e-4)
    assert "samples" not in data  # the records go to their own file, as lm-eval's CLI writes them
    (records,) = tmp_path.rglob("samples_piqa_*.jsonl")
    assert sample_scores(records) == {i: float(r) for i, r in enumerate(right)}


def test_every_bundled_task_has_its_file():
    bundled = [name for name, t in LOCAL_TASKS.items() if (TASK_DATA / t.file).is_file()]
    assert sorted(bundled) == sorted(["arc_easy", "arc_challenge", "hellaswag_text", "piqa", "winogrande",
                                      "boolq_notitle", "openbookqa", "lambada_openai"])
    for name in bundled:
        assert len((TASK_DATA / LOCAL_TASKS[name].file).read_text().splitlines()) == 500


def test_full_files_from_a_folder_and_own_tasks(source, tmp_path):
    """--task-data DIR reads the standard task from DIR; --include-path runs a user's YAML on its own file."""
    data = tmp_path / "full"
    data.mkdir()
    shutil.copy(TASK_DATA / "winogrande.jsonl", data / "winogrande.jsonl")
    model, tokenizer, _ = load_model(str(source))
    a = evaluate_tasks(model, tokenizer, "winogrande", limit=6, task_data=str(data))
    b = evaluate_tasks(model, tokenizer, "winogrande", limit=6)
    assert a["results"]["winogrande"]["acc,none"] == b["results"]["winogrande"]["acc,none"]
    own = tmp_path / "own"
    own.mkdir()
    (own / "docs.jsonl").write_text("".join(json.dumps({"q": f"{w} is a", "a": 0}) + "\n" for w in ("Rome", "Paris")))
    (own / "mine.yaml").write_text(f"task: mine\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
                                   f"{own / 'docs.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
                                   "doc_to_text: '{{q}}'\ndoc_to_choice: ['city', 'river']\ndoc_to_target: a\n"
                                   "metric_list:\n  - metric: acc\n")
    result = _run(["eval", source, "--tasks", "mine", "--include-path", own])
    assert result.exit_code == 0, result.output + result.stderr
    assert any(line.split()[:2] == ["mine", "acc"] for line in result.stdout.splitlines())


def test_missing_task_data_is_one_line(source, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = _run(["eval", source, "--tasks", "piqa", "--task-data", empty])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "task piqa needs piqa.jsonl" in result.stderr, result.stderr
    result = _run(["eval", source, "--tasks", "hellaswag"])  # lm-eval's exact items are not bundled
    assert result.exit_code == 1 and result.stderr.count("\n") == 1
    assert "hellaswag.jsonl" in result.stderr and "hellaswag_text" in result.stderr, result.stderr
    own = tmp_path / "own"
    own.mkdir()
    (own / "mine.yaml").write_text("task: mine\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
                                   f"{own / 'gone.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
                                   "doc_to_text: '{{q}}'\ndoc_to_choice: ['a', 'b']\ndoc_to_target: 0\n")
    result = _run(["eval", source, "--tasks", "mine", "--include-path", own])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1
    assert "task mine" in result.stderr and "gone.jsonl" in result.stderr, result.stderr


@pytest.mark.parametrize("args, message", [
    (["--tasks", "piqa", "--limit", "1.5"], "--limit 1.5"),
    (["--tasks", "piqa", "--limit", "0"], "--limit 0"),
    (["--tasks", ",", "--limit", "2"], "give task names"),
    (["--tasks", "piqa", "--num-fewshot", "-1"], "--num-fewshot -1"),
    (["--tasks", "piqa", "--data", "default-eval"], "one of them"),
    ([], "one of them"),
    (["--tasks", "piqa", "--task-data", "/no/such/dir"], "--task-data /no/such/dir"),
    (["--tasks", "piqa", "--include-path", "/no/such/dir"], "--include-path /no/such/dir"),
    (["--data", "default-eval", "--protocol", "gptq", "--stride", "4"], "drop --stride"),
    (["--tasks", "piqa", "--log-samples"], "give --output-path"),
])
def test_bad_input_is_one_line(source, args, message):
    result = _run(["eval", source, *args])
    assert result.exit_code != 0 and result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1 and message in result.stderr, \
        result.stderr


def test_a_batch_whose_logits_do_not_fit_is_refused_before_any_request(source, monkeypatch):
    import tlm_io.harness

    monkeypatch.setattr(tlm_io.harness, "available_memory", lambda: 3 * 2**30)  # 3 GiB free
    monkeypatch.setattr(tlm_io.harness, "REQUEST_TOKENS", 2**20)  # the tiny vocabulary's logits made large
    result = _run(["eval", source, "--tasks", "piqa", "--batch-size", "8"])
    assert result.exit_code == 1 and result.stdout == "" and result.stderr.count("\n") == 1, result.stderr
    assert "--batch-size 8: lm-eval holds a batch's logits at once" in result.stderr
    assert "use --batch-size" in result.stderr, result.stderr


def test_without_lm_eval_the_command_names_the_extra(source, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed: importing it raises ImportError
    result = _run(["eval", source, "--tasks", "piqa"])
    assert result.exit_code == 1 and result.stdout == "" and result.stderr.count("\n") == 1
    assert 'pip install -e ".[eval]"' in result.stderr, result.stderr


@torch.no_grad()
def test_gptq_protocol_equals_a_hand_computation(tmp_path):
    """Documents joined by blank lines (empty records too), tokenized once with the tokenizer's <bos>, cut into
    non-overlapping windows of --seq-len, the tail dropped, the mean NLL over every window's seq-len - 1 targets."""
    src = make_source(tmp_path / "src", "llama", seed=4, tokenizer=tiny_tokenizer(bos=True))
    docs = ["Shall I compare thee to a summer's day?", "", "Thou art more lovely and more temperate.",
            "Rough winds do shake the darling buds of May, and summer's lease hath all too short a date."]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    result = _run(["eval", src, "--data", tmp_path / "docs.jsonl", "--protocol", "gptq", "--seq-len", 12])
    assert result.exit_code == 0, result.stderr
    line = json.loads(result.stdout)
    model, tokenizer, _ = load_model(str(src))
    ids = torch.tensor(tokenizer("\n\n".join(docs))["input_ids"])
    assert int(ids[0]) == tokenizer.bos_token_id and int((ids == tokenizer.bos_token_id).sum()) == 1
    n = len(ids) // 12
    nlls = [F.cross_entropy(model(ids[None, 12 * i:12 * (i + 1)]).logits[0, :-1].double(), ids[12 * i + 1:12 * (i + 1)])
            for i in range(n)]
    expected = math.exp(sum(float(x) for x in nlls) / n)  # every window scores 11 tokens: the mean of the means
    assert line["protocol"] == "gptq" and line["windows"] == n and line["scored_tokens"] == 11 * n
    assert line["perplexity"] == pytest.approx(expected, rel=1e-6)
    strided = _run(["eval", src, "--data", tmp_path / "docs.jsonl", "--seq-len", 12])
    assert json.loads(strided.stdout)["protocol"] == "strided"


def test_convert_reports_source_converted_and_healed_accuracy(source, tmp_path):
    from tlm_convert.convert import ConvertOptions, convert
    from tlm_convert.options import Method

    opts = ConvertOptions(calibration_data="default", calibration_tokens=1024, seq_len=32, method=Method(multiple_of=1),
                          heal_tokens=128, eval_tasks="winogrande", eval_data="eval-fiction", eval_tokens=512)
    report = convert(str(source), str(tmp_path / "out"), opts)
    entry = report["accuracy"]
    assert entry["tasks"] == ["winogrande"]
    for stage in ("source", "converted", "healed"):
        task = entry[stage]["tasks"]["winogrande"]
        assert 0 <= task["acc"] <= 1 and task["n"] == 500 and 0 < task["acc_stderr"] < 0.05
    assert entry["converted"]["retention"] == pytest.approx(entry["converted"]["mean"] / entry["source"]["mean"])
    saved = json.loads((tmp_path / "out" / "conversion_report.json").read_text())
    assert saved["accuracy"]["healed"] == entry["healed"]
    text = (tmp_path / "out" / "report.md").read_text()
    assert "zero-shot accuracy" in text and "winogrande (500 items)" in text and "% of the source" in text


def test_convert_refuses_eval_tasks_without_their_data(source, tmp_path):
    from tlm_convert.convert import ConvertOptions, convert
    from tlm_io.errors import ConversionError

    with pytest.raises(ConversionError, match="task hellaswag needs hellaswag.jsonl"):
        convert(str(source), str(tmp_path / "out"), ConvertOptions(eval_tasks="hellaswag", calibration_data="default"))
    assert not (tmp_path / "out").exists()
