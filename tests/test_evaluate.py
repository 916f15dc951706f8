"""Strided-window perplexity: disjoint windows equal the block loss, overlapping windows score every token once
with the context a by-hand computation gives it."""

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import make_model
from tlm_io.perplexity import strided_perplexity, windows


def test_windows_score_every_token_once():
    for n, window, stride in [(20, 8, 8), (20, 8, 3), (21, 8, 5), (7, 8, 4), (16, 4, 1)]:
        scored = []
        for begin, end, first in windows(n, window, stride):
            assert end - begin <= window
            scored += list(range(begin + first, end))
        # overlapping windows score every token after the first; disjoint blocks cannot score a block's first token
        expected = [t for t in range(1, n) if stride < window or t % window != 0]
        assert scored == expected, (n, window, stride)


def test_disjoint_windows_equal_the_mean_block_loss():
    model = make_model()
    ids = torch.randint(0, 99, (40,), generator=torch.Generator().manual_seed(0))
    got = strided_perplexity(model, ids, window=8, stride=8, batch_size=3)
    blocks = ids.view(5, 8)
    with torch.no_grad():
        logits = model(blocks).logits
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), blocks[:, 1:].flatten())
    assert got.tokens == 35 and got.windows == 5
    assert got.nll == pytest.approx(float(nll), abs=1e-5) and got.perplexity == pytest.approx(math.exp(float(nll)))


def test_overlapping_windows_match_a_by_hand_computation():
    model = make_model()
    ids = torch.randint(0, 99, (19,), generator=torch.Generator().manual_seed(1))
    window, stride = 8, 3
    got = strided_perplexity(model, ids, window=window, stride=stride, batch_size=2)
    total = []
    with torch.no_grad():
        for t in range(1, 19):  # token t is predicted by the window that scores it, with that window's context
            for begin, end, first in windows(19, window, stride):
                if begin + first <= t < end:
                    logp = torch.log_softmax(model(ids[begin:end][None]).logits[0, t - begin - 1], -1)
                    total.append(-float(logp[ids[t]]))
    assert got.tokens == 18 and got.nll == pytest.approx(sum(total) / 18, abs=1e-5)


def test_bad_window_arguments_raise():
    model = make_model()
    with pytest.raises(ValueError, match="stride"):
        strided_perplexity(model, torch.arange(10), window=4, stride=5)
    with pytest.raises(ValueError, match="too few"):
        strided_perplexity(model, torch.arange(1), window=4)
