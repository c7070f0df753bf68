"""The course side of ``tinypaged.lab.vllm_side`` without vLLM: a bad experiment or core count is refused with a
message naming it, before the environment is even looked for; without ``.venv-vllm`` the one-line hint comes back."""

import os
import sys

import pytest

from tinypaged.lab import vllm_side

GOOD = [dict(engine=dict(block_size=32), requests=[vllm_side.request([1, 2, 3], 4)])]


@pytest.fixture
def no_vllm(monkeypatch, tmp_path):
    monkeypatch.setenv("TINYPAGED_VLLM_PYTHON", str(tmp_path / "no-vllm-here"))
    monkeypatch.delenv("TINYPAGED_VLLM_CORES", raising=False)


@pytest.mark.parametrize("cores", [0, -1, 1.5, "two", True, 10_000])
def test_a_bad_core_count_is_refused_first(no_vllm, cores):
    with pytest.raises(ValueError, match="cores"):
        vllm_side.run(GOOD, cores=cores)


@pytest.mark.parametrize("value", ["0", "two", "1.5", "10000"])
def test_a_bad_core_count_from_the_environment_names_the_variable(no_vllm, monkeypatch, value):
    monkeypatch.setenv("TINYPAGED_VLLM_CORES", value)
    with pytest.raises(ValueError, match="TINYPAGED_VLLM_CORES"):
        vllm_side.run(GOOD)


@pytest.mark.parametrize("exp, message", [
    (dict(engine={}, requests=[]), "experiment 0 has no requests"),
    (dict(requests=GOOD[0]["requests"], knobs={}), "unknown keys"),
    (dict(engine=dict(block_size=16), requests=GOOD[0]["requests"]), "multiple of 32"),
])
def test_a_bad_experiment_is_refused_before_the_environment_is_looked_for(no_vllm, exp, message):
    with pytest.raises(ValueError, match=message):
        vllm_side.run([exp], cores=1)


def test_without_the_environment_the_hint_says_how_to_get_it(no_vllm):
    assert not vllm_side.available()
    with pytest.raises(RuntimeError, match="scripts/vllm_env.sh"):
        vllm_side.run(GOOD, cores=1)


def test_a_request_needs_tokens_and_a_length():
    with pytest.raises(ValueError, match="max_tokens"):
        vllm_side.request([], 4)
    with pytest.raises(ValueError, match="max_tokens"):
        vllm_side.request([1], 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a shell script stands in for vLLM's interpreter")
def test_an_error_between_experiments_stops_the_subprocess(monkeypatch, tmp_path):
    """``between`` fails while the vLLM side waits for it: the error comes back and no process is left behind. A
    stand-in for vLLM's interpreter speaks the same handshake (``done-<n>``, then it waits for ``go-<n>``)."""
    fake = tmp_path / "fake-python"
    fake.write_text("#!/bin/sh\n# args: -P vllm_side.py job out\ndir=$(dirname \"$4\")\n"
                    f"echo $$ > {tmp_path / 'pid'}\n"
                    "touch \"$dir/done-0\"\nwhile [ ! -e \"$dir/go-0\" ]; do sleep 0.01; done\nsleep 600\n")
    fake.chmod(0o755)
    monkeypatch.setenv("TINYPAGED_VLLM_PYTHON", str(fake))
    seen = []

    def between(n):
        seen.append(n)
        raise RuntimeError("the course side failed")

    with pytest.raises(RuntimeError, match="the course side failed"):
        vllm_side.run(GOOD * 2, model=tmp_path, cores=1, between=between)
    assert seen == [0]
    pid = int((tmp_path / "pid").read_text())
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
