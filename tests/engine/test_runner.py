"""Tree verification equals sequential decoding through transformers, for each family and runner."""

import copy
from dataclasses import dataclass

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

import reader_spec.engine.decoder as decoder_module
import reader_spec.engine.runner as runner_module
from reader_spec.engine.attention import MOST_CALL_COST, PACKED_EAGER, PACKED_SDPA
from reader_spec.engine.greedy_head import UNNEEDED
from reader_spec.engine.layouts import dequantize_int4, quantize_int4
from reader_spec.engine.runner import ModelRunner, pack_weights, sliding_window_of
from reader_spec.engine.tree import DraftTree
from reader_spec.engine.weights import GROUPED_BITS, PackedLinear
from tests.conftest import KERNELS_MISSING, TEST_DEVICE

VOCAB = 64
SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2
)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SMALL, num_hidden_layers=2),
    "qwen2": lambda: Qwen2Config(**SMALL, num_hidden_layers=2),
    "qwen3": lambda: Qwen3Config(**SMALL, num_hidden_layers=2, head_dim=8),
    "mistral": lambda: MistralConfig(**SMALL, num_hidden_layers=2, sliding_window=6),
    "phi3": lambda: Phi3Config(**SMALL, num_hidden_layers=2, pad_token_id=0),
    # Some Phi-3 variants turn part of each head (Phi-4-mini: 0.75): the rest passes unrotated.
    "phi3-partial": lambda: Phi3Config(
        **SMALL, num_hidden_layers=2, pad_token_id=0, partial_rotary_factor=0.5
    ),
    # A window of 6 is far shorter than the contexts below, so the sliding layers really slide.
    "gemma2": lambda: Gemma2Config(
        **SMALL,
        num_hidden_layers=2,
        head_dim=8,
        sliding_window=6,
        attn_logit_softcapping=5.0,  # small, so that capping changes the scores
        final_logit_softcapping=3.0,
    ),
    "gemma3": lambda: Gemma3TextConfig(
        **SMALL,
        num_hidden_layers=4,
        head_dim=8,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
}
TOL = 1e-5


EAGER_ONLY = {"gemma2"}  # transformers has no sdpa attention for it
UNSUPPORTED = {("gemma2", "sdpa")}
RUNNERS = ("fast", "fast, pytorch ops", "sdpa", "eager", "one by one")  # the engine's decoder with its
# compiled operators between products, or PyTorch's (other devices and dtypes); transformers' forward
# with its attention packed (sdpa, eager) or verifying one sequence per forward, as models whose
# attention cannot run packed passes do


@dataclass
class Case:
    model: PreTrainedModel
    reference: PreTrainedModel
    """An untouched copy: sequential logits come from transformers' own forward."""
    runner: str


@pytest.fixture(
    scope="module",
    params=[(f, r) for f in sorted(CONFIGS) for r in RUNNERS if (f, r) not in UNSUPPORTED],
    ids=lambda p: "-".join(p),
)
def case(request):
    family, runner = request.param
    # The compiled ops run on a CPU only (float32): that case is built there whatever the test device.
    with torch.device("cpu" if runner == "fast" else TEST_DEVICE):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()
    default = "eager" if family in EAGER_ONLY else "sdpa"
    model.set_attn_implementation(
        default if runner in ("one by one", "fast", "fast, pytorch ops") else runner
    )
    return Case(model, copy.deepcopy(model), runner)


@pytest.fixture
def model(case):
    """The case, with the tensors a test and the runner build on the case's device."""
    with torch.device(case.model.device):
        yield case


def make_runner(case: Case, num_rows: int, capacity: int) -> ModelRunner:
    if case.runner.startswith("fast"):
        runner = ModelRunner(case.model, num_rows=num_rows, capacity=capacity, runner="fast")
        assert runner.name == "fast"
        if case.runner == "fast" and not runner.decoder.fused:
            pytest.fail(KERNELS_MISSING)
        runner.decoder.fused = case.runner == "fast"
        return runner
    runner = ModelRunner(case.model, num_rows=num_rows, capacity=capacity, runner="transformers")
    assert runner.packed and case.model.config._attn_implementation in (PACKED_SDPA, PACKED_EAGER)
    runner.packed = case.runner != "one by one"
    return runner


def full_logits(case: Case, tokens):
    with torch.no_grad():
        return case.reference(torch.tensor([tokens])).logits[0]


def random_tree_on_path(path_tokens, rng):
    """A tree whose main path is ``path_tokens`` plus decoy branches hanging off it."""
    tokens, parents, on_path = [path_tokens[0]], [-1], [0]
    for token in path_tokens[1:]:
        for _ in range(int(rng.integers(0, 3))):
            tokens.append(int(rng.integers(0, VOCAB)))
            parents.append(int(rng.choice(on_path)))
        tokens.append(token)
        parents.append(on_path[-1])
        on_path.append(len(tokens) - 1)
    return DraftTree(tokens, parents), on_path


def test_sliding_window_detection(model):
    expected = 6 if model.model.config.model_type in ("gemma2", "gemma3_text", "mistral") else None
    assert sliding_window_of(model.model.config) == expected


def test_a_packed_model_still_runs_its_own_forward(model):
    """The fast runner packs the weights in place; transformers' forward of that model still works."""
    tokens = list(range(3, 20))
    make_runner(model, num_rows=1, capacity=32)
    with torch.no_grad():
        own = model.model(torch.tensor([tokens])).logits[0]
    assert (own - full_logits(model, tokens)).abs().max() < TOL


def test_prefill_and_tree_logits_match_sequential(model):
    import numpy as np

    rng = np.random.default_rng(1)
    tokens = rng.integers(0, VOCAB, 30).tolist()
    reference = full_logits(model, tokens)
    runner = make_runner(model, num_rows=1, capacity=4)  # forces the cache to grow
    runner.prefill(0, tokens[:12])
    position = 12
    while position < 28:
        path = tokens[position : position + 5]
        tree, on_path = random_tree_on_path(path, rng)
        logits = runner.verify([tree], [0])[0]
        for depth, node in enumerate(on_path):
            assert (logits[node] - reference[position + depth]).abs().max() < TOL
        keep = int(rng.integers(1, len(on_path) + 1))
        runner.cache.commit(0, on_path[:keep])
        assert int(runner.cache.lengths[0]) == position + keep
        position += keep


@pytest.mark.parametrize("call_cost", [0, MOST_CALL_COST])  # by runs of equal width, or all padded (GPUs)
@pytest.mark.parametrize("rows", [range(7), (0, 1, 3, 4, 5, 8, 9)])  # free rows between sequences, or none
def test_ragged_batch_matches_each_sequence_alone(model, call_cost, rows, monkeypatch):
    """Trees of unequal widths, lone roots among them, side by side and in runs of equal width, in
    consecutive cache rows or with free rows between them."""
    import numpy as np

    monkeypatch.setattr(runner_module, "attention_call_cost", lambda *args: call_cost)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (3, 17, 9, 12, 8, 20, 5)]
    drafted = [4, 0, 0, 6, 1, 1, 3]  # path tokens after the root, plus decoys hanging off them
    references = [full_logits(model, p) for p in prompts]
    runner = make_runner(model, num_rows=10, capacity=32)
    lengths = [len(p) - 1 - d for p, d in zip(prompts, drafted, strict=True)]
    for row, prompt, n in zip(rows, prompts, lengths, strict=True):
        runner.prefill(row, prompt[:n])
    trees, paths = zip(
        *(
            random_tree_on_path(p[n:], rng) if d else (DraftTree([p[n]], [-1]), [0])
            for p, n, d in zip(prompts, lengths, drafted, strict=True)
        ),
        strict=True,
    )
    logits = runner.verify(list(trees), list(rows))
    for b in range(len(prompts)):
        assert logits[b].shape[0] == len(trees[b])
        for depth, node in enumerate(paths[b]):
            assert (logits[b][node] - references[b][lengths[b] + depth]).abs().max() < TOL


def test_greedy_rows_get_the_argmax_of_their_logits_beside_rows_that_get_logits(model):
    """A pass mixing greedy and sampling requests: each greedy tree gets its nodes' argmax tokens (on
    the fast runner through the greedy head, where the family has one), the others their logits."""
    import numpy as np

    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (9, 14, 6, 11)]
    runner = make_runner(model, num_rows=4, capacity=32)
    cpu = model.model.device.type == "cpu"
    if runner.decoder is not None:  # soft-capped logits (Gemma 2) keep the argmax of the whole layer;
        # the greedy head reads the CPU's blocked float32 layout: elsewhere the whole layer runs
        expected = cpu and model.model.config.model_type != "gemma2"
        assert (runner.decoder.greedy_head is not None) == expected
    for row, prompt in enumerate(prompts):
        runner.prefill(row, prompt[:-3])
    trees = [random_tree_on_path(p[-3:], rng)[0] for p in prompts]
    logits = runner.verify(trees, range(4))
    mixed = runner.verify(trees, range(4), [True, False, True, True])
    for row in (0, 2, 3):  # compared on the host: where the tokens are returned is the runner's choice
        tokens, best = mixed[row].cpu(), logits[row].argmax(-1).cpu()
        assert tokens.dtype == torch.long
        # a row below a rejected draft may be left unresolved: greedy acceptance never reads it
        assert ((tokens == best) | (tokens == UNNEEDED)).all()
        assert trees[row].walk(tokens.tolist().__getitem__) == trees[row].walk(best.tolist().__getitem__)
    if cpu or runner.decoder is None:  # transformers' forward gives every row's logits either way; the
        # fast decoder's output layer runs once per kind of row, and on a CPU a row's product does not
        # depend on the other rows of the call
        assert torch.equal(mixed[1], logits[1])
    else:  # a GPU's matrix product may pick another kernel for fewer rows: an ulp or so apart
        assert mixed[1].shape == logits[1].shape and (mixed[1] - logits[1]).abs().max() < TOL


def test_a_freed_row_serves_the_next_sequence_and_no_other_row_moves(model):
    first, second, third = list(range(5, 25)), list(range(30, 42)), list(range(3, 20))
    runner = make_runner(model, num_rows=2, capacity=32)
    runner.prefill(0, first[:15])
    runner.prefill(1, second[:10])
    layer = runner.cache.layers[0]
    kept = layer.keys[1, :, :10].clone()
    runner.prefill(0, third[:12])  # the first sequence finished; the next one takes its row
    assert torch.equal(layer.keys[1, :, :10], kept)
    trees = [DraftTree(third[12:15], [-1, 0, 1]), DraftTree(second[10:12], [-1, 0])]
    logits = runner.verify(trees, [0, 1])
    assert (logits[0] - full_logits(model, third)[12:15]).abs().max() < TOL
    assert (logits[1] - full_logits(model, second)[10:12]).abs().max() < TOL


def test_a_row_holding_a_prefix_prefills_only_what_follows(model, monkeypatch):
    """Prefix reuse: a row decoded one text, the next request shares its first 12 tokens and then
    differs; the row keeps those 12, the stale entries past them are overwritten, and the new text's
    logits are a fresh prefill's."""
    monkeypatch.setattr(runner_module, "PREFILL_CHUNK", 4)
    earlier, later = list(range(5, 30)), [*range(5, 17), *range(40, 52)]
    runner = make_runner(model, num_rows=1, capacity=32)
    runner.prefill(0, earlier[:8])
    for token in earlier[8:20]:  # decoded a token at a time, as plain decoding leaves a row
        runner.verify([DraftTree([token], [-1])], [0])
        runner.cache.commit(0, [0])
    forward, passed = runner._forward, []

    def counted(rows, input_ids, *args, **kwargs):
        passed.append(len(input_ids))
        return forward(rows, input_ids, *args, **kwargs)

    monkeypatch.setattr(runner, "_forward", counted)
    runner.prefill(0, later[:-3], reused=12)
    monkeypatch.undo()
    assert sum(passed) == len(later) - 3 - 12 and int(runner.cache.lengths[0]) == len(later) - 3
    logits = runner.verify([DraftTree(later[-3:], [-1, 0, 1])], [0])[0]
    assert (logits - full_logits(model, later)[-3:]).abs().max() < TOL
    with pytest.raises(ValueError, match="cannot reuse"):
        runner.prefill(0, later[:5], reused=6)


def test_chunked_prefill_matches(model, monkeypatch):
    monkeypatch.setattr(runner_module, "PREFILL_CHUNK", 4)
    tokens = list(range(1, 19))
    runner = make_runner(model, num_rows=1, capacity=32)
    runner.prefill(0, tokens[:-1])
    logits = runner.verify([DraftTree(tokens[-1:], [-1])], [0])[0]
    assert (logits[0] - full_logits(model, tokens)[-1]).abs().max() < TOL


@pytest.mark.parametrize("compiled_attention", [True, False])
def test_a_prompt_chunk_matches_with_either_attention(model, compiled_attention, monkeypatch):
    """A chunk longer than ``NATIVE_ROWS`` runs the compiled attention and whole layers where they timed
    faster than PyTorch's kernel, else the layer-by-layer path: both give transformers' logits."""
    import numpy as np

    monkeypatch.setattr(decoder_module, "compiled_attention_wins", lambda *args: compiled_attention)
    planned, plan = [], decoder_module.FastDecoder._plan

    def planning(self, cache, widths, *args):
        planned.append(sum(widths))
        return plan(self, cache, widths, *args)

    monkeypatch.setattr(decoder_module.FastDecoder, "_plan", planning)
    tokens = np.random.default_rng(5).integers(0, VOCAB, decoder_module.NATIVE_ROWS + 40).tolist()
    runner = make_runner(model, num_rows=1, capacity=128)
    runner.prefill(0, tokens[:-1])
    logits = runner.verify([DraftTree(tokens[-1:], [-1])], [0])[0]
    assert (logits[0] - full_logits(model, tokens)[-1]).abs().max() < TOL
    if model.runner == "fast":
        assert (max(planned) > decoder_module.NATIVE_ROWS) == compiled_attention


def test_steps_write_in_place_without_reallocating(model):
    runner = make_runner(model, num_rows=2, capacity=64)
    runner.prefill(0, [1, 2, 3, 4])
    runner.prefill(1, [5, 6])
    layer = runner.cache.layers[0]
    pointers = (layer.keys.data_ptr(), layer.values.data_ptr())
    for _ in range(5):
        tree = DraftTree([7, 8, 9], [-1, 0, 0])
        runner.verify([tree, tree], [0, 1])
        runner.cache.commit(0, [0, 2])
        runner.cache.commit(1, [0])
    assert (layer.keys.data_ptr(), layer.values.data_ptr()) == pointers
    assert runner.cache.lengths[:2].tolist() == [14, 7]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_an_int8_copy_of_a_packed_model_verifies_close_to_float32(family, on_cpu):
    """A draft model: a copy of a model the fast runner packed (float32), packed again as int8 (fused,
    tied and soft-capped families alike). Its tree logits are close to the float32 model's and to its
    own transformers forward's (within 1e-4, not 1e-5: int8 products round each input row to
    integers, and inputs an ulp apart, as the two forwards compute them, can round a step apart); the
    float32 model is untouched."""
    from reader_spec.engine.decoder import FastDecoder

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()
    model.set_attn_implementation("eager" if family in EAGER_ONLY else "sdpa")
    case = Case(model, copy.deepcopy(model), "fast")
    tokens = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1), device="cpu").tolist()
    chain = DraftTree(tokens[9:], list(range(-1, 10)))
    make_runner(case, num_rows=1, capacity=32).prefill(0, tokens[:9])  # packs float32 in place
    draft = copy.deepcopy(model)
    del draft._reader_fast_decoder
    draft._reader_fast_decoder = FastDecoder(draft, weight_format="int8")
    runner = make_runner(Case(draft, draft, "fast"), num_rows=1, capacity=32)
    runner.prefill(0, tokens[:9])
    logits = runner.verify([chain], [0])[0]
    expected = full_logits(case, tokens)[9:]
    assert 0 < (logits - expected).abs().max() < 0.1 * expected.abs().max()
    with torch.no_grad():
        assert (draft(torch.tensor([tokens])).logits[0][9:] - logits).abs().max() < 1e-4
        assert (model(torch.tensor([tokens])).logits[0] - full_logits(case, tokens)).abs().max() < TOL


def test_the_forward_fingerprint_covers_every_engine_module_a_pass_imports():
    """Found from the imports: the modules a pass reaches only through others are there too, and the
    loop's own bookkeeping (which never runs inside a pass) is not."""
    from reader_spec.engine.runner import forward_sources

    names = {path.stem if path.stem != "__init__" else path.parent.name for path in forward_sources()}
    indirect = {"memory", "timing", "layouts", "rotary", "greedy_head"}  # not imported by runner.py itself
    assert {"runner", "decoder", "kv_cache", "attention", "tree", "kernels", *indirect} <= names
    assert not names & {"loop", "scheduler", "sampling", "acceptance", "sequence"}


def test_the_forward_fingerprint_changes_with_the_code_a_pass_runs(monkeypatch, tmp_path):
    """Cost curves are cached under it: curves timed with older kernels are timed again."""
    from reader_spec.engine import kernels
    from reader_spec.engine.runner import forward_fingerprint

    without = forward_fingerprint()
    kernel = tmp_path / "kernel.cpp"
    monkeypatch.setattr(kernels, "SOURCES", [*kernels.SOURCES, kernel])
    fingerprints = []
    try:
        for text in ("// one version", "// another"):
            kernel.write_text(text)
            forward_fingerprint.cache_clear()
            fingerprints.append(forward_fingerprint())
    finally:
        forward_fingerprint.cache_clear()
    assert len({without, *fingerprints}) == 3


LLAMA_SHAPED = {"llama", "mistral", "phi3", "qwen2", "qwen3"}
"""Families whose layers run whole as one compiled call (RMSNorm, SiLU, no norms after the blocks)."""


class _CountingStack:
    """The compiled layers, counting their calls (to know the whole-layer path really ran)."""

    def __init__(self, stack):
        self.stack, self.calls = stack, 0

    def forward(self, *args):
        self.calls += 1
        return self.stack.forward(*args)


@pytest.mark.parametrize("kernel", ["compiled", "reading ahead"])
@pytest.mark.parametrize("weights", ["float32", "int8"])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_whole_compiled_layers_compute_the_bits_of_the_layer_by_layer_path(
    family, weights, kernel, on_cpu, monkeypatch
):
    """Prefill, ragged batches of trees and commits, through whole compiled layers and through the
    ops one by one: the same logits, bit for bit (so either may run any pass of a request), with the
    products requesting their weights ahead or not."""
    import numpy as np

    from reader_spec.engine import kernel_choice
    from reader_spec.engine import weights as weights_module
    from reader_spec.engine.runner import pack_weights

    Kernel = kernel_choice.Kernel
    forced = Kernel.READING_AHEAD if kernel == "reading ahead" else Kernel.COMPILED
    monkeypatch.setattr(weights_module, "fastest_kernel", lambda matrices, rows, same_pass: forced)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()
    model.set_attn_implementation("eager" if family in EAGER_ONLY else "sdpa")
    runners = []
    for native in (True, False):
        copied = copy.deepcopy(model)
        if weights == "int8":
            pack_weights(copied, "int8")
        runner = ModelRunner(copied, num_rows=4, capacity=48, runner="fast")
        if not runner.decoder.fused:
            pytest.fail(KERNELS_MISSING)
        runner.decoder.native = native
        runners.append(runner)
    decoder = runners[0].decoder
    assert all(layer.native is not None for layer in decoder.layers) == (family in LLAMA_SHAPED)
    assert (decoder.stack is not None) == (family in LLAMA_SHAPED)
    counters = []
    if decoder.stack is not None:
        decoder.stack = _CountingStack(decoder.stack)
        counters.append(decoder.stack)
    rng = np.random.default_rng(3)
    rows = [0, 1, 3]
    for runner in runners:
        for row, length in zip(rows, (9, 14, 5), strict=True):
            runner.prefill(row, np.random.default_rng(row).integers(0, VOCAB, length).tolist())
    for _ in range(3):
        drafts = [random_tree_on_path(rng.integers(0, VOCAB, 4).tolist(), rng) for _ in rows]
        trees = [tree for tree, _ in drafts]
        kept = [path[: int(rng.integers(1, len(path) + 1))] for _, path in drafts]
        outputs = [runner.verify(trees, rows) for runner in runners]
        for native, layered in zip(*outputs, strict=True):
            assert torch.equal(native, layered)
        for runner in runners:
            for row, path in zip(rows, kept, strict=True):
                runner.cache.commit(row, path)
    assert all(counter.calls > 0 for counter in counters)


def as_if_from_a_4_bit_file(model: PreTrainedModel) -> None:
    """Every layer matrix but the MLP's down projection rounded as GGUF's Q4_1 stores it, so that
    ``int4`` packs those in 4 bits and the down projections in 8 bits per group (both grouped kernels)."""
    for name, module in model.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith("down_proj"):
            with torch.no_grad():
                module.weight.copy_(dequantize_int4(*quantize_int4(module.weight)))


@pytest.mark.parametrize("weights", ["float32", "int4"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_a_team_of_threads_computes_the_bits_of_one_thread(family, weights, on_cpu, monkeypatch):
    """Passes of a few rows run every layer as one team of threads (DecoderStack): each thread keeps
    its own copy of the residual stream, adds the last product's output and norms it, and takes its
    share of every step, the threads waiting for each other between steps; a prompt of 300 rows, or
    one thread, runs step by step on one stream. Caches and logits must be the same bits at one, two
    and three threads (three: shares of unequal sizes), for float32 matrices and for matrices quantized
    per group (a self-draft's: each member rounds the rows itself)."""
    import numpy as np

    from reader_spec.engine import kernel_choice
    from reader_spec.engine import weights as weights_module

    compiled = kernel_choice.Kernel.COMPILED
    monkeypatch.setattr(weights_module, "fastest_kernel", lambda matrices, rows, same_pass: compiled)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()
    if weights == "int4":
        as_if_from_a_4_bit_file(model)
    threads = torch.get_num_threads()
    caches, logits = [], []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            copied = copy.deepcopy(model)
            if weights == "int4":
                pack_weights(copied, "int4")
                formats = {m.weight_format for m in copied.modules() if isinstance(m, PackedLinear)}
                assert set(GROUPED_BITS) <= formats  # both grouped kernels run
            runner = ModelRunner(copied, num_rows=2, capacity=320, runner="fast")
            assert runner.decoder.stack is not None
            rng = np.random.default_rng(4)
            runner.prefill(0, rng.integers(0, VOCAB, 300).tolist())  # one stream at any thread count
            runner.prefill(1, rng.integers(0, VOCAB, 7).tolist())
            passes = []
            for _ in range(3):
                drafts = [random_tree_on_path(rng.integers(0, VOCAB, 3).tolist(), rng) for _ in range(2)]
                passes.append(runner.verify([tree for tree, _ in drafts], [0, 1]))
                for row, (_, path) in enumerate(drafts):
                    runner.cache.commit(row, path[:2])
            caches.append([layer.keys.clone() for layer in runner.cache.layers])
            logits.append(passes)
    finally:
        torch.set_num_threads(threads)
    for threads_caches, threads_logits in zip(caches[1:], logits[1:], strict=True):
        for one, many in zip(caches[0], threads_caches, strict=True):
            assert torch.equal(one, many)
        for one, many in zip(logits[0], threads_logits, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(one, many, strict=True))
