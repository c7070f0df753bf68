"""The course as learners see it: every lesson run in JupyterLab, in a real (headless) Chromium.

nbval proves the kernel prints the stored outputs; this proves the front end shows them: no cell ends
in an error, every widget renders (a missing front-end extension shows "Error displaying widget"),
the widgets respond, and the kernel survives. One screenshot per notebook (and per widget state)
goes to ``$TINYPAGED_BROWSER_OUT`` (default ``build/browser-test/``) for a human to look at.

JupyterLab starts as ``scripts/course.sh`` starts it (headless, loopback address, a token), but on a
temporary copy of the notebooks: JupyterLab autosaves what it runs. Chromium is the distribution's
(``apt-get install chromium``), driven by Playwright for Python; Playwright's own browser download is
never used. ``scripts/browser_test.sh`` runs this module (``bash scripts/test.sh`` calls it).

Widgets: ``WIDGET_CHECKS`` maps each notebook that builds ipywidgets to the function that exercises
them. A notebook that gains a widget (a slider for the policy or block size...) fails
``test_every_widget_notebook_has_a_check`` until its check is added here.
"""

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NOTEBOOK_TIMEOUT_S = int(os.environ.get("TINYPAGED_BROWSER_TIMEOUT", "900"))  # run-all of one notebook


def find_chromium():
    """The distribution's Chromium: $TINYPAGED_CHROMIUM, else chromium / chromium-browser on PATH."""
    explicit = os.environ.get("TINYPAGED_CHROMIUM")
    if explicit:
        return explicit if Path(explicit).exists() else None
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)


def uses_widgets(path):
    cells = json.loads(path.read_text())["cells"]
    return any("ipywidgets" in "".join(c["source"]) for c in cells if c["cell_type"] == "code")


# ---------------------------------------------------------------------------- widget checks


def output_state(page, widget):
    """What the learner sees in a widget's Output area: its text and the drawing (a PNG data URL)."""
    out = widget.locator(".widget-output").first
    text = out.locator("pre").all_inner_texts()
    img = out.locator("img")
    src = img.first.get_attribute("src") if img.count() else None
    return "\n".join(text), src


def wait_for_change(page, widget, before, settled=lambda state: True, timeout_s=60):
    """The widget's output once it differs from ``before``, shows text and a drawing, and ``settled``
    holds: an update arrives as several messages (cleared, text, image), so the page passes through
    states that are neither the old output nor the new one."""
    deadline = time.monotonic() + timeout_s
    now = before
    while time.monotonic() < deadline:
        now = output_state(page, widget)
        if now != before and now[0] and now[1] and settled(now):
            return now
        page.wait_for_timeout(200)
    return now  # the caller's assertions say what is wrong with it


def check_stepper(page, out_dir):
    """Notebook 04: **step** advances the engine (text trace and drawing change); **reset** restores the start."""
    widget = page.locator(".jp-OutputArea-output .jupyter-widgets", has=page.get_by_role("button", name="step"))
    widget = widget.first
    widget.scroll_into_view_if_needed()
    start = output_state(page, widget)
    assert "(not started)" in start[0], f"the stepper should start at '(not started)', shows {start[0][:200]!r}"
    assert start[1], "the stepper shows no drawing"
    page.screenshot(path=str(out_dir / "04_stepper_start.png"))

    widget.get_by_role("button", name="step").click()
    one = wait_for_change(page, widget, start, lambda st: st[0].startswith("step   0") and st[1] != start[1])
    assert one[0].splitlines()[0].startswith("step   0"), f"after one click the trace should show step 0: {one[0][:200]!r}"
    assert one[1] != start[1], "the drawing did not change after a step"
    widget.get_by_role("button", name="step").click()
    two = wait_for_change(page, widget, one, lambda st: st[0].startswith("step   1"))
    assert two[0].splitlines()[0].startswith("step   1"), f"after two clicks the trace should show step 1: {two[0][:200]!r}"
    page.screenshot(path=str(out_dir / "04_stepper_after_2_steps.png"))

    widget.get_by_role("button", name="reset").click()
    back = wait_for_change(page, widget, two, lambda st: st == start)
    assert back[0] == start[0], f"reset should restore the start: {back[0][:200]!r}"
    assert back[1] == start[1], "reset should restore the start's drawing"
    page.screenshot(path=str(out_dir / "04_stepper_reset.png"))


WIDGET_CHECKS = {
    "04_continuous_batching.ipynb": check_stepper,
}


def test_every_widget_notebook_has_a_check():
    """Runs without a browser: a lesson that builds widgets must have its interaction check above."""
    with_widgets = {p.name for p in LESSONS if uses_widgets(p)}
    assert with_widgets, "no lesson uses ipywidgets any more: update this module"
    assert with_widgets <= set(WIDGET_CHECKS), f"add a check to WIDGET_CHECKS for {sorted(with_widgets - set(WIDGET_CHECKS))}"


# ---------------------------------------------------------------------------- JupyterLab and Chromium


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(base, token, path, method="GET"):
    req = urllib.request.Request(f"{base}{path}", method=method, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read()
    return json.loads(body) if body else None


@pytest.fixture(scope="module")
def browser_env():
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium found: install one (Debian/Ubuntu: apt-get install chromium) or set TINYPAGED_CHROMIUM")
    pytest.importorskip("playwright", reason="playwright is not installed: pip install -e '.[browser]'")
    return chromium


@pytest.fixture(scope="module")
def out_dir():
    d = Path(os.environ.get("TINYPAGED_BROWSER_OUT", ROOT / "build" / "browser-test"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="module")
def lab(browser_env, tmp_path_factory, out_dir):
    """JupyterLab on 127.0.0.1 with a token, serving a copy of notebooks/ (benchmarks/ linked beside it)."""
    work = tmp_path_factory.mktemp("lab")
    shutil.copytree(ROOT / "notebooks", work / "notebooks", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    (work / "benchmarks").symlink_to(ROOT / "benchmarks")  # lessons 3 and 5 import the benchmark scripts
    settings = work / "lab-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    # No news or update checks: no network, and no toast over the notebook.
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')
    token = secrets.token_hex(16)
    port = free_port()
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(work / "lab-settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(work / "lab-workspaces"), "PYTHONHASHSEED": "0",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    env.pop("MPLBACKEND", None)  # the inline backend must draw into the page (Agg would draw nothing)
    # One torch thread per kernel unless told otherwise: on a busy 2-core machine two threads that wait for
    # each other run the SmolLM2 cells several times slower. (What is checked here does not depend on it.)
    env.setdefault("OMP_NUM_THREADS", "1")
    # A learner without the vLLM environment: notebook 06's vLLM cells print how to get it (nbval runs them
    # for real; here they would only restart ten vLLM engines to check what nbval already checks).
    env.setdefault("TINYPAGED_VLLM_PYTHON", str(work / "no-vllm-here"))
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}", "--LabApp.expose_app_in_browser=True"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")  # as scripts/course.sh does in containers
    # one JupyterLab per pytest-xdist worker (scripts/browser_test.sh runs two): each keeps its own log
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    log_path = out_dir / (f"jupyterlab-{worker}.log" if worker else "jupyterlab.log")
    log = open(log_path, "w")
    server = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                api(base, token, "/api/status")
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not start; see {log_path}")
                time.sleep(0.5)
        yield {"base": base, "token": token, "chromium": browser_env}
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="module")
def browser(lab):
    from playwright.sync_api import sync_playwright

    args = ["--disable-dev-shm-usage"] + (["--no-sandbox"] if os.geteuid() == 0 else [])
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=lab["chromium"], headless=True, args=args)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    """A fresh tab per lesson (closing it skips the "leave page?" prompt of a notebook with unsaved runs)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    pg.set_default_timeout(60_000)
    yield pg
    context.close()


# What the page's JupyterLab reports about the open notebook (window.jupyterapp: expose_app_in_browser).
NOTEBOOK_STATE = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  if (!panel || !panel.content || !panel.content.model) return null;
  const ctx = panel.sessionContext;
  const cells = [];
  for (const cell of panel.content.model.cells) {
    if (cell.type !== 'code') continue;
    cells.push({count: cell.executionCount, outputs: cell.outputs.toJSON().map(o => ({
      type: o.output_type, ename: o.ename || null, evalue: o.evalue || null,
      mimes: o.data ? Object.keys(o.data) : []}))});
  }
  return {path: panel.context.path, status: ctx.kernelDisplayStatus, kernel: ctx.session && ctx.session.kernel
          ? ctx.session.kernel.id : null, cells: cells};
}"""


def notebook_state(page):
    return page.evaluate(NOTEBOOK_STATE)


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_lesson_runs_in_jupyterlab(path, lab, page, out_dir):
    name = path.name
    # ?reset: open this notebook alone, not the tabs the previous lesson left in the workspace.
    page.goto(f"{lab['base']}/lab/tree/notebooks/{name}?reset&token={lab['token']}")
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                           f" && window.jupyterapp.shell.currentWidget.title.label === {json.dumps(name)}",
                           timeout=120_000)
    page.wait_for_function("() => { const c = window.jupyterapp.shell.currentWidget.sessionContext;"
                           " return c.session && c.session.kernel && c.kernelDisplayStatus === 'idle'; }",
                           timeout=120_000)
    kernel = notebook_state(page)["kernel"]

    # Run all cells the way a learner does: Run menu -> Run All Cells.
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    started = time.monotonic()
    # Done when every code cell has an execution count and the kernel is idle again.
    page.wait_for_function("""() => { const p = window.jupyterapp.shell.currentWidget;
        const cells = Array.from(p.content.model.cells).filter(c => c.type === 'code');
        return p.sessionContext.kernelDisplayStatus !== 'busy' && cells.every(c => c.executionCount !== null)
          || ['dead', 'unknown', 'restarting', 'autorestarting'].includes(p.sessionContext.kernelDisplayStatus); }""",
                           timeout=NOTEBOOK_TIMEOUT_S * 1000, polling=500)
    seconds = time.monotonic() - started
    page.wait_for_timeout(1000)  # let the last outputs (and widget views) render
    state = notebook_state(page)

    # The kernel did not die (or restart: the counts would start again) and ran every cell once, in order.
    assert state["status"] == "idle", f"{name}: the kernel is {state['status']!r} after Run All"
    assert state["kernel"] == kernel
    assert api(lab["base"], lab["token"], f"/api/kernels/{kernel}")["execution_state"] == "idle"
    counts = [c["count"] for c in state["cells"]]
    assert counts == list(range(1, len(counts) + 1)), f"{name}: execution counts {counts}"

    # No cell shows an error.
    errors = [(i, o["ename"], o["evalue"]) for i, c in enumerate(state["cells"]) for o in c["outputs"] if o["type"] == "error"]
    assert not errors, f"{name}: cells ended in errors {errors}"

    # Every widget renders (wait for the views, or for the first error message in their place).
    views = sum("application/vnd.jupyter.widget-view+json" in o["mimes"] for c in state["cells"] for o in c["outputs"])
    rendered = page.locator(".jp-OutputArea-output > .jupyter-widgets")
    broken = page.get_by_text("Error displaying widget")
    deadline = time.monotonic() + 30
    while rendered.count() < views and broken.count() == 0 and time.monotonic() < deadline:
        page.wait_for_timeout(250)
    assert broken.count() == 0, (f"{name}: {broken.count()} widget(s) show {broken.first.inner_text()!r} "
                                 f"(is the ipywidgets front-end extension installed?)")
    assert rendered.count() == views, f"{name}: {views} widget output(s), {rendered.count()} rendered"

    # Every figure became an image in the page.
    figures = sum("image/png" in o["mimes"] for c in state["cells"] for o in c["outputs"])
    assert page.locator(".jp-OutputArea-output img").count() >= figures

    # Scroll to the end and keep a picture for a human.
    page.keyboard.press("Escape")
    page.evaluate("() => { const n = window.jupyterapp.shell.currentWidget.content; n.scrollToItem"
                  " ? n.scrollToItem(n.widgets.length - 1) : n.node.scrollTo(0, n.node.scrollHeight); }")
    page.wait_for_timeout(500)
    page.screenshot(path=str(out_dir / f"{path.stem}.png"))

    if name in WIDGET_CHECKS:
        WIDGET_CHECKS[name](page, out_dir)
        # the last output of a click arrives before the kernel's "idle" status does: wait for it (bounded)
        deadline = time.monotonic() + 30
        while notebook_state(page)["status"] == "busy" and time.monotonic() < deadline:
            page.wait_for_timeout(200)
        state = notebook_state(page)
        assert state["status"] == "idle", f"{name}: the kernel is {state['status']!r} 30 s after the widget checks"
        assert state["kernel"] == kernel, f"{name}: the kernel was replaced during the widget checks"

    (out_dir / f"{path.stem}.seconds").write_text(f"{seconds:.1f}\n")
    api(lab["base"], lab["token"], f"/api/kernels/{kernel}", method="DELETE")  # free the memory for the next lesson
