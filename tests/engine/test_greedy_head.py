"""The greedy head's token is the full float32 product's argmax, bit for bit, ties included."""

import pytest
import torch

from reader_spec.engine import kernels
from reader_spec.engine.greedy_head import GreedyHead
from reader_spec.engine.weights import ROW_BUCKETS, pack_linears


@pytest.fixture(scope="module", autouse=True)
def built():
    if not kernels.available():
        pytest.fail("the compiled kernels must build on this machine (make builds them)")


def head_of(weight: torch.Tensor, bounded: bool = True):
    """The packed layer and its greedy head, made to take the bounded int8 path at every row count
    where it may (``bounded``), whichever the timing would pick, or never."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight.clone()
    head, _ = pack_linears([linear])
    greedy = GreedyHead(head)
    greedy._wins_by_bucket = dict.fromkeys(ROW_BUCKETS, bounded)
    return head, greedy


def full_argmax(head, hidden: torch.Tensor) -> torch.Tensor:
    """What greedy decoding on the compiled product picks: the first of the largest logits."""
    return torch.ops.reader_spec.blocked_linear(hidden, head.weight, None, head.out_features).argmax(-1)


@pytest.mark.parametrize("bounded", [True, False])
@pytest.mark.parametrize("shape", [(1000, 64), (4100, 576), (37, 40)])  # vocabularies not a multiple of 32
def test_the_token_is_the_full_products_argmax_at_every_row_count(shape, bounded):
    """Beyond the last row bucket (80 rows), and where the timing picks it, the whole layer runs."""
    torch.manual_seed(0)
    head, greedy = head_of(torch.randn(shape) * 0.05, bounded)
    for rows in (1, 2, 3, 7, 8, 9, 16, 33, 80):
        hidden = torch.randn(rows, shape[1]) * 3
        assert torch.equal(greedy(hidden), full_argmax(head, hidden))


def test_equal_columns_give_the_first_index_and_near_equal_ones_the_larger():
    torch.manual_seed(1)
    weight = torch.randn(300, 64) * 0.05
    hidden = torch.randn(4, 64)
    best = int(full_argmax(*head_of(weight)[:1], hidden)[0])
    weight[[17, 250]] = weight[best] * 1.5  # two copies of a winning column: a tie int8 cannot resolve
    head, greedy = head_of(weight)
    assert torch.equal(greedy(hidden[:1]), torch.tensor([17]))
    # Columns one float32 step apart at one weight: the int8 copy cannot tell them apart, the product can.
    nudged = weight.clone()
    k = int(hidden[0].abs().argmax())
    nudged[250, k] = torch.nextafter(nudged[250, k], nudged[250, k] * 2 * hidden[0, k].sign())
    head, greedy = head_of(nudged)
    logits = torch.ops.reader_spec.blocked_linear(hidden[:1], head.weight, None, head.out_features)[0]
    assert logits[250] > logits[17]  # the nudge moved the product
    assert torch.equal(greedy(hidden), full_argmax(head, hidden))
    assert int(greedy(hidden[:1])[0]) == 250


def test_outliers_widen_the_bound_without_changing_the_token():
    """A column with one huge weight quantizes the rest of it coarsely: more candidates, same token."""
    torch.manual_seed(2)
    weight = torch.randn(2000, 96) * 0.05
    weight[::7, 3] = 40.0
    head, greedy = head_of(weight)
    hidden = torch.randn(64, 96)
    hidden[:, 3] = 0.0  # the outliers do not decide the logits; their quantization error does
    assert torch.equal(greedy(hidden), full_argmax(head, hidden))


def test_rows_that_are_not_finite_take_the_full_products_argmax():
    torch.manual_seed(3)
    head, greedy = head_of(torch.randn(500, 64))
    hidden = torch.randn(3, 64)
    hidden[1, 5] = float("inf")
    hidden[2, 9] = float("nan")
    assert torch.equal(greedy(hidden), head(hidden).argmax(-1))


def test_it_applies_to_float32_heads_without_bias_only():
    float_head, _ = pack_linears([torch.nn.Linear(64, 100, bias=False)])
    assert GreedyHead.applies(float_head)
    biased, _ = pack_linears([torch.nn.Linear(64, 100)])
    int8, _ = pack_linears([torch.nn.Linear(64, 100, bias=False)], weights="int8")
    assert not GreedyHead.applies(biased) and not GreedyHead.applies(int8)
