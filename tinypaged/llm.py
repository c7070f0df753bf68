"""``LLM``: the offline entry point, shaped like vLLM's (``LLM(model=...).generate(prompts, params)``)."""

from __future__ import annotations

import time
from contextlib import closing
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC

from tinypaged.config import EngineConfig
from tinypaged.llm_engine import LLMEngine
from tinypaged.outputs import RequestOutput, StreamOutput
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

    def _submit(self, prompts, sampling_params, arrival_times) -> list:
        """Tokenize and validate every request, then queue them all (nothing is queued if one is bad)."""
        single = isinstance(prompts, (str, dict))
        if not single and not isinstance(prompts, SequenceABC):
            raise TypeError(f"prompts must be a string, a dict with 'prompt' or 'prompt_token_ids', or a list of "
                            f"them; got {type(prompts).__name__}")
        prompts = [prompts] if single else list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, SequenceABC) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"Got {len(params)} SamplingParams for {len(prompts)} prompts")
        if arrival_times is not None and len(arrival_times) != len(prompts):
            raise ValueError(f"Got {len(arrival_times)} arrival_times for {len(prompts)} prompts")
        engine = self.llm_engine
        now = engine.clock()  # arrival times are offsets from now; requests already queued keep theirs
        arrivals = [now + t for t in (arrival_times or [0.0] * len(prompts))]
        requests = [engine.make_request(self._next_id(), p, sp, t) for p, sp, t in zip(prompts, params, arrivals)]
        for req in requests:
            engine.enqueue(req)
        return requests

    def _steps(self, pending: set[str]):
        """Step the engine until every request in ``pending`` has finished; yields each StepResult.

        If the caller stops early (an exception in a callback, KeyboardInterrupt in a notebook, a
        stream closed before the end), the requests still pending are aborted: their blocks are
        freed and the next call computes only its own tokens.
        """
        engine = self.llm_engine
        try:
            while pending:
                step = engine.step()
                pending.difference_update(out.request_id for out in step.finished)
                yield step
                if not step.scheduled:
                    _wait_for_next_arrival(engine)
        finally:
            if pending:
                engine.abort_request(list(pending))

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 arrival_times: list[float] | None = None, on_step=None) -> list[RequestOutput]:
        """Run prompts to completion; results come back in input order.

        Every request is validated before any work starts: a bad one raises ValueError naming it.
        ``arrival_times`` (seconds from now) replay a trace; ``on_step`` sees each StepResult.
        """
        requests = self._submit(prompts, sampling_params, arrival_times)
        order = {req.request_id: i for i, req in enumerate(requests)}
        results: list[RequestOutput | None] = [None] * len(requests)
        with closing(self._steps(set(order))) as steps:  # closing aborts what is left on any exception
            for step in steps:
                if on_step is not None:
                    on_step(step)
                for out in step.finished:
                    if out.request_id in order:  # requests added through the engine finish here too
                        results[order[out.request_id]] = out
        return results

    def generate_stream(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                        arrival_times: list[float] | None = None) -> Iterator[StreamOutput]:
        """Like ``generate``, but yields a StreamOutput for every sequence that got a token in a step,
        as soon as that step is done (the text delta is what a chat UI would append)."""
        requests = self._submit(prompts, sampling_params, arrival_times)
        tok = self.get_tokenizer()
        with closing(self._steps({req.request_id for req in requests})) as steps:
            yield from self._stream_pieces(steps, tok)

    @staticmethod
    def _stream_pieces(steps, tok) -> Iterator[StreamOutput]:
        sent: dict[int, int] = {}  # seq_id -> characters already streamed
        for step in steps:
            for seq in step.sampled:
                text, settled = _text_so_far(tok, seq)
                start = sent.get(seq.seq_id, 0)
                end = max(start, settled)
                sent[seq.seq_id] = end
                yield StreamOutput(seq.request_id, seq.index, text[start:end], [step.new_tokens[seq.seq_id]],
                                   seq.is_finished, seq.finish_reason, seq.stop_reason)

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
    waiting = engine.scheduler.waiting
    if waiting:
        delay = waiting[0].times.arrival - engine.clock()
        if delay > 0:
            time.sleep(min(delay, 0.05))


def _text_so_far(tok, seq) -> tuple[str, int]:
    """A sequence's text and how much of it is settled: a finished one is settled (cut at its stop
    string); a running one holds back a trailing partial UTF-8 character and, when it has stop
    strings, the last ``len(longest stop) - 1`` characters, which a stop string may still claim."""
    if seq.is_finished and isinstance(seq.stop_reason, str):
        return seq.text, len(seq.text)
    text = tok.decode(seq.output_token_ids, skip_special_tokens=True)
    if seq.is_finished:
        return text, len(text)
    settled = len(text.rstrip("\ufffd"))
    stops = seq.params.stop_strings
    if stops:
        settled = min(settled, len(text) - (max(map(len, stops)) - 1))
    return text, max(settled, 0)
