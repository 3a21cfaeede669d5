"""Prompt lookup decoding: the rule of transformers and vLLM, checked against a brute-force scan."""

from __future__ import annotations

import random

import pytest

from reader_spec.drafters.base import Drafter
from reader_spec.drafters.pld import CONFIDENCE, SOURCE, PromptLookupDrafter
from reader_spec.engine.loop import Engine
from reader_spec.engine.tree import EMPTY_PROPOSAL
from tests.engine.test_engine import NO_EOS, random_prompts


def brute_lookup(text: list[int], num_tokens: int, max_ngram: int, min_ngram: int) -> list[int]:
    """transformers' loop: n-gram sizes from the largest down, the first window with a continuation."""
    for n in range(min(max_ngram, len(text) - 1), min_ngram - 1, -1):
        suffix = text[-n:]
        for start in range(len(text) - n):
            if text[start : start + n] == suffix:
                return text[start + n : start + n + num_tokens]
    return []


def random_text(rng: random.Random, vocab: int) -> list[int]:
    text: list[int] = []
    while len(text) < rng.randint(1, 80):
        if text and rng.random() < 0.4:
            start = rng.randrange(len(text))
            text += text[start : start + rng.randint(1, 6)]
        else:
            text.append(rng.randrange(vocab))
    return text


@pytest.mark.parametrize("seed", range(6))
def test_matches_brute_force_rule(seed):
    rng = random.Random(seed)
    for _ in range(150):
        max_ngram = rng.randint(1, 5)
        min_ngram = rng.randint(1, max_ngram)
        num_tokens, budget = rng.randint(1, 12), rng.randint(1, 12)
        drafter = PromptLookupDrafter(num_tokens, max_ngram, min_ngram)
        text = random_text(rng, rng.choice([3, 10, 50]))
        split = rng.randint(1, len(text))
        drafter.begin("r", text[:split])
        drafter.extend("r", text[split:])
        proposal = drafter.propose("r", budget)
        expected = brute_lookup(text, min(num_tokens, budget), max_ngram, min_ngram)
        assert list(proposal.tokens) == expected
        if expected:
            assert proposal.parents == tuple(range(-1, len(expected) - 1))
            assert proposal.probs == (CONFIDENCE,) * len(expected)
            assert set(proposal.sources) == {SOURCE}
        else:
            assert proposal == EMPTY_PROPOSAL


def test_vllm_docstring_example_and_earliest_match():
    # vLLM: context [1,2,3,4,2,3], min 2, max 3, k 4 -> the 2-gram [2,3] matched, [4,2,3] proposed.
    drafter = PromptLookupDrafter(num_tokens=4, max_ngram=3, min_ngram=2)
    drafter.begin(0, [1, 2, 3, 4, 2, 3])
    assert drafter.propose(0, 16).tokens == (4, 2, 3)
    # The earliest occurrence of the longest match wins, as in both peers.
    drafter.begin(1, [7, 8, 1, 7, 8, 2, 7, 8])
    assert drafter.propose(1, 16).tokens == (1, 7, 8, 2)
    # A longer match beats an earlier shorter one.
    drafter.begin(2, [5, 8, 1, 7, 8, 2, 7, 8])
    assert drafter.propose(2, 16).tokens == (2, 7, 8)


def test_min_ngram_budget_and_lifecycle():
    drafter = PromptLookupDrafter(num_tokens=10, max_ngram=3, min_ngram=2)
    assert isinstance(drafter, Drafter)
    drafter.begin("a", [1, 2, 3, 9, 3])
    assert drafter.propose("a", 8) == EMPTY_PROPOSAL  # only a 1-gram repeats
    drafter.extend("a", [9, 3])
    assert drafter.propose("a", 1).tokens == (9,)
    assert drafter.propose("a", 0) == EMPTY_PROPOSAL
    drafter.observe("a", drafter.propose("a", 4), [0])
    drafter.end("a")
    with pytest.raises(KeyError):
        drafter.propose("a", 4)
    drafter.begin("b", [4])
    assert drafter.propose("b", 4) == EMPTY_PROPOSAL
    with pytest.raises(ValueError):
        PromptLookupDrafter(num_tokens=0)
    with pytest.raises(ValueError):
        PromptLookupDrafter(max_ngram=2, min_ngram=3)


@pytest.fixture(scope="module")
def plain(tiny):
    prompts = random_prompts(6, seed=3)
    return prompts, Engine(tiny).generate(prompts, NO_EOS)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_engine_output_equals_plain_decoding(tiny, plain, batch_size):
    prompts, reference = plain
    engine = Engine(tiny, PromptLookupDrafter(num_tokens=6), budget=6, adaptive_budget=False)
    outputs = engine.generate(prompts, NO_EOS, batch_size=batch_size)
    assert [o.tokens for o in outputs] == [o.tokens for o in reference]
    assert sum(o.stats.accepted for o in outputs) > 20  # drafts were verified and some accepted
