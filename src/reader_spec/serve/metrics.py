"""Prometheus metrics of one server: requests, tokens, queue, batch, steps and speculation by source."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from reader_spec.engine.sequence import Output, mean_accepted
from reader_spec.serve.service import StepRecord


class Metrics:
    """Every metric lives in the server's own registry, so that several servers in one process (tests)
    never share counts."""

    def __init__(self, max_batch_size: int) -> None:
        self.registry = registry = CollectorRegistry()
        self.max_batch_size = max_batch_size
        self.requests = Counter(
            "reader_requests", "Finished HTTP requests by status code", ["status"], registry=registry
        )
        self.prompt_tokens = Counter(
            "reader_prompt_tokens", "Prompt tokens of finished requests", registry=registry
        )
        self.cached_prompt_tokens = Counter(
            "reader_cached_prompt_tokens",
            "Prompt tokens of finished requests found in the cache (not prefilled)",
            registry=registry,
        )
        self.generated_tokens = Counter("reader_generated_tokens", "Tokens generated", registry=registry)
        self.queue_length = Gauge(
            "reader_queue_length", "Requests waiting for a batch slot", registry=registry
        )
        self.running = Gauge("reader_running_requests", "Requests decoding in the batch", registry=registry)
        self.occupancy = Gauge(
            "reader_batch_occupancy", "Running requests over the batch size", registry=registry
        )
        self.step_seconds = Histogram(
            "reader_step_seconds",
            "Seconds per engine step (one verification pass of the batch)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=registry,
        )
        self.steps = Counter(
            "reader_sequence_steps", "Verification steps summed over sequences", registry=registry
        )
        self.drafted = Counter("reader_draft_tokens_proposed", "Draft tokens proposed", registry=registry)
        self.accepted = Counter(
            "reader_draft_tokens_accepted", "Draft tokens accepted, by source", ["source"], registry=registry
        )
        self.mean_accepted = Gauge(
            "reader_mean_accepted_tokens",
            "Tokens emitted per verification step and sequence, bonus included (plain decoding: 1)",
            registry=registry,
        )
        self._tokens = 0
        self._steps = 0

    def record_step(self, record: StepRecord) -> None:
        self.step_seconds.observe(record.seconds)
        self.queue_length.set(record.waiting)
        self.running.set(record.running)
        self.occupancy.set(record.running / self.max_batch_size)
        for update in record.updates:
            if update.output is not None:
                self.record_output(update.output)

    def record_output(self, output: Output) -> None:
        stats = output.stats
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_prompt_tokens.inc(stats.cached_tokens)
        self.generated_tokens.inc(stats.new_tokens)
        self.steps.inc(stats.steps)
        self.drafted.inc(stats.drafted)
        for source, count in stats.accepted_by_source.items():
            self.accepted.labels(source=source).inc(count)
        self._tokens += stats.new_tokens
        self._steps += stats.steps
        self.mean_accepted.set(mean_accepted(self._tokens, self._steps))
