"""An engine that plays scripted text, for endpoint tests that need outputs the tiny random model
will not produce on demand (tool calls, junk blocks, stop sequences). It stands in for
RolloutEngine.stream only: the Session, the parser, the translators, the HTTP server and the SDKs
on the other side are the real ones, and token ids are the real tokenizer's."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from molt.trace.generation import GenerationDelta


@dataclass
class Script:
    chunks: list[str]  # the text, as the engine would deliver it step by step
    finish_reason: str = "stop"
    stop_reason: str | None = None
    error: Exception | None = None  # raised after the chunks, as an engine failure would be


@dataclass
class ScriptedEngine:
    tokenizer: object
    scripts: list[Script] = field(default_factory=list)  # played in order, one per request
    requests: list[dict] = field(default_factory=list)  # what each request asked for

    def play(self, *scripts: Script) -> None:
        self.scripts.extend(scripts)

    async def stream(self, token_ids, sampling, *, stop=None, seed=None, incremental=True, top_logprobs=None,
                     constraint=None, images=None):
        self.requests.append({"token_ids": list(token_ids), "sampling": sampling, "stop": stop, "seed": seed,
                              "top_logprobs": top_logprobs, "constraint": constraint, "images": images})
        script = self.scripts.pop(0)
        deltas = []
        for chunk in script.chunks:
            ids = self.tokenizer.encode(chunk, add_special_tokens=False) if chunk else []
            deltas.append(GenerationDelta(token_ids=ids, logprobs=[-0.5] * len(ids), text=chunk, finish_reason=None,
                                          top_logprobs=[[(i, -0.5)] for i in ids] if top_logprobs else None))
        if not incremental:
            deltas = [GenerationDelta(token_ids=[i for d in deltas for i in d.token_ids],
                                      logprobs=[p for d in deltas for p in d.logprobs],
                                      text="".join(d.text for d in deltas), finish_reason=None,
                                      top_logprobs=[t for d in deltas for t in d.top_logprobs or []] or None)]
        num_tokens = sum(len(d.token_ids) for d in deltas)
        deltas[-1].finish_reason = script.finish_reason
        deltas[-1].stop_reason = script.stop_reason
        deltas[-1].policy_versions = [0] * num_tokens
        if script.error is not None:
            deltas = deltas[:-1]
        for delta in deltas:
            await asyncio.sleep(0)
            yield delta
        if script.error is not None:
            raise script.error


class LoopThread:
    """An event loop in a background thread, for a server the (synchronous) SDK clients call."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine, timeout_seconds: float = 60):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_seconds)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class ScriptedEndpoint:
    """The real SessionEndpoint over a ScriptedEngine and the tiny model's tokenizer."""

    def __init__(self, tokenizer):
        from molt.endpoint.server import SessionEndpoint

        self.engine = ScriptedEngine(tokenizer)
        self.thread = LoopThread()
        self.endpoint = SessionEndpoint(self.engine, tokenizer, model_name="scripted")
        self.thread.run(self.endpoint.start())

    def open_session(self, *, max_tokens: int = 64, temperature: float = 1.0, max_length: int = 512):
        from molt.agents.base import SamplingParams

        return self.endpoint.open_session(sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature),
                                          max_length=max_length)

    def close(self) -> None:
        self.thread.run(self.endpoint.stop())
        self.thread.close()
