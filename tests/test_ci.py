"""The CI definition runs what the README and the local scripts run, nothing else.

`.github/workflows/ci.yml` has a CPU job that runs `.ci/run` (the README's test command, browser test
included) and a GPU job, on a self-hosted runner labelled "gpu", that runs `scripts/gpu_check.sh`.
"""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"


def jobs():
    return yaml.safe_load(WORKFLOW.read_text())["jobs"]


def run_lines(job):
    return [line.strip() for step in job["steps"] if "run" in step for line in step["run"].splitlines() if line.strip()]


def commands(path):
    """The non-comment lines of a shell script."""
    return [line.strip() for line in (ROOT / path).read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_cpu_job_runs_ci_run_which_runs_the_readme_command():
    cpu = jobs()["cpu"]
    assert run_lines(cpu) == ["bash .ci/run"]
    assert "bash scripts/test.sh" in commands(".ci/run")
    assert "bash scripts/test.sh" in (ROOT / "README.md").read_text(), "the README's test command"
    # The README's test command includes the browser test, and CI requires it (no silent skip).
    assert any(line.split()[:2] == ["bash", "scripts/browser_test.sh"] for line in commands("scripts/test.sh"))
    assert "export TINYPAGED_REQUIRE_BROWSER=1" in commands(".ci/run")
    assert any("apt-get install" in line and "chromium" in line for line in commands(".ci/run"))
    uploads = [s for s in cpu["steps"] if s.get("uses", "").startswith("actions/upload-artifact")]
    assert uploads and uploads[0]["with"]["path"].rstrip("/") == "build/browser-test"
    assert "build/browser-test" in (ROOT / "tests" / "test_browser.py").read_text()


def test_gpu_job_runs_gpu_check_on_the_documented_runner():
    gpu = jobs()["gpu"]
    assert "self-hosted" in gpu["runs-on"] and "gpu" in gpu["runs-on"]
    assert "bash scripts/gpu_check.sh" in run_lines(gpu)
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"--labels\s+gpu\b", readme), "the README explains how to register the runner with its label"
    assert "scripts/gpu_check.sh" in readme


def test_both_jobs_cache_the_venv_and_the_model():
    for name, job in jobs().items():
        caches = {s["with"]["path"]: s["with"]["key"] for s in job["steps"] if s.get("uses", "").startswith("actions/cache")}
        assert ".venv" in caches and "pyproject.toml" in caches[".venv"] and "setup_env.sh" in caches[".venv"], name
        assert ".model-cache" in caches, name
    # The model cache path is where the loader puts the converted model.
    env = yaml.safe_load(WORKFLOW.read_text())["env"]
    assert env["TINYPAGED_CACHE"].endswith("/.model-cache")
    assert "TINYPAGED_CACHE" in (ROOT / "tinypaged" / "model" / "loader.py").read_text()


def test_every_script_the_workflow_names_exists():
    for job in jobs().values():
        for line in run_lines(job):
            for path in re.findall(r"(?:\.ci|scripts)/[\w./-]+", line):
                assert (ROOT / path).exists(), f"{path} (in {line!r}) does not exist"
