"""The static site of the course (``bash scripts/site.sh`` -> ``build/site/``), read without installing the course.

Without a browser (the package-test step): the build gives one page per lesson and per doc, each lesson's page
holds its prose, code, printed results and figures, the stored widget is drawn, no page loads anything from the
network, and the build itself cannot reach the network; no page's code shows an nbval marker, every stage of the
landing page's table links its lesson's page, the landing page leads into stage 1 before set-up, and the build's
tools live in build/site-venv (never the course's .venv). In Chromium (``scripts/browser_test.sh``):
every page loads with no script error, every image is shown, every link inside the site leads to a page (and
an anchor) that exists, no request leaves the site, search finds the lessons, and the landing page's tables fit
a 1280-pixel window.
"""

import html
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "build" / "site"
LESSONS = sorted((ROOT / "notebooks").glob("*.ipynb"))
DOCS = ["GLOSSARY", "ARCHITECTURE", "VLLM_MAP", "RESULTS"]  # docs/site/index.md's "Reference" list


def load_conf():
    spec = importlib.util.spec_from_file_location("site_conf", ROOT / "docs" / "site" / "conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    return conf


@pytest.fixture(scope="module")
def site():
    """The site, built (or brought up to date: a second build redoes only what changed) by scripts/site.sh."""
    started = time.monotonic()
    run = subprocess.run(["bash", "scripts/site.sh"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"scripts/site.sh failed:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    print(f"site build: {time.monotonic() - started:.1f} s")
    return SITE


def page_text(path):
    """A page's visible text, roughly: tags dropped, entities decoded (enough to find a sentence in it)."""
    text = re.sub(r"<script.*?</script>|<style.*?</style>", " ", path.read_text(), flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", "", text))


def squash(text):
    return re.sub(r"\s+", " ", text).strip()


# ---------------------------------------------------------------------------- without a browser


def test_a_page_per_lesson_with_its_prose_code_results_and_figures(site):
    for nb_path in LESSONS:
        page = site / "notebooks" / f"{nb_path.stem}.html"
        assert page.is_file(), f"no page for {nb_path.name}"
        text, raw = squash(page_text(page)), page.read_text()
        cells = json.loads(nb_path.read_text())["cells"]
        figures = 0
        for i, cell in enumerate(cells):
            source = "".join(cell["source"])
            if cell["cell_type"] == "markdown":
                heading = next((line.lstrip("#").strip() for line in source.splitlines() if line.startswith("#")), None)
                if heading:  # prose: the cell's heading, as text (MyST renders `code` and **bold** inline)
                    plain = squash(re.sub(r"[`*]", "", heading))
                    assert plain in text, f"{nb_path.name}: cell {i}'s heading {plain!r} is not on the page"
            elif cell["cell_type"] == "code":
                longest = max(source.splitlines(), key=len, default="").strip()
                assert squash(longest) in text, f"{nb_path.name}: cell {i}'s code {longest!r} is not on the page"
                for out in cell.get("outputs", []):
                    if out["output_type"] == "stream":
                        line = max("".join(out["text"]).splitlines(), key=len, default="").strip()
                        assert squash(line) in text, f"{nb_path.name}: cell {i} printed {line!r}; not on the page"
                    figures += "image/png" in out.get("data", {})
        shown = len(re.findall(r'<img [^>]*src="\.\./_images/[0-9a-f]+\.png"', raw))
        assert shown == figures, f"{nb_path.name}: {figures} stored figure(s), {shown} on the page"
        for img in re.findall(r'src="\.\./(_images/[0-9a-f]+\.png)"', raw):
            assert (site / img).stat().st_size > 0, f"{nb_path.name}: {img} is missing or empty"


def test_the_docs_and_the_landing_page(site):
    for name in DOCS:
        page = site / "docs" / f"{name}.html"
        assert page.is_file(), f"no page for docs/{name}.md"
        title = (ROOT / "docs" / f"{name}.md").read_text().splitlines()[0].lstrip("#").strip()
        assert squash(title.replace("`", "")) in squash(page_text(page)), f"docs/{name}.md's title is not on its page"
    index = (site / "index.html").read_text()
    readme_title = (ROOT / "README.md").read_text().splitlines()[0].lstrip("#").strip()
    assert f"<h1>{readme_title}" in index, "the landing page is not README.md"
    for nb_path in LESSONS:
        assert f'href="notebooks/{nb_path.stem}.html"' in index, f"the landing page does not link {nb_path.name}"
    for name in DOCS:
        assert f'href="docs/{name}.html"' in index, f"the landing page does not link docs/{name}.md"
    # Search: Sphinx's page and index, with every lesson in it
    assert (site / "search.html").is_file()
    searchindex = (site / "searchindex.js").read_text()
    for nb_path in LESSONS:
        assert f'"notebooks/{nb_path.stem}"' in searchindex, f"{nb_path.name} is not in the search index"


def test_no_page_shows_a_test_marker(site):
    """nbval's markers (``# NBVAL_IGNORE_OUTPUT``, ``# NBVAL_SKIP``) tell the test suite how to compare a cell:
    the rendered code leaves them out (conf.py's strip_test_markers), on every page."""
    marked = [nb.name for nb in LESSONS if "# NBVAL_" in nb.read_text()]
    assert marked, "no lesson has a marker any more: this test checks nothing"
    marker = re.compile(r"^\s*#\s*NBVAL_[A-Z_]+\s*$", flags=re.M)
    code_blocks = 0
    for page in site.rglob("*.html"):
        for block in re.findall(r"<pre\b.*?</pre>", page.read_text(), flags=re.S):
            code_blocks += 1
            shown = marker.search(html.unescape(re.sub(r"<[^>]+>", "", block)))
            assert shown is None, f"{page.relative_to(site)} shows {shown.group(0).strip()!r} in its code"
    assert code_blocks > 100
    for nb_path in LESSONS:  # and no lesson's page holds one anywhere (the lessons' prose names none)
        page = site / "notebooks" / f"{nb_path.stem}.html"
        assert "NBVAL_" not in page_text(page), f"{page.name} shows an nbval marker"


def test_test_markers_are_stripped_from_code_cells_only():
    conf = load_conf()
    assert conf.strip_test_markers("# NBVAL_IGNORE_OUTPUT\nimport os\nprint(1)\n") == "import os\nprint(1)\n"
    assert conf.strip_test_markers(["# NBVAL_SKIP\n", "x = 1  # NBVAL_SKIP stays in a comment\n"]) == \
        "x = 1  # NBVAL_SKIP stays in a comment\n"
    assert conf.strip_test_markers("print('# NBVAL_SKIP')") == "print('# NBVAL_SKIP')"
    nb = {"cells": [{"cell_type": "code", "source": ["# NBVAL_IGNORE_OUTPUT\n", "y = 2"], "metadata": {},
                     "execution_count": 1, "outputs": []},
                    {"cell_type": "markdown", "source": "# NBVAL_SKIP in prose is left alone", "metadata": {}}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    cells = json.loads(conf.offline_notebook(json.dumps(nb)))["cells"]
    assert cells[0]["source"] == "y = 2" and cells[1]["source"] == "# NBVAL_SKIP in prose is left alone"


def _landing_stage_rows(index_html):
    """The landing page's stage table (its first table): {stage number: the hrefs in its row}."""
    table = re.search(r"<table.*?</table>", index_html, flags=re.S).group(0)
    rows = {}
    for row in re.findall(r"<tr\b.*?</tr>", table, flags=re.S):
        first = re.search(r"<td>(.*?)</td>", row, flags=re.S)
        if first and re.sub(r"<[^>]+>", "", first.group(1)).strip().isdigit():
            rows[int(re.sub(r"<[^>]+>", "", first.group(1)).strip())] = re.findall(r'href="([^"]+)"', row)
    return rows


def test_every_stage_in_the_landing_table_links_its_lesson_page(site):
    rows = _landing_stage_rows((site / "index.html").read_text())
    assert sorted(rows) == list(range(1, len(LESSONS) + 1)), f"stages in the landing table: {sorted(rows)}"
    for nb_path in LESSONS:
        stage = int(nb_path.stem[:2])
        want = f"notebooks/{nb_path.stem}.html"
        assert want in rows[stage], f"stage {stage}'s row does not link {want}: {rows[stage]}"
        assert (site / want).is_file(), f"stage {stage} links {want}, which was not built"


def test_the_landing_page_starts_the_reader_at_stage_1(site):
    """After the title, the introduction and the stage table, the first section leads into stage 1 (set-up and
    CI come after it)."""
    index = (site / "index.html").read_text()
    first_section = re.search(r"<h2>(.*?)<", index, flags=re.S).group(1).strip()
    assert first_section == "Start here", f"the landing page's first section is {first_section!r}"
    start = index.index("<h2>Start here")
    section = index[start: index.index("<h2>", start + 4)]
    assert 'href="notebooks/01_contiguous_kv_cache.html"' in section


def test_the_site_build_never_installs_into_the_course_environment(site):
    """Reading the course must not change the learner's environment: the site's tools live in build/site-venv."""
    assert (ROOT / "build" / "site-venv" / ".tinypaged-site-installed").is_file()
    assert not (ROOT / ".venv" / ".tinypaged-site-installed").exists(), "the site's tools were put into .venv"
    script = (ROOT / "scripts" / "site.sh").read_text()
    assert "venv=build/site-venv" in script and "venv=.venv\n" not in script


def test_no_page_loads_anything_from_the_network(site):
    """Scripts, stylesheets, images and frames come from the site itself (links to elsewhere are fine)."""
    loaded = re.compile(r'<(?:script|img|iframe|source|embed)\b[^>]*\bsrc="([^"]+)"|<link\b[^>]*\bhref="([^"]+)"')
    for page in site.rglob("*.html"):
        for src in (a or b for a, b in loaded.findall(page.read_text())):
            assert not re.match(r"(https?:)?//", src), f"{page.relative_to(site)} loads {src} from the network"
    for css in site.glob("_static/**/*.css"):
        assert not re.search(r"url\(\s*['\"]?(https?:)?//", css.read_text()), f"{css.name} loads a URL"


def test_the_stored_widget_is_drawn_from_its_saved_state():
    """Lesson 4's stepper: its buttons and its Output area (the printed trace and the drawing) as saved."""
    conf = load_conf()
    path = next(p for p in LESSONS if p.name.startswith("04_"))
    stored = json.loads(path.read_text())
    models = stored["metadata"]["widgets"][conf.WIDGET_STATE]["state"]
    output = next(m["state"] for m in models.values() if m["model_name"] == "OutputModel")
    png = next("".join(o["data"]["image/png"]).replace("\n", "")
               for o in output["outputs"] if "image/png" in o.get("data", {}))
    trace = next("".join(o["text"]) for o in output["outputs"] if o["output_type"] == "stream")

    nb = json.loads(conf.offline_notebook(path.read_text()))
    assert "widgets" not in nb["metadata"], "the widget state should not be left for a CDN's widget manager"
    views = [o["data"] for c in nb["cells"] for o in c.get("outputs", []) if conf.WIDGET_VIEW in o.get("data", {})]
    assert not views, "a widget view is left for JavaScript from a CDN"
    drawn = [o["data"]["text/html"] for c in nb["cells"] for o in c.get("outputs", [])
             if "site-widget" in o.get("data", {}).get("text/html", "")]
    assert len(drawn) == 1
    assert f"data:image/png;base64,{png}" in drawn[0]
    assert html.escape(trace) in drawn[0]
    assert re.findall(r"<button[^>]*disabled[^>]*>(\w+)</button>", drawn[0]) == ["step", "reset"]


def test_an_unknown_widget_keeps_its_text_and_an_animation_its_controls():
    conf = load_conf()
    nb = {"cells": [{"cell_type": "code", "source": "", "metadata": {}, "execution_count": 1, "outputs": [
        {"output_type": "display_data", "metadata": {}, "data": {
            conf.WIDGET_VIEW: {"model_id": "s1", "version_major": 2, "version_minor": 0},
            "text/plain": "IntSlider(value=3)"}},
        {"output_type": "display_data", "metadata": {}, "data": {"text/html": (
            '<link rel="stylesheet"\nhref="https://maxcdn.bootstrapcdn.com/font-awesome/4.4.0/css/font-awesome.min.css">'
            '<button title="Play"><i class="fa fa-play"></i></button>'
            '<button title="Play backwards"><i class="fa fa-play fa-flip-horizontal"></i></button>')}}]}],
        "metadata": {"widgets": {conf.WIDGET_STATE: {"state": {"s1": {
            "model_name": "IntSliderModel", "model_module": "@jupyter-widgets/controls", "state": {"value": 3}}}}}},
        "nbformat": 4, "nbformat_minor": 5}
    out = json.loads(conf.offline_notebook(json.dumps(nb)))["cells"][0]["outputs"]
    assert out[0]["data"] == {"text/plain": "IntSlider(value=3)"}  # not drawn: its text stands in, as in a terminal
    page = out[1]["data"]["text/html"]
    assert "font-awesome" not in page and "<i " not in page
    assert '<button title="Play">&#x25B6;</button>' in page and '<button title="Play backwards">&#x25C0;</button>' in page


def test_the_build_cannot_reach_the_network():
    """scripts/site.sh runs Sphinx through docs/site/build.py, which refuses every connection."""
    code = ("import runpy, urllib.request\n"
            "runpy.run_path('docs/site/build.py')['refuse_network']()\n"
            "try:\n    urllib.request.urlopen('http://127.0.0.1:9/', timeout=5)\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "built offline" in run.stdout, run.stdout + run.stderr
    assert "docs/site/build.py" in (ROOT / "scripts" / "site.sh").read_text()


# ---------------------------------------------------------------------------- in Chromium


def test_site_in_chromium(site):
    from test_browser import find_chromium

    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium found: install one (Debian/Ubuntu: apt-get install chromium) or set TINYPAGED_CHROMIUM")
    pytest.importorskip("playwright", reason="playwright is not installed: pip install -e '.[browser]'")
    from playwright.sync_api import sync_playwright

    out_dir = Path(os.environ.get("TINYPAGED_BROWSER_OUT", ROOT / "build" / "browser-test"))
    out_dir.mkdir(parents=True, exist_ok=True)
    pages = sorted(site.rglob("*.html"))
    assert len(pages) >= len(LESSONS) + len(DOCS) + 2  # + the landing page and search
    external, errors, ids, links = [], [], {}, []
    started = time.monotonic()
    args = ["--disable-dev-shm-usage"] + (["--no-sandbox"] if os.geteuid() == 0 else [])
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=args)
        context = browser.new_context(viewport={"width": 1300, "height": 900})
        # Nothing may leave the site: a request for anything but a local file is recorded and refused.
        context.route("**/*", lambda route: route.continue_() if route.request.url.startswith(("file:", "data:"))
                      else (external.append(route.request.url), route.abort()))
        tab = context.new_page()
        tab.on("pageerror", lambda e: errors.append(f"{tab.url}: {e}"))
        for path in pages:
            name = path.relative_to(site).as_posix()
            response = tab.goto(path.as_uri(), wait_until="load")
            assert response is None or response.ok, f"{name} did not load"
            tab.wait_for_function("() => Array.from(document.images).every(i => i.complete)", timeout=30_000)
            broken = tab.evaluate("() => Array.from(document.images).filter(i => !(i.naturalWidth > 0))"
                                  ".map(i => (i.getAttribute('src') || '').slice(0, 80))")
            assert not broken, f"{name}: images not shown: {broken}"
            ids[path] = set(tab.evaluate("() => Array.from(document.querySelectorAll('[id]')).map(e => e.id)"))
            hrefs = tab.evaluate("() => Array.from(document.querySelectorAll('a[href]')).map(a => a.href)")
            links += [(name, href) for href in hrefs]
            if name == "index.html":
                tab.screenshot(path=str(out_dir / "site-index.png"))
                tab.set_viewport_size({"width": 1280, "height": 900})  # the landing page's tables fit 1280 px
                cut = tab.evaluate("() => Array.from(document.querySelectorAll('table')).map(t => [t, t.parentElement])"
                                   ".filter(([t, box]) => box.scrollWidth > box.clientWidth + 1"
                                   " || t.getBoundingClientRect().right > document.documentElement.clientWidth)"
                                   ".map(([t]) => t.innerText.slice(0, 60))")
                wide = tab.evaluate("() => document.documentElement.scrollWidth - document.documentElement.clientWidth")
                tab.screenshot(path=str(out_dir / "site-index-1280.png"))
                tab.set_viewport_size({"width": 1300, "height": 900})
                assert not cut, f"tables cut at 1280 px on the landing page: {cut}"
                assert wide <= 0, f"the landing page scrolls sideways at 1280 px ({wide} px)"
            if name.startswith("notebooks/04_"):
                widget = tab.locator(".site-widget")
                assert widget.count() == 1 and widget.locator("img").count() == 1, "lesson 4's stepper is not drawn"
                assert widget.get_by_role("button", name="step").is_disabled()
                widget.scroll_into_view_if_needed()
                tab.screenshot(path=str(out_dir / "site-04-widget.png"))

        # Search finds a lesson by a word of its prose.
        tab.goto((site / "search.html").as_uri() + "?q=preemption")
        tab.wait_for_function("() => document.querySelectorAll('#search-results li, ul.search li').length > 0",
                              timeout=30_000)
        found = tab.evaluate("() => Array.from(document.querySelectorAll('#search-results li a, ul.search li a'))"
                             ".map(a => a.href)")
        tab.screenshot(path=str(out_dir / "site-search.png"))
        browser.close()

    assert not errors, f"script errors: {errors}"
    assert not external, f"pages asked the network for {sorted(set(external))}"
    assert any("/notebooks/04_continuous_batching.html" in href for href in found), f"search for 'preemption': {found}"

    # Every link inside the site leads to a file that exists, and to an anchor that exists on that page.
    bad = []
    for name, href in links:
        url = urlsplit(href)
        if url.scheme != "file":
            continue
        target = Path(unquote(url.path))
        if not target.is_relative_to(site) or not target.exists():
            bad.append(f"{name} -> {href}")
        elif url.fragment and target.suffix == ".html" and unquote(url.fragment) not in ids.get(target, set()):
            bad.append(f"{name} -> {href} (no such anchor)")
    assert not bad, "broken links:\n" + "\n".join(bad[:30])
    internal = sum(urlsplit(h).scheme == "file" for _, h in links)
    print(f"site in Chromium: {len(pages)} pages, {internal} internal links, {time.monotonic() - started:.1f} s")
