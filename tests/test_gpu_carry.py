"""The GPU machine's preparation, checked on the CPU: carrying a payload in parts (scripts/gpu_carry.sh) and
the GPU throughput benchmark's smoke run (benchmarks/bench_gpu_throughput.py --small)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CARRY = ROOT / "scripts" / "gpu_carry.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("sha256sum") is None,
                                reason="needs bash and coreutils")


def carry(side: Path, *args, check=True):
    """One gpu_carry.sh call with its carry folder at ``side`` (here, or the GPU machine's copy)."""
    env = {**os.environ, "GPU_CARRY_DIR": str(side)}
    r = subprocess.run(["bash", str(CARRY), *map(str, args)], env=env, capture_output=True, text=True, timeout=60)
    if check and r.returncode != 0:
        raise AssertionError(f"gpu_carry {' '.join(map(str, args))} exited {r.returncode}:\n{r.stdout}{r.stderr}")
    return r


def transfer(here: Path, there: Path, *parts: int) -> None:
    """What one run does with `carry`: the named stage folders replace theirs on the far side."""
    for k in parts:
        dst = there / f"stage-{k}"
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(here / f"stage-{k}", dst)


def manifest(here: Path) -> dict:
    lines = [line.split() for line in (here / "parts" / "MANIFEST").read_text().splitlines()]
    return {"kind": next(x[1] for x in lines if x[0] == "kind"),
            "payload_bytes": int(next(x[2] for x in lines if x[0] == "payload")),
            "parts": {int(x[1]): int(x[2]) for x in lines if x[0] == "part"}}


@pytest.fixture
def payload(tmp_path):
    src = tmp_path / "src" / "model"
    (src / "sub").mkdir(parents=True)
    (src / "weights.bin").write_bytes(os.urandom(12_000))  # incompressible: several parts of 3 KiB
    (src / "sub" / "config.json").write_text('{"hidden_size": 64}\n')
    return src


@pytest.fixture
def split(tmp_path, payload):
    here = tmp_path / "here"
    carry(here, "split", "--source", payload, "--part-size", "3K")
    carry(here, "stage", "all")
    return here


def tree(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_split_makes_equal_parts_under_the_limit(split):
    m = manifest(split)
    assert m["kind"] == "path"
    assert len(m["parts"]) >= 4
    assert all(size <= 3 * 1024 for size in m["parts"].values())
    assert sum(m["parts"].values()) == m["payload_bytes"]
    assert max(m["parts"].values()) - min(m["parts"].values()) <= len(m["parts"])  # equal, but for the last
    for k in m["parts"]:  # each stage folder holds its part and the manifest, nothing else
        assert sorted(p.name for p in (split / f"stage-{k}").iterdir()) == ["MANIFEST", f"part-{k:03d}"]


def test_round_trip_one_part_per_run_is_byte_identical_and_resumable(tmp_path, payload, split):
    there, dest = tmp_path / "there", tmp_path / "cache"
    n = len(manifest(split)["parts"])
    transfer(split, there, 1)
    r = carry(there, "join", dest, check=False)
    assert r.returncode == 3, r.stdout + r.stderr
    assert f"1 of {n} parts here" in r.stdout
    assert "missing: part 2, part 3" in r.stdout  # the missing parts are named
    for k in range(2, n + 1):  # the later runs carry only the next part; part 1 is not needed again
        shutil.rmtree(there / f"stage-{k - 1}")
        transfer(split, there, k)
        r = carry(there, "join", dest, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert tree(dest / "model") == tree(payload)
    again = carry(there, "join", dest)  # idempotent: nothing is redone
    assert "nothing to do" in again.stdout


def test_a_corrupted_part_is_refused_and_named(tmp_path, payload, split):
    there, dest = tmp_path / "there", tmp_path / "cache"
    n = len(manifest(split)["parts"])
    transfer(split, there, *range(1, n + 1))
    damaged = there / "stage-2" / "part-002"
    data = bytearray(damaged.read_bytes())
    data[100] ^= 0xFF
    damaged.write_bytes(bytes(data))
    r = carry(there, "join", dest, check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "corrupted, not taken: part 2" in r.stderr
    assert not (there / "received" / "part-002").exists()
    assert not (dest / "model").exists()
    assert "missing: 2" in carry(there, "status").stdout  # the good parts were kept
    for k in range(1, n + 1):
        shutil.rmtree(there / f"stage-{k}")
    transfer(split, there, 2)  # only the damaged part travels again
    carry(there, "join", dest)
    assert tree(dest / "model") == tree(payload)


def test_a_damaged_received_part_is_dropped_and_asked_for_again(tmp_path, split):
    there, dest = tmp_path / "there", tmp_path / "cache"
    transfer(split, there, 1)
    carry(there, "join", dest, check=False)
    shutil.rmtree(there / "stage-1")
    (there / "received" / "part-001").write_bytes(b"truncated")
    r = carry(there, "join", dest, check=False)
    assert r.returncode == 3
    assert "received part 1 is damaged" in r.stderr and "missing: part 1, part 2" in r.stdout


@pytest.mark.parametrize("size, message", [("0", "more than 0"), ("48X", "is not a size"), ("-3", "is not a size")])
def test_bad_part_size_is_refused_before_any_work(tmp_path, payload, size, message):
    r = carry(tmp_path / "here", "split", "--source", payload, "--part-size", size, check=False)
    assert r.returncode == 1 and "--part-size" in r.stderr and message in r.stderr
    assert not (tmp_path / "here" / "parts").exists()


def test_stage_names_the_parts_it_has(split):
    n = len(manifest(split)["parts"])
    r = carry(split, "stage", n + 1, check=False)
    assert r.returncode == 1 and f"from 1 to {n}" in r.stderr


def test_join_without_anything_carried_says_what_to_carry(tmp_path):
    r = carry(tmp_path / "there", "join", tmp_path / "cache", check=False)
    assert r.returncode == 3 and "stage-1" in r.stderr


# -- benchmarks/bench_gpu_throughput.py ------------------------------------------------------------------
def load_bench():
    spec = importlib.util.spec_from_file_location("bench_gpu_throughput", ROOT / "benchmarks" / "bench_gpu_throughput.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_graph_estimate_saves_at_most_the_forwards_idle_gap():
    est = load_bench().graph_estimate
    host_bound = est({"step": 30.0, "prepare": 3.0, "forward": 25.0, "rest": 2.0, "forward_gpu_busy": 5.0,
                      "step_gpu_busy": 6.0})
    assert host_bound["forward_gap_ms"] == 20.0 and host_bound["step_with_graphs_ms"] == 10.0
    assert host_bound["speedup_bound"] == 3.0 and host_bound["pays_off"]
    assert host_bound["host_only_ms"] == 24.0
    device_bound = est({"step": 30.0, "prepare": 1.0, "forward": 28.0, "rest": 1.0, "forward_gpu_busy": 27.5,
                        "step_gpu_busy": 28.0})
    assert not device_bound["pays_off"] and device_bound["speedup_bound"] < 1.02
    assert est({"step": 3.0, "prepare": 1.0, "forward": 1.0, "rest": 1.0}) is None  # the CPU: no device time


def test_gpu_throughput_benchmark_small_runs_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = load_bench().main(["--small", "--skip-hf", "--batch-sizes", "2", "--prompt-len", "8", "--output-len", "4",
                            "--json", str(out)])
    assert rc == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert row["system"] == "tinypaged (torch)" and row["requests"] == 4
    assert row["tokens"] == 4 * 4 and row["tokens_per_s"] > 0
    b = row["breakdown_ms"]
    assert b["decode_steps"] > 0 and b["batch"] == 2
    assert b["prepare"] > 0 and b["forward"] > 0 and b["rest"] >= 0  # rest = step - prepare - forward, per step
    assert "tinypaged decode step" in capsys.readouterr().out
