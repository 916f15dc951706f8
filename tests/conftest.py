import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# one intra-op thread per test process: the tensors are tiny, and pytest-xdist (setup.cfg) runs two processes
# on two cores (test_analyze.py set 1 at import before, which held for the whole session)
torch.set_num_threads(1)

import tlm  # noqa: E402  (registers the Auto classes)

MIXER_NAMES = ("attention", "gated_attention", "hope_attention", "titans")
# the mixers plus variants that change the numerics: Titans MAG with persistent tokens and a sliding window
MIXER_VARIANTS = MIXER_NAMES + ("titans_mag",)
VARIANT_CONFIG = {"titans_mag": dict(mixer="titans", titans_variant="mag", titans_persistent_tokens=3,
                                     sliding_window=5, layer_types=["sliding_attention", "full_attention",
                                                                    "sliding_attention"])}


def tiny_config(mixer="attention", schedule="uniform", **overrides) -> "tlm.TLMConfig":
    """Unit-test config: odd widths, GQA, small chunk sizes so short sequences cross chunk boundaries."""
    kwargs = dict(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        mixer=mixer,
        schedule=schedule,
        multiple_of=1,
        titans_num_heads=2,
        titans_head_dim=5,
        titans_chunk_size=4,
        hope_chunk_size=4,
        hope_inner_lr=0.05,
        max_position_embeddings=64,
    )
    kwargs.update(VARIANT_CONFIG.get(mixer, {}) if isinstance(mixer, str) else {})
    kwargs.update(overrides)
    return tlm.TLMConfig(**kwargs)


def randomize_(model: torch.nn.Module, scale: float = 0.05, seed: int = 0) -> torch.nn.Module:
    """Add noise to every parameter so zero-initialised gates and unit norms are exercised too."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model


def make_model(mixer="attention", seed=0, randomize=True, **overrides):
    torch.manual_seed(seed)
    model = tlm.TLMForCausalLM(tiny_config(mixer, **overrides)).eval()
    return randomize_(model, seed=seed) if randomize else model


@pytest.fixture
def ids():
    return torch.randint(0, 99, (2, 13), generator=torch.Generator().manual_seed(1))
