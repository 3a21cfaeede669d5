"""A request's replies: engine updates turned into OpenAI response objects, whole or streamed.

A choice's text is sent as it settles (an unfinished character or a possible stop string is held
back), with its log-probabilities where asked for; a client that goes away cancels its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from reader_spec.engine.loop import Update
from reader_spec.serve.logprobs import LogprobWriter
from reader_spec.serve.protocol import OpenAIError, finish_reason
from reader_spec.serve.service import EngineService, ShuttingDown, Stream

DISCONNECT_POLL_SECONDS = 0.25


class Choice:
    """One choice's updates: its tokens so far, the text already sent, the prompt it echoes, and its
    log-probabilities' writer where the request asked for them."""

    def __init__(self, index: int, stream: Stream, service: EngineService, tokenizer, config, prompt, echo):
        self.index, self.stream, self.service, self.tokenizer = index, stream, service, tokenizer
        self.prompt, self.echo, self.echoed = prompt, echo, False
        self.logprobs = None
        if config.logprobs is not None:  # an echo's log-probabilities start at the prompt's first token
            self.logprobs = LogprobWriter(tokenizer, [] if echo is not None else prompt)
        self.hold_back = max((len(s) for s in config.stop_strings), default=1) - 1
        self.tokens: list[int] = []
        self.cached_tokens = 0
        """Prompt tokens an earlier request left in the cache (OpenAI's ``cached_tokens``)."""
        self.sent = ""

    async def updates(self) -> AsyncIterator[Update]:
        """The request's updates until it finishes; cancels it if the caller stops listening."""
        done = False
        try:
            while True:
                item = await self.stream.updates.get()
                if item is None:
                    done = True
                    return
                if isinstance(item, ShuttingDown):
                    done = True
                    raise OpenAIError(503, str(item))
                if isinstance(item, Exception):
                    done = True
                    raise OpenAIError(500, "the engine failed on this request")
                self.tokens.extend(item.new_tokens)
                if item.output is not None:
                    self.cached_tokens = item.output.stats.cached_tokens
                yield item
        finally:
            if not done:
                self.service.cancel(self.stream.key)

    def delta(self, update: Update) -> str:
        """Text not sent yet that can no longer change: an unfinished character or the start of a
        stop string is held back until the next tokens settle it."""
        if update.output is not None:
            text = update.output.text
        else:
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True).rstrip("\ufffd")
            text = text[: len(text) - self.hold_back] if self.hold_back else text
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new

    def completion_delta(self, update: Update) -> str:
        """:meth:`delta`, after the echoed prompt in the first one."""
        text = self.delta(update)
        if self.echo is not None and not self.echoed:
            text, self.echoed = self.echo + text, True
        return text

    def logprobs_field(self, logprobs, chat: bool, prompt_logprobs=None) -> dict | None:
        """The response's ``logprobs`` for these tokens, after the echoed prompt's where given (None
        where the request did not ask, or no token came)."""
        if self.logprobs is None:
            return None
        if chat:
            return self.logprobs.chat(logprobs) if logprobs else None
        tokens, values = [], []
        if prompt_logprobs is not None:
            tokens, values = list(self.prompt), list(prompt_logprobs)
        if logprobs:
            tokens, values = tokens + [lp.token for lp in logprobs], values + list(logprobs)
        return self.logprobs.completion(tokens, values) if tokens else None

    async def output(self):
        output = None
        async for update in self.updates():
            output = update.output or output
        return output


class Reply:
    """Turns a request's choices' updates into OpenAI response objects, streamed or whole."""

    def __init__(self, prefix, kind, model, choices: list[Choice], n: int):
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.kind, self.model, self.created = kind, model, int(time.time())
        self.choices, self.n = choices, n
        """Every prompt's ``n`` choices, one prompt after the other."""

    def usage(self) -> dict:
        """Each prompt counted once, as OpenAI counts it for ``n`` choices, and its cached tokens those
        every choice of it found."""
        completion = sum(len(choice.tokens) for choice in self.choices)
        groups = [self.choices[i : i + self.n] for i in range(0, len(self.choices), self.n)]
        prompt = sum(group[0].stream.prompt_tokens for group in groups)
        cached = sum(min(c.cached_tokens for c in group) for group in groups)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def chunk(self, choice: dict) -> dict:
        kind = "chat.completion.chunk" if self.kind == "chat.completion" else self.kind
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    async def whole(self, request: Request, chat: bool) -> dict:
        """The finished response; a client that goes away first cancels the request."""
        collect = asyncio.ensure_future(asyncio.gather(*(choice.output() for choice in self.choices)))
        watcher = asyncio.ensure_future(wait_for_disconnect(request))
        await asyncio.wait({collect, watcher}, return_when=asyncio.FIRST_COMPLETED)
        watcher.cancel()
        if not collect.done():
            collect.cancel()  # each generator's clean-up cancels its request in the engine
            with contextlib.suppress(asyncio.CancelledError):
                await collect
            raise OpenAIError(499, "the client went away")
        choices = []
        for choice, output in zip(self.choices, collect.result(), strict=True):
            reason = finish_reason(output.finish_reason)
            logprobs = choice.logprobs_field(output.logprobs, chat, output.prompt_logprobs)
            if chat:
                message = {"role": "assistant", "content": output.text}
                choices.append(
                    {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": reason}
                )
            else:
                choices.append(
                    {
                        "index": choice.index,
                        "text": output.text if choice.echo is None else choice.echo + output.text,
                        "logprobs": logprobs,
                        "finish_reason": reason,
                    }
                )
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}  # fmt: skip

    async def stream(self, chat: bool, include_usage: bool) -> AsyncIterator[dict]:
        """The response's chunks: (chat) each choice's role, then every change to a choice's text,
        log-probabilities or finish reason, and the usage last where asked for."""
        if chat:
            for choice in self.choices:
                role = {"role": "assistant", "content": ""}
                yield self.chunk({"index": choice.index, "delta": role, "finish_reason": None})
        async for choice, update in self._updates():
            text = choice.delta(update) if chat else choice.completion_delta(update)
            reason = finish_reason(update.output.finish_reason) if update.output is not None else None
            logprobs = choice.logprobs_field(update.new_logprobs, chat, update.prompt_logprobs)
            if text or reason or logprobs:
                content = {"delta": {"content": text} if text else {}} if chat else {"text": text}
                yield self.chunk(
                    {"index": choice.index, **content, "logprobs": logprobs, "finish_reason": reason}
                )
        if include_usage:
            yield {**self.chunk({}), "choices": [], "usage": self.usage()}

    async def _updates(self) -> AsyncIterator[tuple[Choice, Update]]:
        """Every choice's updates as they come; a consumer that stops cancels the choices left."""
        if len(self.choices) == 1:
            async for update in self.choices[0].updates():
                yield self.choices[0], update
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for update in choice.updates():
                    await queue.put((choice, update))
                await queue.put((choice, None))
            except OpenAIError as error:
                await queue.put((choice, error))

        pumps = [asyncio.ensure_future(pump(choice)) for choice in self.choices]
        try:
            running = len(pumps)
            while running:
                choice, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, OpenAIError):
                    raise item
                else:
                    yield choice, item
        finally:
            for task in pumps:
                task.cancel()


async def wait_for_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)
