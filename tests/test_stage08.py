"""Stage 8's assignment: the server streams through the function given to ``create_app(stream=...)``, and the checks
of ``sse_stream`` can fail where it matters (a stream that never aborts, one that forgets ``[DONE]``).

The generic properties (the reference passes, a stub is "not implemented yet", the reference is refused, hidden
cases depend on the seed) are in tests/test_checks.py; grading the solution and the exercise is in
tests/test_grading.py."""

import ast
import inspect
import textwrap
import types

from tinypaged.course import checks
from tinypaged.entrypoints import streaming


def learners_copy(**replace):
    """The reference's code under the learner's name, with some of its helpers replaced."""
    names = dict(vars(streaming), **replace)
    return types.FunctionType(streaming.sse_stream.__code__, names, "sse_stream")


def without_finally(fn):
    """``fn`` (a function of ``streaming``) rebuilt from its own source with its ``try``'s ``finally`` dropped."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    body = tree.body[0].body
    i = next(k for k, node in enumerate(body) if isinstance(node, ast.Try))
    body[i:i + 1] = body[i].body
    scope = dict(vars(streaming))
    exec(compile(tree, "<never_aborts>", "exec"), scope)
    return scope[fn.__name__]


# the reference's stream without its ``finally``: a client that hangs up leaves its requests running
never_aborts = without_finally(streaming.sse_stream)


def test_a_stream_that_never_aborts_fails_on_the_hang_up_and_the_error():
    status, msg = checks.evaluate("sse_stream", never_aborts, detect=False)
    assert status == checks.FAIL and "requests aborted" in msg and "expected [" in msg, msg
    status, msg = checks.evaluate("sse_stream", never_aborts, hidden=24680, detect=False)
    assert status == checks.FAIL, msg


def test_serving_a_stream_that_never_aborts_fails_on_the_hang_up():
    """The server's engine counts no aborted request: the hung-up request ran (slowly) to its end."""
    status, msg = checks.evaluate("serve_sse", never_aborts, detect=False)
    assert status == checks.FAIL and "the engine aborted its request (once): expected true, got false" in msg, msg


def test_a_stream_without_done_fails_naming_the_lines():
    status, msg = checks.evaluate("sse_stream", learners_copy(DONE="data: [done]\n\n"), detect=False)
    assert status == checks.FAIL and "the stream's lines" in msg and "case 'a completion, with usage'" in msg, msg


def test_the_server_streams_through_the_given_function():
    """serve_sse on a copy of the reference (so the server's default is not what runs): full marks over HTTP, and
    every line the clients got went through the copy's ``sse_line``."""
    sent = []

    def counting_line(obj):
        sent.append(obj)
        return streaming.sse_line(obj)

    status, msg = checks.evaluate("serve_sse", learners_copy(sse_line=counting_line), detect=False)
    assert status == checks.PASS, msg
    assert len(sent) >= 2 * 8 + 1 and any(s.get("usage") for s in sent if isinstance(s, dict))


def test_student_edition_hands_the_stream_over_and_closes_it_on_hang_up(monkeypatch):
    """In the student edition ``sse_stream`` stays an async generator that yields the learner's lines, and closing
    it early closes theirs at once (their ``finally`` aborts the call)."""
    import asyncio
    import inspect
    import sys
    from pathlib import Path

    from tinypaged.course import student_edition as se

    text = se.stub_file(Path(streaming.__file__).read_text(), [("sse_stream", "08_serve_over_http", "sse_stream")])
    edition: dict = {}
    exec(compile(text, "<edition streaming.py>", "exec"), edition)
    closed = []

    async def theirs(call, events, include_usage):
        try:
            yield "data: 1\n\n"
            yield "data: 2\n\n"
        finally:
            closed.append(call)

    monkeypatch.setattr(sys.modules["__main__"], "sse_stream", theirs, raising=False)
    assert inspect.isasyncgenfunction(edition["sse_stream"])

    async def hang_up_after_one():
        stream = edition["sse_stream"]("call", None, False)
        first = await anext(stream)
        await stream.aclose()
        return first

    assert asyncio.run(hang_up_after_one()) == "data: 1\n\n" and closed == ["call"]


def test_a_stream_that_copies_call_done_after_take_fails_showing_where_the_lines_differ():
    """Rule 2's trap: ``was_done`` copied after ``call._take`` (which adds the finished choice) drops every
    finish-only chunk. The lists of lines then differ in length; the message shows both around their first
    difference (it used to cut both at the same 160 characters, where they were still equal)."""
    source = inspect.getsource(streaming.sse_stream)
    late = source.replace("            was_done = set(call.done)\n            c = call._take(prompt_idx, ev)\n",
                          "            c = call._take(prompt_idx, ev)\n            was_done = set(call.done)\n")
    assert late != source
    scope = dict(vars(streaming))
    exec(late, scope)
    status, msg = checks.evaluate("sse_stream", scope["sse_stream"], detect=False)
    assert status == checks.FAIL and "the stream's lines" in msg, msg
    shown = msg.split("the stream's lines, in order (JSON of each data: line): ", 1)[1]
    want, got = shown.removeprefix("expected ").split(", got ", 1)
    got = got.split(" (", 1)[0]
    assert want.startswith("...") and got.startswith("..."), msg  # cut before the shared beginning
    assert want != got, f"the message hides the difference: {msg}"
    assert '"[DONE]"]' in got and "items expected" in msg, msg


def test_long_values_are_shown_around_their_first_difference():
    same = [{"choices": [{"index": 0, "text": f"piece {i}"}]} for i in range(8)]
    for want, got in ((same, same[:5] + same[6:]), (["x" * 40] * 6, ["x" * 40] * 5 + ["y" * 40]),
                      ("a" * 400, "a" * 300 + "b" * 100)):
        msg = checks.differ(want, got, 0)
        assert msg is not None
        head, tail = msg.rsplit(", got ", 1)
        assert head.split("expected ", 1)[1] != tail.split(" (", 1)[0], msg
        assert len(msg) < 2 * checks.MAX_SHOWN + 80, msg
    # short values are shown whole, as before
    assert checks.differ([1, 2], [1, 3], 0) == "expected [1, 2], got [1, 3]"
    assert checks.differ({"freed": [1, 2]}, {"freed": [1]}, 0) == "at ['freed']: expected [1, 2], got [1]"
