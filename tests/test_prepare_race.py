"""`python -m tinypaged prepare` run twice at once on one cache, and model folders with damaged files.

Two runs used to share one ``smollm2-135m-instruct.partial`` folder: one failed with a raw
``SafetensorError ... No such file or directory`` and 538 MB of temporary files stayed behind. The
conversion now happens in a private folder renamed into place, under a lock file. These tests race
real processes on a fake converter (the real one takes 15-30 s and 538 MB), so they check the
protocol; the last test checks that the installed SmolLM2 folder passes the same checks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tinypaged.model import loader as ml

NAME = "smollm2-135m-instruct"

# a stand-in for the GGUF conversion: small but valid files (JSON that parses, a real safetensors file)
FAKE = textwrap.dedent("""
    import json, os, time
    from pathlib import Path

    def fake_convert(staging, log, hold=None):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        (staging / "model.safetensors.tmp123").write_bytes(b"x" * 1000)  # as safetensors' temporary file
        if hold is not None:  # stay inside the conversion until the test lets go
            Path(str(hold) + ".started").touch()
            deadline = time.monotonic() + 120
            while not Path(hold).exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        import torch
        from safetensors.torch import save_file
        (staging / "model.safetensors.tmp123").unlink()
        save_file({"w": torch.zeros(2)}, staging / "model.safetensors")
        for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            (staging / name).write_text(json.dumps({"made_by": os.getpid()}))
""")

CHILD = FAKE + textwrap.dedent("""
    import sys
    from tinypaged.model import loader as ml
    log, hold = sys.argv[1], sys.argv[2]
    ml._convert_smollm2 = lambda staging: fake_convert(staging, log, hold)
    print(ml.smollm2_folder(repair=True))
""")


def fake_convert(staging: Path, log: Path, hold: Path | None = None) -> None:
    scope: dict = {}
    exec(FAKE, scope)
    scope["fake_convert"](staging, log, hold)


def leftovers(cache: Path) -> list[str]:
    """Everything in the cache but the finished folders (SmolLM2's, "tiny"'s saved weights: ``ml.tiny_folder``, and
    the built CPU operators: ``tinypaged.cpu_native``), their lock files and the grader's own folder (student editions
    and the sandbox's readable model copy: ``tinypaged.course.grading.sandbox.grader_cache``)."""
    done = [NAME] + [p.name for p in cache.glob("tiny-seed*") if p.is_dir() and ml._tiny_complete(p)]
    done += [p.name for p in cache.glob("cpu-ops-*") if any(p.glob("*.so"))]  # builds of this and older versions
    keep = {"grading", *done, *(name + ".lock" for name in done)}
    return sorted(p.name for p in cache.iterdir() if p.name not in keep)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYPAGED_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_two_prepare_processes_convert_once_and_leave_nothing_behind(cache, tmp_path):
    """The second process waits for the first (it says so) and reuses its folder; one conversion in all."""
    pytest.importorskip("fcntl")
    log, hold = tmp_path / "log", tmp_path / "release"
    env = dict(os.environ, TINYPAGED_CACHE=str(cache))
    script = tmp_path / "child.py"
    script.write_text(CHILD)

    def start():
        return subprocess.Popen([sys.executable, str(script), str(log), str(hold)], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    first = start()
    second = None
    try:
        deadline = time.monotonic() + 120
        while not Path(str(hold) + ".started").exists():  # the first one is converting (and holds the lock)
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        second = start()
        said: list[str] = []  # the second one's first line on stderr: that it waits (read with a time limit)
        reader = threading.Thread(target=lambda: said.append(second.stderr.readline()), daemon=True)
        reader.start()
        reader.join(120)
        assert said and "another process is preparing" in said[0] and "waiting" in said[0], said
        hold.touch()
        results = [p.communicate(timeout=120) for p in (first, second)]
    finally:
        hold.touch()
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()
    assert [p.returncode for p in (first, second)] == [0, 0], results
    assert [out.strip() for out, _ in results] == [str(cache / NAME)] * 2
    assert log.read_text().split() == [str(first.pid)]  # converted once, by the first process
    assert sorted(p.name for p in (cache / NAME).iterdir()) == sorted(ml.SMOLLM2_FILES)
    assert leftovers(cache) == []


@pytest.mark.parametrize("interrupt", [RuntimeError("conversion failed"), KeyboardInterrupt()])
def test_a_failed_or_interrupted_conversion_leaves_nothing(cache, tmp_path, monkeypatch, interrupt):
    def broken(staging):
        (staging / "model.safetensors").write_bytes(b"x" * 1000)  # half-written
        raise interrupt

    monkeypatch.setattr(ml, "_convert_smollm2", broken)
    with pytest.raises(type(interrupt)):
        ml.smollm2_folder()
    assert not (cache / NAME).exists() and leftovers(cache) == []
    monkeypatch.setattr(ml, "_convert_smollm2", lambda staging: fake_convert(staging, tmp_path / "log"))
    assert ml.smollm2_folder() == cache / NAME
    assert leftovers(cache) == [] and len((tmp_path / "log").read_text().split()) == 1


def test_folders_left_by_a_killed_run_or_the_old_partial_are_cleaned(cache, tmp_path, monkeypatch):
    pytest.importorskip("fcntl")
    cache.mkdir(parents=True)
    for stale in (f".{NAME}.tmp-999-abcd", f"{NAME}.partial"):
        (cache / stale).mkdir()
        (cache / stale / "model.safetensors").write_bytes(b"x" * 100)
    (cache / NAME).mkdir()  # an incomplete folder from an old version: replaced
    (cache / NAME / "config.json").write_text("{}")
    monkeypatch.setattr(ml, "_convert_smollm2", lambda staging: fake_convert(staging, tmp_path / "log"))
    assert ml.smollm2_folder() == cache / NAME
    assert ml._smollm2_intact(cache / NAME) and leftovers(cache) == []


def test_without_a_file_lock_racing_threads_still_get_one_whole_folder(cache, tmp_path, monkeypatch):
    """Where fcntl is missing (Windows) both convert; the rename keeps the first, the second reuses it."""
    monkeypatch.setitem(sys.modules, "fcntl", None)  # import fcntl -> ImportError
    both_inside = threading.Barrier(2, timeout=60)

    def convert(staging):
        both_inside.wait()  # the two conversions overlap for sure
        fake_convert(staging, tmp_path / "log")

    monkeypatch.setattr(ml, "_convert_smollm2", convert)
    results, errors = [], []

    def run():
        try:
            results.append(ml.smollm2_folder())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and results == [cache / NAME] * 2
    assert len((tmp_path / "log").read_text().split()) == 2
    assert ml._smollm2_intact(cache / NAME) and leftovers(cache) == []


def test_prepare_repairs_a_damaged_cache_and_loading_it_says_so(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(ml, "_convert_smollm2", lambda staging: fake_convert(staging, tmp_path / "log"))
    folder = ml.smollm2_folder()
    (folder / "config.json").write_text('{"model_type": "llama",')  # cut short
    with pytest.raises(ValueError, match=rf"model folder {folder} has a damaged config.json .*"
                                         r"run `python -m tinypaged prepare`: it converts SmolLM2 again"):
        ml.load_model("smollm2-135m", None, "cpu")
    assert ml.smollm2_folder() == folder and len((tmp_path / "log").read_text().split()) == 1  # no check: no cost
    assert ml.smollm2_folder(repair=True) == folder  # what `prepare` calls: converts again
    assert len((tmp_path / "log").read_text().split()) == 2
    assert ml._smollm2_intact(folder) and leftovers(cache) == []


# -- damaged files in a model folder of one's own ---------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    ml.tiny_hf_model().save_pretrained(folder)  # config.json, generation_config.json, model.safetensors
    return folder


def damaged_copy(src: Path, dst: Path, name: str, damage) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    damage(dst / name)
    return dst


@pytest.mark.parametrize("name, damage", [
    ("config.json", lambda p: p.write_text('{"model_type": "llama", "hidden_size": 64')),
    ("config.json", lambda p: p.write_bytes(b"\xff\xfe{}")),
    ("generation_config.json", lambda p: p.write_text("{")),
    ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])),  # truncated
    ("model.safetensors", lambda p: p.write_bytes(b"\x00" * 64)),
])
def test_a_damaged_model_file_is_a_clear_error_naming_folder_and_file(tiny_folder, tmp_path, name, damage):
    from tinypaged import LLM

    folder = damaged_copy(tiny_folder, tmp_path / "m", name, damage)
    with pytest.raises(ValueError, match=rf"model folder {folder} has a damaged {name} \(.+\); copy or save the "
                                         r"checkpoint into it again"):
        LLM(str(folder), device="cpu", dtype="float32", num_gpu_blocks_override=16)


def test_a_damaged_tokenizer_is_a_clear_error(tiny_folder, tmp_path):
    folder = damaged_copy(tiny_folder, tmp_path / "m", "config.json", lambda p: None)
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match=rf"model folder {folder} has a damaged tokenizer.json"):
        ml.load_tokenizer(str(folder))


def test_the_cli_prints_one_line_for_a_damaged_folder(tiny_folder, tmp_path):
    folder = damaged_copy(tiny_folder, tmp_path / "m", "config.json", lambda p: p.write_text("{"))
    r = subprocess.run([sys.executable, "-m", "tinypaged", "generate", "hi", "--model", str(folder)],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert "has a damaged config.json" in r.stderr and str(folder) in r.stderr


def test_the_installed_smollm2_folder_passes_the_checks():
    """The real conversion's folder (made by set-up, under the new protocol) is whole and readable."""
    folder = ml.cache_dir() / NAME
    if not ml._smollm2_complete(folder):
        pytest.skip("SmolLM2 has not been prepared here")
    assert ml._smollm2_intact(folder)
    assert leftovers(ml.cache_dir()) == [], "a conversion left files behind"
