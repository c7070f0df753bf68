"""``LLM``: the offline entry point, shaped like vLLM's (``LLM(model=...).generate(prompts, params)``)."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from tinypaged.config import EngineConfig
from tinypaged.llm_engine import LLMEngine
from tinypaged.outputs import RequestOutput
from tinypaged.sampling_params import SamplingParams


class LLM:
    """An engine plus a tokenizer. Keyword arguments are ``EngineConfig`` fields (vLLM's knob names)."""

    def __init__(self, model: str = "smollm2-135m", **kwargs):
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._counter = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_metrics(self) -> dict:
        return self.llm_engine.get_metrics()

    def _next_id(self) -> str:
        self._counter += 1
        return str(self._counter - 1)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 arrival_times: list[float] | None = None, on_step=None) -> list[RequestOutput]:
        """Run prompts to completion; results come back in input order.

        Every request is validated before any work starts: a bad one raises ValueError naming it.
        ``arrival_times`` (seconds from now) replay a trace; ``on_step`` sees each StepResult.
        """
        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, SequenceABC) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"Got {len(params)} SamplingParams for {len(prompts)} prompts")
        engine = self.llm_engine
        engine.reset_clock()
        arrivals = arrival_times or [0.0] * len(prompts)
        requests = [engine.make_request(self._next_id(), p, sp, t) for p, sp, t in zip(prompts, params, arrivals)]
        for req in requests:
            engine.enqueue(req)
        order = {req.request_id: i for i, req in enumerate(requests)}
        results: list[RequestOutput | None] = [None] * len(requests)
        while engine.has_unfinished_requests():
            step = engine.step()
            if on_step is not None:
                on_step(step)
            for out in step.finished:
                results[order[out.request_id]] = out
            if not step.scheduled:
                _wait_for_next_arrival(engine)
        return results

    def chat(self, messages, sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"}) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations]
        prompts = [{"prompt": p, "prompt_token_ids": tok.encode(p, add_special_tokens=False)} for p in prompts]
        return self.generate(prompts, sampling_params)

    def beam_search(self, prompts, params):
        from tinypaged.beam_search import beam_search

        return beam_search(self.llm_engine, prompts, params)


def _wait_for_next_arrival(engine: LLMEngine) -> None:
    import time

    waiting = engine.scheduler.waiting
    if waiting:
        delay = waiting[0].times.arrival - engine.clock()
        if delay > 0:
            time.sleep(min(delay, 0.05))
