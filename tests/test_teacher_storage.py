"""tlm_train.teacher.store_for_autocast: a frozen teacher's projections stored in bf16 give the outputs of the fp32
teacher under bf16 autocast bit for bit (tied head and embedding left alone); a model that reads a projection's
weight outside autocast keeps its weights; a bf16 heal takes the same steps with the teacher stored either way."""

import copy

import pytest
import torch
from torch import nn
from types import SimpleNamespace

import tlm_train.trainer as trainer_module
from tlm import TLMConfig, TLMForCausalLM
from tlm_train.recipe import recipe_from_dict
from tlm_train.teacher import store_for_autocast
from tlm_train.trainer import train

from test_losses import _short_text
from test_train import tiny_recipe


def _tiny(tied: bool, seed: int = 0) -> TLMForCausalLM:
    torch.manual_seed(seed)
    config = TLMConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                       tie_word_embeddings=tied)
    return TLMForCausalLM(config).eval().requires_grad_(False)


def _outputs(model, ids):
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        out = model(input_ids=ids, use_cache=False, output_hidden_states=True)
    return out.logits, out.hidden_states


@pytest.mark.parametrize("tied", [True, False])
def test_bf16_projections_give_the_fp32_teachers_outputs_bit_for_bit(tied):
    teacher = _tiny(tied)
    reference = copy.deepcopy(teacher)
    saved = store_for_autocast(teacher, torch.bfloat16, "cpu")
    layer_linears = [m for m in teacher.model.modules() if isinstance(m, nn.Linear)]
    assert layer_linears and all(m.weight.dtype == torch.bfloat16 for m in layer_linears)
    assert teacher.model.embed_tokens.weight.dtype == torch.float32  # the lookup is not autocast: kept
    assert (teacher.lm_head.weight.dtype == torch.float32) == tied  # tied to the embedding: kept
    expected = sum(p.numel() * 2 for m in layer_linears for p in m.parameters()) + (0 if tied else 300 * 32 * 2)
    assert saved == expected > 0
    assert all(p.dtype == torch.float32 for p in reference.parameters())
    for seed in range(3):
        ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(seed))
        got, want = _outputs(teacher, ids), _outputs(reference, ids)
        assert torch.equal(got[0], want[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert store_for_autocast(teacher, torch.bfloat16, "cpu") == 0  # already stored so: nothing to do


class _ReadsWeightInFp32(nn.Module):
    """A teacher whose forward uses a projection's weight outside autocast (as a custom mixer might)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.proj = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 50, bias=False)

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, use_cache=False):
        h = self.embed(input_ids)
        with torch.autocast("cpu", enabled=False):
            h = h @ self.proj.weight.float().T  # fp32: a bf16-stored weight would change it
        return SimpleNamespace(logits=self.head(h))


def test_a_teacher_that_reads_a_weight_in_fp32_keeps_its_weights():
    torch.manual_seed(0)
    teacher = _ReadsWeightInFp32().eval().requires_grad_(False)
    weights = {k: v.clone() for k, v in teacher.state_dict().items()}
    assert store_for_autocast(teacher, torch.bfloat16, "cpu") == 0
    for k, v in teacher.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, weights[k]), k


def _bf16_heal(tmp_path, name, student, teacher, text):
    """test_losses' tiny heal (12 steps, alpha 0.7, T 2) in bf16 autocast."""
    heal = tiny_recipe(tmp_path, name, train={"max_steps": 12, "precision": "bf16"},
                       data={"train": text, "eval_tokens": 66},
                       optim={"lr": 1e-3, "min_lr": 1e-3, "warmup_steps": 0, "decay": "constant"},
                       distill={"teacher": str(teacher.final_dir), "alpha": 0.7, "temperature": 2.0})
    del heal["model"], heal["tokenizer"]
    heal["init_from"] = str(student.final_dir)
    return train(recipe_from_dict(heal))


def test_a_bf16_heal_takes_the_same_steps_with_the_teacher_stored_in_bf16(tmp_path, monkeypatch):
    first = train(recipe_from_dict(tiny_recipe(tmp_path, "a", train={"max_steps": 2})))
    teacher = train(recipe_from_dict(tiny_recipe(tmp_path, "b", seed=5, train={"max_steps": 3})))
    text = _short_text(tmp_path)
    calls = []
    real = trainer_module.store_for_autocast

    def recording(*args):
        calls.append(real(*args))
        return calls[-1]

    monkeypatch.setattr(trainer_module, "store_for_autocast", recording)
    stored = _bf16_heal(tmp_path, "stored", first, teacher, text)
    assert len(calls) == 1 and calls[0] > 0
    monkeypatch.setattr(trainer_module, "store_for_autocast", lambda *args: 0)  # the teacher as loaded (fp32)
    kept = _bf16_heal(tmp_path, "kept", first, teacher, text)
    assert stored.losses == kept.losses and len(kept.losses) == 12
