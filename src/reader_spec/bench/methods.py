"""The decoding methods ``reader bench`` compares, behind one small interface.

Engine methods run on this package's engine with a registered drafter (or none: ``ar``, the reference);
``ar-transformers`` is ``ar`` through transformers' forward instead of the fast runner; ``hf*``
methods call ``transformers``' own ``generate`` on the loaded model. The fast runner packs the weights
of the model it runs, so engine methods get their own copy and the others an untouched one. Every method stops
where the engine stops (at ``max_new_tokens``, or at an end-of-sequence token, kept as the last token),
so outputs compare token for token. Adding an engine drafter is one line in ``drafters.registry``.
Peers run as their authors do: a fixed chain (``pld``) or the drafter's own tree size (``suffix``),
verified whole; ``reader`` sizes each tree from measured costs.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Protocol

import torch
from transformers.generation.streamers import BaseStreamer

from reader_spec.bench.results import REFERENCE
from reader_spec.config import GenerationConfig
from reader_spec.drafters import DRAFTERS, Drafter, DrafterSpec
from reader_spec.drafters.pld import DEFAULT_NUM_TOKENS
from reader_spec.drafters.retrieval.datastore import Datastore
from reader_spec.engine.decoder import supports
from reader_spec.engine.kernel_choice import ROW_BUCKETS
from reader_spec.engine.loop import DEFAULT_BUDGET, Engine, model_eos_ids, run_to_end
from reader_spec.loading import LoadedModel

OnFinish = Callable[[], None]


@dataclass(frozen=True)
class BenchSetup:
    """What every method is built from: one loaded target model, shared by all methods."""

    loaded: LoadedModel
    budget: int = DEFAULT_BUDGET
    draft: LoadedModel | None = None
    datastore: Datastore | None = None
    """Corpus for the ``reader`` method's datastore source (``--datastore``)."""
    sampling: GenerationConfig = field(default_factory=GenerationConfig)
    """Token choice for engine methods (greedy by default); its ``max_new_tokens`` is overridden."""
    runner: str = "auto"
    """The engine methods' forward (``ar-transformers`` always runs transformers')."""
    reuse_prefixes: bool = True
    """Whether engine methods prefill a later turn only past the text its earlier turn left cached."""

    @cached_property
    def engine_loaded(self) -> LoadedModel:
        """The model engine methods run: a copy where the fast runner will pack its weights."""
        if self.runner == "transformers" or not supports(self.loaded.model):
            return self.loaded
        return replace(self.loaded, model=copy.deepcopy(self.loaded.model))


@dataclass
class Generation:
    """One request's output and figures, in the same terms for every method."""

    tokens: list[int]
    accept_lengths: list[int]
    """Tokens each target-model step emitted, bonus included (plain decoding: all 1)."""
    drafted: int
    """Draft tokens the target model verified."""
    draft_seconds: float
    """Time spent proposing drafts, where the method lets it be measured apart (else 0)."""
    verify_seconds: float
    """Time in the target model's forward passes, prefill included."""
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    """Accepted draft tokens by the drafter's source that proposed them (engine methods)."""
    cached_tokens: int = 0
    """Prompt tokens an earlier request left in the cache, not prefilled (engine methods)."""


Steps = Generator[None, None, list[Generation]]
"""A method's run a piece at a time (an engine step, a group through ``transformers``' ``generate``):
each ``next`` runs one piece; the outputs, in prompt order, are what the generator returns."""


class Method(Protocol):
    can_batch: bool
    """False where the implementation only decodes one sequence at a time."""
    speculative: bool

    def warm_up(self, batch_size: int) -> None:
        """Run once before any timing: kernels, caches and cost measurements."""

    def reset(self) -> None:
        """Forget what earlier runs taught (response history, learned weights): each timed run then
        starts alike, and a repeat never drafts from the answers of the run it repeats."""

    def reserve(self, prompts: Sequence[list[int]], max_new_tokens: int, batch_size: int) -> None:
        """Allocate, before any timing, the memory a run over ``prompts`` keeps (an engine's cache)."""

    def steps(
        self, prompts: Sequence[list[int]], max_new_tokens: int, batch_size: int, on_finish: OnFinish
    ) -> Steps:
        """Outputs in prompt order (tokens chosen as the bench's sampling settings say), a piece at a
        time; ``on_finish`` is called once per finished request."""


def generate(
    method: Method, prompts: Sequence[list[int]], max_new_tokens: int, batch_size: int, on_finish: OnFinish
) -> list[Generation]:
    """A method's whole run at once."""
    return run_to_end(method.steps(prompts, max_new_tokens, batch_size, on_finish))


@dataclass(frozen=True)
class MethodSpec:
    build: Callable[[BenchSetup], Method]
    needs_draft_model: bool = False
    """Needs ``--draft-model``: left out of the default methods when none is given."""


class EngineMethod:
    """This package's engine; continuous batching, so every engine method can batch."""

    can_batch = True

    def __init__(
        self, engine: Engine, sampling: GenerationConfig, new_drafter: Callable[[], Drafter] | None = None
    ):
        self.engine = engine
        self.sampling = sampling
        self.new_drafter = new_drafter
        self.speculative = engine.budget > 0

    def warm_up(self, batch_size: int) -> None:
        # Every prefill's kernel choices too: made inside the first method's timed prompts, they
        # would slow it alone (1-2 s at 256-512 rows).
        self.engine.warm_up(batch_size, prompt_tokens=ROW_BUCKETS[-1])

    def reset(self) -> None:
        self.engine.forget_prefixes()
        if self.new_drafter is not None:
            self.engine.drafter = self.new_drafter()

    def reserve(self, prompts: Sequence[list[int]], max_new_tokens: int, batch_size: int) -> None:
        self.engine.reserve(batch_size, list(prompts), replace(self.sampling, max_new_tokens=max_new_tokens))

    def steps(
        self, prompts: Sequence[list[int]], max_new_tokens: int, batch_size: int, on_finish: OnFinish
    ) -> Steps:
        outputs = yield from self.engine.generate_stepwise(
            list(prompts),
            replace(self.sampling, max_new_tokens=max_new_tokens),
            batch_size=batch_size,
            on_finish=lambda _: on_finish(),
        )
        return [
            Generation(
                tokens=o.tokens,
                accept_lengths=list(o.stats.accept_lengths),
                drafted=o.stats.drafted,
                draft_seconds=o.stats.draft_seconds,
                verify_seconds=o.stats.prefill_seconds + o.stats.verify_seconds,
                accepted_by_source=dict(o.stats.accepted_by_source),
                cached_tokens=o.stats.cached_tokens,
            )
            for o in outputs
        ]


def engine_method(drafter: DrafterSpec | None = None, runner: str | None = None) -> MethodSpec:
    """A method on this engine with a registered drafter (None: plain decoding, ``ar``); ``runner``
    fixes the forward (default: the bench's)."""

    def build(setup: BenchSetup) -> Method:
        loaded = setup.loaded if runner == "transformers" else setup.engine_loaded
        chosen = runner or setup.runner
        if drafter is None:
            return EngineMethod(
                Engine(loaded, runner=chosen, reuse_prefixes=setup.reuse_prefixes), setup.sampling
            )

        def new_drafter() -> Drafter:
            return drafter.build(setup.datastore, setup.draft, chosen)

        engine = Engine(
            loaded,
            new_drafter(),
            budget=setup.budget if drafter.budget is None else drafter.budget,
            adaptive_budget=drafter.adaptive,
            runner=chosen,
            reuse_prefixes=setup.reuse_prefixes,
        )
        return EngineMethod(engine, setup.sampling, new_drafter)

    return MethodSpec(build, needs_draft_model=drafter is not None and drafter.needs_draft_model)


class HFMethod:
    """``model.generate(do_sample=False)`` of ``transformers``, with its own drafting options.

    Plain decoding batches with left padding in fixed groups (static batching); prompt lookup and
    assisted generation are batch-1 only in ``transformers``.
    """

    def __init__(self, loaded: LoadedModel, assistant: LoadedModel | None = None, **options):
        self.model = loaded.model
        self.eos = model_eos_ids(loaded.model, loaded.tokenizer)
        pad = loaded.tokenizer.pad_token_id
        self.pad = pad if pad is not None else (self.eos[0] if self.eos else 0)
        self.can_batch = not options and assistant is None
        self.speculative = not self.can_batch
        self.assistant = assistant.model if assistant is not None else None
        self.options = dict(options)
        if assistant is not None:
            self.options["assistant_model"] = assistant.model
            if _vocab_size(assistant) != _vocab_size(loaded):  # transformers: universal assisted decoding
                self.options |= {"tokenizer": loaded.tokenizer, "assistant_tokenizer": assistant.tokenizer}

    def warm_up(self, batch_size: int) -> None:
        size = batch_size if self.can_batch else 1
        generate(self, [[1, 2, 3, 4]] * size, 2, size, lambda: None)

    def reset(self) -> None:
        """``generate`` keeps nothing between calls."""

    def reserve(self, prompts: Sequence[list[int]], max_new_tokens: int, batch_size: int) -> None:
        """``generate`` allocates its cache in every call."""

    def steps(
        self, prompts: Sequence[list[int]], max_new_tokens: int, batch_size: int, on_finish: OnFinish
    ) -> Steps:
        if batch_size > 1 and not self.can_batch:
            raise ValueError("transformers' prompt lookup and assisted generation only run at batch size 1")
        results: list[Generation] = []
        for start in range(0, len(prompts), batch_size):
            group = prompts[start : start + batch_size]
            results += self._generate_group(group, max_new_tokens)
            for _ in group:
                on_finish()
            yield
        return results

    def _generate_group(self, prompts: Sequence[list[int]], max_new_tokens: int) -> list[Generation]:
        width = max(len(p) for p in prompts)
        device = self.model.device
        ids = torch.tensor([[self.pad] * (width - len(p)) + list(p) for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        steps = _StepLengths() if len(prompts) == 1 else None
        with _ForwardProbe(self.model) as target, _ForwardProbe(self.assistant) as draft:
            out = self.model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                num_beams=1,
                max_new_tokens=max_new_tokens,
                eos_token_id=list(self.eos),
                pad_token_id=self.pad,
                streamer=steps,
                **self.options,
            )
        rows = [_until_eos(row, self.eos) for row in out[:, width:].tolist()]
        if steps is None:  # plain decoding in a group: one token per sequence and step
            return [Generation(row, [1] * len(row), 0, 0.0, target.seconds) for row in rows]
        # Each forward reads the pending token plus the drafts (the first one the whole prompt).
        drafted = sum(target.input_lengths) - width - (len(target.input_lengths) - 1)
        lengths = _clip_lengths(steps.lengths, len(rows[0]))
        return [Generation(rows[0], lengths, drafted, draft.seconds, target.seconds)]


def hf_method(*, assisted: bool = False, **options) -> MethodSpec:
    """``transformers`` generation; ``options`` go to ``generate``, ``assisted`` adds the draft model."""

    def build(setup: BenchSetup) -> Method:
        if assisted and setup.draft is None:
            raise ValueError("hf-assisted needs a draft model (--draft-model)")
        if not setup.sampling.plain_greedy:
            raise ValueError("transformers methods are measured with greedy decoding only, without penalties")
        return HFMethod(setup.loaded, setup.draft if assisted else None, **options)

    return MethodSpec(build, needs_draft_model=assisted)


METHODS: dict[str, MethodSpec] = {
    "ar": engine_method(),
    "ar-transformers": engine_method(runner="transformers"),
    **{name: engine_method(spec) for name, spec in DRAFTERS.items()},
    "hf": hf_method(),
    "hf-pld": hf_method(prompt_lookup_num_tokens=DEFAULT_NUM_TOKENS),
    "hf-assisted": hf_method(assisted=True),
}
"""Every method ``reader bench`` knows; ``ar`` is the reference for speed and exactness."""


def method_names(methods: Sequence[str] | None, with_draft: bool) -> list[str]:
    """The methods to run, the reference first, no duplicates (default: all that need no missing draft
    model); unknown names fail before any model work."""
    names = (
        list(methods)
        if methods is not None
        else [name for name, spec in METHODS.items() if with_draft or not spec.needs_draft_model]
    )
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    missing = [m for m in names if METHODS[m].needs_draft_model and not with_draft]
    if missing:
        raise ValueError(f"{', '.join(missing)} needs a draft model (--draft-model)")
    return list(dict.fromkeys([REFERENCE, *names]))


class _StepLengths(BaseStreamer):
    """``generate`` streams the prompt first, then each step's new tokens: their counts are the steps."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.lengths.append(int(value.numel()))
        self._prompt_seen = True

    def end(self) -> None:
        pass


class _ForwardProbe:
    """Times a model's forward passes and records their input lengths, through hooks removed on exit."""

    def __init__(self, model: torch.nn.Module | None):
        self.model = model
        self.seconds = 0.0
        self.input_lengths: list[int] = []
        self._handles: list = []
        self._started = 0.0

    def __enter__(self) -> _ForwardProbe:
        if self.model is not None:
            self._handles = [
                self.model.register_forward_pre_hook(self._before, with_kwargs=True),
                self.model.register_forward_hook(self._after),
            ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _before(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.input_lengths.append(int(ids.shape[-1]) if ids is not None else 0)
        self._started = time.perf_counter()

    def _after(self, module, args, output) -> None:
        self.seconds += time.perf_counter() - self._started


def _vocab_size(loaded: LoadedModel) -> int:
    return loaded.model.config.get_text_config().vocab_size


def _until_eos(tokens: list[int], eos: Sequence[int]) -> list[int]:
    """Up to and including the first end-of-sequence token, as the engine stops."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def _clip_lengths(lengths: list[int], total: int) -> list[int]:
    """Step lengths cut where the kept output ends (``generate`` may accept past an eos)."""
    clipped = []
    for length in lengths:
        if total <= 0:
            break
        clipped.append(min(length, total))
        total -= length
    return clipped
