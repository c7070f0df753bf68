"""``LLM``: the offline entry point, shaped like vLLM's (``LLM(model=...).generate(prompts, params)``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import closing, contextmanager

from tinypaged.config import REMOVED, RENAMED, EngineConfig
from tinypaged.engine.detokenizer import TextStream
from tinypaged.engine.input_processor import check_batch, check_priorities
from tinypaged.engine.llm_engine import LLMEngine
from tinypaged.model.cpu_threads import ensure_cpu_threads
from tinypaged.outputs import RequestOutput, StreamOutput
from tinypaged.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger("tinypaged")


class LLM:
    """An engine plus a tokenizer. Keyword arguments are ``EngineConfig`` fields (vLLM's knob names).

    One call generates at a time: ``generate``, ``chat``, ``beam_search`` and an open ``generate_stream``
    hold the engine until they are done, and a second call meanwhile (another thread, an ``on_step``
    callback, a call while a stream is open) raises RuntimeError before any work; the first is unharmed.
    """

    def __init__(self, model: str = "smollm2-135m", **kwargs):
        for old in RENAMED.keys() & kwargs.keys():
            raise TypeError(f"LLM({old}=...) is gone: its decision is {RENAMED[old]}= now "
                            f"(e.g. LLM({RENAMED[old]}={kwargs[old]!r}))")
        for gone in REMOVED.keys() & kwargs.keys():
            raise TypeError(f"LLM({gone}=...) is gone: {REMOVED[gone]}")
        config = EngineConfig(model=model, **kwargs)
        if config.torch_device.type == "cpu":  # vLLM's CPU worker binds its threads at start-up: once per process here
            plan, applied = ensure_cpu_threads()
            if applied:
                logger.info("CPU threads: %s", plan.describe())
        self.llm_engine = LLMEngine(config)
        self._counter = 0
        self._busy = threading.Lock()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_metrics(self) -> dict:
        return self.llm_engine.get_metrics()

    def _next_id(self) -> str:
        """The next free id of this LLM's counter (ids queued through the engine directly are skipped)."""
        while str(self._counter) in self.llm_engine.requests:
            self._counter += 1
        self._counter += 1
        return str(self._counter - 1)

    @contextmanager
    def _generating(self):
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this LLM is already generating (a generate or chat call in another thread or in an "
                               "on_step callback, or a generate_stream not yet exhausted or closed); one LLM runs one "
                               "call at a time: wait for it, close the stream, or use a second LLM")
        try:
            yield
        finally:
            self._busy.release()

    def _submit(self, prompts, sampling_params, arrival_times, priority=None) -> list:
        """Tokenize and validate every request, then queue them all (nothing is queued if one is bad)."""
        prompts, params, offsets = check_batch(prompts, sampling_params, arrival_times)
        engine = self.llm_engine
        ranks = check_priorities(priority, len(prompts), engine.config.scheduling_policy)
        now = engine.clock()  # arrival times are offsets from now; requests already queued keep theirs
        requests = [engine.make_request(self._next_id(), p, sp, now + t, r)
                    for p, sp, t, r in zip(prompts, params, offsets, ranks)]
        engine.enqueue(requests)
        return requests

    def _steps(self, requests: list):
        """The engine's one loop (``LLMEngine.run_until_done``) over ``requests``: each StepResult until
        every one has finished; closing it early aborts the requests still pending."""
        return self.llm_engine.run_until_done([req.request_id for req in requests])

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 arrival_times: list[float] | None = None, on_step=None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; results come back in input order (``[]`` for no prompts).

        Every request is validated before any work starts: a bad one raises ValueError naming it.
        ``arrival_times`` (seconds from now) replay a trace; ``on_step`` sees each StepResult; ``priority``
        (vLLM's: one int per prompt, lower first; needs ``scheduling_policy="priority"`` unless all are 0).
        """
        if on_step is not None and not callable(on_step):
            raise TypeError(f"on_step must be a function taking each StepResult, or None; got {type(on_step).__name__}")
        with self._generating():
            requests = self._submit(prompts, sampling_params, arrival_times, priority)
            order = {req.request_id: i for i, req in enumerate(requests)}
            results: list[RequestOutput | None] = [None] * len(requests)
            with closing(self._steps(requests)) as steps:  # closing aborts what is left on any exception
                for step in steps:
                    if on_step is not None:
                        on_step(step)
                    for out in step.finished:
                        if out.request_id in order:  # requests added through the engine finish here too
                            results[order[out.request_id]] = out
            return results

    def generate_stream(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                        arrival_times: list[float] | None = None,
                        priority: list[int] | None = None) -> Iterator[StreamOutput]:
        """Like ``generate``, but yields a StreamOutput for every sequence that got a token in a step,
        as soon as that step is done (the text delta is what a chat UI would append). The stream holds
        the LLM from its first piece until it is exhausted or closed."""
        with self._generating():
            self.get_tokenizer()  # streams are text: a model without a tokenizer fails before anything is queued
            requests = self._submit(prompts, sampling_params, arrival_times, priority)
            with closing(self._steps(requests)) as steps:
                yield from self._stream_pieces(steps, self.llm_engine.detokenizer, requests)

    @staticmethod
    def _stream_pieces(steps, detokenizer, requests) -> Iterator[StreamOutput]:
        """Each sampled sequence's new text; a sequence that ended without a token (aborted, failed)
        gets one last piece with the rest of its text, so every sequence's stream ends with a finished piece."""
        seqs_of = {req.request_id: req.seqs for req in requests}
        stream = TextStream(detokenizer.stream_text)  # the pieces of text (the server's loops cut theirs alike)
        closed: set[int] = set()  # seq_ids whose finished piece was sent
        for step in steps:
            for seq in step.sampled:
                if seq.is_finished:
                    closed.add(seq.seq_id)
                yield StreamOutput(seq.request_id, seq.index, stream.piece(seq), [step.new_tokens[seq.seq_id]],
                                   seq.is_finished, _reason(seq), seq.stop_reason)
            for out in step.finished:
                for seq in seqs_of.get(out.request_id, ()):
                    if seq.seq_id not in closed:
                        closed.add(seq.seq_id)
                        yield StreamOutput(seq.request_id, seq.index, stream.piece(seq), [], True, _reason(seq),
                                           seq.stop_reason)

    def chat(self, messages, sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"}) or a list of them.
        Every message is checked first: a bad one raises naming it (``messages[i]`` or ``messages[c][i]``)."""
        conversations = _conversations(messages)
        tok = self.get_tokenizer()
        prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations]
        prompts = [{"prompt": p, "prompt_token_ids": tok.encode(p, add_special_tokens=False)} for p in prompts]
        return self.generate(prompts, sampling_params)

    def beam_search(self, prompts, params: BeamSearchParams):
        """Beam search over ``prompts`` with a ``BeamSearchParams`` (vLLM's ``LLM.beam_search``)."""
        from tinypaged.engine.beam_search import beam_search

        with self._generating():
            return beam_search(self.llm_engine, prompts, params)


def _conversations(messages) -> list[list[dict]]:
    """``chat``'s argument as a list of conversations, each message checked: a dict whose "role" and
    "content" are strings (the chat template reads both)."""
    usage = ('a conversation is a list of {"role": ..., "content": ...} dicts; chat takes one '
             'conversation or a list of them')
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a list: {usage}; got {type(messages).__name__}")
    single = bool(messages) and isinstance(messages[0], dict)
    conversations = [messages] if single else list(messages)
    for c, conversation in enumerate(conversations):
        where = "messages" if single else f"messages[{c}]"
        if not isinstance(conversation, (list, tuple)):
            raise TypeError(f"{where} must be a list of messages: {usage}; got {type(conversation).__name__}")
        for i, message in enumerate(conversation):
            if not isinstance(message, dict):
                raise TypeError(f"{where}[{i}] must be a dict with 'role' and 'content', "
                                f"got {type(message).__name__}")
            for key in ("role", "content"):
                if key not in message:
                    raise ValueError(f"{where}[{i}] has no {key!r}: {usage}")
                if not isinstance(message[key], str):
                    raise TypeError(f"{where}[{i}][{key!r}] must be a string, got {type(message[key]).__name__}")
    return conversations


def _reason(seq) -> str | None:
    return None if seq.finish_reason is None else str(seq.finish_reason)

