"""Acceptance rules walked over draft trees emit exactly what plain decoding would.

The sampling rule is checked statistically: thousands of seeded draws through a tree reproduce the
processed distribution of the model (chi-square against transformers' own processors), and a rule
broken on purpose is caught by the same test.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from reader_spec.config import GenerationConfig
from reader_spec.engine.acceptance import GreedyRule, SamplingRule, rule_for
from reader_spec.engine.sampling import pick, support
from reader_spec.engine.tree import DraftTree
from tests.engine.test_sampling import reference_log_probs

VOCAB = 10
HISTORY = [7, 8, 9, 7]
# Root -> tokens 0, 1, 2; token 0 -> 3, 4; token 1 -> 5.
TREE = DraftTree([7, 0, 1, 2, 3, 4, 5], [-1, 0, 0, 0, 1, 1, 2])
NODE_OF_FIRST = {0: 1, 1: 2, 2: 3}


def tree_logits(seed: int) -> torch.Tensor:
    """Random logits in which drafted tokens are likely, as they are when a drafter is any good."""
    logits = torch.randn(len(TREE), VOCAB, generator=torch.Generator().manual_seed(seed), device="cpu") * 1.5
    for node, children in enumerate(TREE.children):
        logits[node, list(children)] += 1.0
    return logits


def emitted(rule, logits) -> tuple[int, ...]:
    path, bonus = rule.select(TREE, logits.argmax(-1) if rule.argmax else logits, HISTORY)
    return tuple([TREE.tokens[n] for n in path[1:]] + [bonus])


def outcome_probs(logits: torch.Tensor, config: GenerationConfig) -> dict[tuple[int, ...], float]:
    """Exact probabilities of the first emitted token, and of the second one after a drafted first."""
    first = reference_log_probs(logits[0], config, HISTORY).exp()
    probs = {}
    for x1 in range(VOCAB):
        if x1 in NODE_OF_FIRST:
            second = reference_log_probs(logits[NODE_OF_FIRST[x1]], config, [*HISTORY, x1]).exp()
            probs.update({(x1, x2): float(first[x1] * second[x2]) for x2 in range(VOCAB)})
        else:
            probs[(x1,)] = float(first[x1])
    return probs


def chi_square_p_value(observed: Counter, probs: dict[tuple[int, ...], float]) -> float:
    draws = sum(observed.values())
    if any(probs.get(o, 0.0) == 0.0 for o in observed):
        return 0.0  # drew an outcome the distribution excludes
    cells = [(observed[o], p * draws) for o, p in probs.items() if p > 0]
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    degrees = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2), torch.tensor(statistic / 2)))


def sample_outcomes(make_rule, logits, draws: int, first_seed: int = 0) -> Counter:
    return Counter(emitted(make_rule(seed), logits)[:2] for seed in range(first_seed, first_seed + draws))


class TopKAcceptingRule(SamplingRule):
    """Deliberately wrong: accepts a drafted child whenever it is among the 3 most likely tokens."""

    def select(self, tree, logits, history):
        def choose(node: int) -> int:
            tokens, scores = support(logits[node], self.config)
            top3 = set(tokens[torch.topk(scores, min(3, len(tokens))).indices].tolist())
            drafted = [t for t in tree.children[node] if t in top3]
            position = len(history) + tree.depths[node]
            return drafted[0] if drafted else pick(logits[node], self.config, self.seed, position, None)

        return tree.walk(choose)


SETTINGS = [
    GenerationConfig(temperature=1.0),
    GenerationConfig(temperature=0.7, top_p=0.9),
    GenerationConfig(temperature=1.0, top_p=0.9),
    GenerationConfig(temperature=1.2, top_k=4, min_p=0.05, repetition_penalty=1.5),
    GenerationConfig(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.5),
]


@pytest.mark.parametrize("config", SETTINGS, ids=repr)
def test_tree_sampling_reproduces_the_processed_distribution(config):
    logits = tree_logits(1)
    observed = sample_outcomes(lambda seed: SamplingRule(config, seed), logits, draws=4000)
    assert chi_square_p_value(observed, outcome_probs(logits, config)) > 1e-3


def test_chi_square_passes_at_the_nominal_rate():
    """Forty independent samples of 400 draws: about 5% of the p-values fall below 0.05."""
    config = GenerationConfig(temperature=0.7, top_p=0.9)
    logits = tree_logits(2)
    probs = outcome_probs(logits, config)
    p_values = [
        chi_square_p_value(
            sample_outcomes(lambda seed: SamplingRule(config, seed), logits, 400, first_seed=400 * i), probs
        )
        for i in range(40)
    ]
    rejections = sum(p < 0.05 for p in p_values)
    assert rejections <= 8  # P(Binomial(40, 0.05) > 8) < 0.001
    assert sum(p > 0.5 for p in p_values) >= 10  # and the p-values are not all squeezed near zero


@pytest.mark.parametrize("config", SETTINGS[1:3], ids=repr)
def test_a_rule_broken_on_purpose_is_caught(config):
    logits = tree_logits(1)
    observed = sample_outcomes(lambda seed: TopKAcceptingRule(config, seed), logits, draws=4000)
    assert chi_square_p_value(observed, outcome_probs(logits, config)) < 1e-6


def test_draws_do_not_depend_on_the_tree():
    """The same seed emits the same tokens whether the truth was drafted, half-drafted or not at all."""
    config = GenerationConfig(temperature=1.0, top_p=0.9)
    logits = tree_logits(3)
    for seed in range(200):
        tokens = emitted(SamplingRule(config, seed), logits)
        if len(tokens) < 2:
            continue
        # Root with only the first emitted token drafted: the node's logits are the same as in TREE.
        node = NODE_OF_FIRST[tokens[0]]
        chain = DraftTree([7, tokens[0]], [-1, 0])
        _, bonus = SamplingRule(config, seed).select(chain, logits[[0, node]], HISTORY)
        assert (tokens[0], bonus) == tokens[:2]
        undrafted = DraftTree([7], [-1])
        assert SamplingRule(config, seed).select(undrafted, logits[:1], HISTORY) == ([0], tokens[0])


def test_repetition_penalty_sees_ancestors_not_siblings():
    # Node 2 (token 1) prefers token 0 narrowly; token 0 is node 2's sibling, not its context, so
    # no penalty applies and token 0 is the bonus. Penalizing the sibling would pick token 6 instead.
    logits = torch.full((len(TREE), VOCAB), -5.0)
    logits[0, 1] = 3.0
    logits[2, 0], logits[2, 6] = 2.0, 1.9
    config = GenerationConfig(repetition_penalty=2.0)
    assert SamplingRule(config, 0).select(TREE, logits, HISTORY) == ([0, 2], 0)
    # An ancestor is penalized: after token 1, a preferred token 1 loses to token 3.
    logits[2, 0], logits[2, 6], logits[2, 1], logits[2, 3] = -5.0, -5.0, 2.0, 1.5
    assert SamplingRule(config, 0).select(TREE, logits, HISTORY) == ([0, 2], 3)


@pytest.mark.parametrize(
    ("preferred", "bonus"),
    [
        (8, 8),  # in the prompt only: not penalized
        (7, 6),  # in the output (the history's last token)
        (1, 6),  # the node's own drafted token, an ancestor of what it picks
        (0, 0),  # a sibling's token: not in this node's context
    ],
)
def test_presence_and_frequency_penalties_count_the_output_and_ancestors_only(preferred, bonus):
    """At node 2 (token 1) the preferred token leads token 6 by 0.5; a frequency penalty of 1 on
    a token the node's output holds once turns the choice to token 6."""
    logits = torch.full((len(TREE), VOCAB), -5.0)
    logits[0, 1] = 3.0
    logits[2, preferred], logits[2, 6] = 2.0, 1.5
    rule = SamplingRule(GenerationConfig(frequency_penalty=1.0), 0, prompt_length=2)  # prompt [7, 8]
    assert rule.select(TREE, logits, HISTORY) == ([0, 2], bonus)


def test_rule_for_picks_the_batched_argmax_only_for_plain_greedy():
    assert isinstance(rule_for(GenerationConfig()), GreedyRule)
    assert isinstance(rule_for(GenerationConfig(repetition_penalty=1.1)), SamplingRule)
    assert isinstance(rule_for(GenerationConfig(presence_penalty=0.1)), SamplingRule)
    assert isinstance(rule_for(GenerationConfig(frequency_penalty=-0.1)), SamplingRule)
    assert isinstance(rule_for(GenerationConfig(logit_bias={3: -100})), SamplingRule)
    assert isinstance(rule_for(GenerationConfig(logprobs=0)), SamplingRule)  # log-probabilities need logits
    seeded = rule_for(GenerationConfig(temperature=0.5, seed=9))
    assert isinstance(seeded, SamplingRule) and seeded.seed == 9
    unseeded = [rule_for(GenerationConfig(temperature=0.5)).seed for _ in range(3)]
    assert len(set(unseeded)) == 3
