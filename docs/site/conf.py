"""Sphinx configuration of the course's static site (``bash scripts/site.sh`` -> ``build/site/index.html``).

The site is built from what is stored in the repository, never by running anything: the lessons' stored outputs
(``nb_execution_mode = "off"``), README.md as the landing page, and four docs. scripts/site.sh copies them into
``build/site-src`` (the layout below) and runs sphinx-build with this folder as its configuration directory.

Nothing is fetched from the network, at build time or when a page is read: the theme (Furo) and Sphinx's search
ship their files in their wheels, no page has math (so no MathJax), and two kinds of stored output that would
load JavaScript or CSS from a CDN are turned into plain HTML as the site is built (the notebooks are not changed):

- an ipywidgets view (lesson 4's stepper): ipywidgets' embedding needs its HTML manager from a CDN, so the
  widget's stored state is drawn as it was saved (its buttons, inert as they would be without a kernel, and
  its Output area's text and drawing);
- matplotlib's JavaScript animation (lesson 7): its frames are already inline; only its control icons came
  from a CDN stylesheet (Font Awesome), so they become characters.

Code cells are shown without nbval's markers (``# NBVAL_IGNORE_OUTPUT``, ``# NBVAL_SKIP``, ...): they tell the test
suite how to compare a cell's output, and mean nothing to a reader. The landing page's tables fit a 1280-pixel
window (``site.css``: long names in code may wrap there).
"""

import base64
import html
import json
import re

project = "tinypaged"

extensions = ["myst_nb"]
root_doc = "index"
exclude_patterns = ["README.md"]  # included by index.md (README's own heading is the landing page's title)

# The stored outputs, as nbval checks them: nothing runs.
nb_execution_mode = "off"
nb_ipywidgets_js = {}  # no ipywidgets JavaScript from a CDN: stored widget views are drawn below instead
nb_merge_streams = True  # one block of printed text per cell, as JupyterLab shows it
myst_heading_anchors = 3
smartquotes = False  # the prose as written (quotes inside names and code-like words stay straight)

html_theme = "furo"
html_title = "tinypaged, the course"
html_show_copyright = False
html_show_sourcelink = False  # a page's source would be a copy of a notebook: the repository has them
html_copy_source = False
html_permalinks_icon = "#"
# Search works from a file opened in the browser (file://): a result's summary would be fetched from its page,
# which browsers refuse for local files, so results are listed by title.
html_show_search_summary = False
html_static_path = ["static"]
html_css_files = ["site.css"]

# Sphinx's default "Non-consecutive header level" warnings come from the lessons' prose (a "###" under a "#"):
# harmless for a web page.
suppress_warnings = ["myst.header"]

# ---------------------------------------------------------------------------- stored outputs, offline

WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _text(value):
    return "".join(value) if isinstance(value, list) else value


def _output_html(out):
    """One stored output (of an ipywidgets Output area) as HTML."""
    if out.get("output_type") == "stream":
        return f'<pre class="site-widget-stream">{html.escape(_text(out["text"]))}</pre>'
    data = out.get("data", {})
    if "image/png" in data:
        png = _text(data["image/png"]).replace("\n", "")
        base64.b64decode(png, validate=True)  # a corrupt image fails the build, not the reader
        return f'<img class="site-widget-image" alt="a figure the widget drew" src="data:image/png;base64,{png}">'
    if "text/html" in data:
        return _text(data["text/html"])
    if "text/plain" in data:
        return f"<pre>{html.escape(_text(data['text/plain']))}</pre>"
    return ""


def _widget_html(models, model_id, depth=0):
    """A stored ipywidgets model and its children as static HTML; None where a model is not understood."""
    model = models.get(model_id)
    if model is None or depth > 20:
        return None
    name, state = model["model_name"], model["state"]
    if name in ("VBoxModel", "HBoxModel", "BoxModel", "GridBoxModel"):
        parts = [_widget_html(models, child.removeprefix("IPY_MODEL_"), depth + 1) for child in state.get("children", [])]
        if any(p is None for p in parts):
            return None
        direction = "row" if name == "HBoxModel" else "column"
        return f'<div class="site-widget-box" style="display:flex;flex-direction:{direction};gap:4px">{"".join(parts)}</div>'
    if name in ("ButtonModel", "ToggleButtonModel"):
        label = html.escape(state.get("description", ""))
        return f'<button type="button" disabled title="runs in JupyterLab">{label}</button>'
    if name == "OutputModel":
        return '<div class="site-widget-output">' + "".join(_output_html(o) for o in state.get("outputs", [])) + "</div>"
    if name in ("HTMLModel", "LabelModel"):
        return f"<div>{state.get('value', '')}</div>"
    return None


FONT_AWESOME_LINK = re.compile(r'<link rel="stylesheet"\s+href="https://[^"]*font-awesome[^"]*"\s*/?>')
FA_ICON = re.compile(r'<i class="fa (fa-[a-z-]+)( fa-flip-horizontal)?"></i>')
# Characters that common fonts have (the media-control ones, U+23EE..U+23F8, are often missing).
FA_CHARS = {"fa-minus": "&minus;", "fa-plus": "+", "fa-fast-backward": "|&#x25C1;", "fa-step-backward": "&#x25C1;",
            "fa-play": "&#x25B6;", "fa-pause": "||", "fa-step-forward": "&#x25B7;", "fa-fast-forward": "&#x25B7;|"}


def _animation_icon(m):
    if m.group(2):  # matplotlib's "play backwards": a flipped play icon
        return "&#x25C0;"
    return FA_CHARS.get(m.group(1), html.escape(m.group(1).removeprefix("fa-")))


NBVAL_MARKER = re.compile(r"^[ \t]*#[ \t]*NBVAL_[A-Z_]+[ \t]*$")  # a line that only tells nbval what to do


def strip_test_markers(source):
    """A code cell's source without the lines that are nbval markers (what is left keeps its line breaks)."""
    text = _text(source)
    kept = [line for line in text.splitlines(keepends=True) if not NBVAL_MARKER.match(line.rstrip("\r\n"))]
    return "".join(kept).lstrip("\n") if len(kept) < len(text.splitlines()) else text


def offline_notebook(source):
    """The notebook JSON ``source`` with its stored outputs made self-contained and its code cells shown without
    test markers (see the module's docstring)."""
    nb = json.loads(source)
    models = nb.get("metadata", {}).pop("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["source"] = strip_test_markers(cell.get("source", ""))
        for out in cell.get("outputs", []):
            data = out.get("data")
            if not data:
                continue
            if WIDGET_VIEW in data:
                drawn = _widget_html(models, data[WIDGET_VIEW]["model_id"])
                del data[WIDGET_VIEW]
                if drawn is not None:
                    note = ('<p class="site-widget-note">An interactive widget, drawn as it was saved: '
                            "its buttons work when the notebook runs in JupyterLab.</p>")
                    data["text/html"] = f'<div class="site-widget">{note}{drawn}</div>'
            if "text/html" in data:
                page = _text(data["text/html"])
                if "font-awesome" in page:
                    page = FA_ICON.sub(_animation_icon, FONT_AWESOME_LINK.sub("", page))
                    data["text/html"] = page
    return json.dumps(nb)


def _source_read(app, docname, source):
    if app.env.doc2path(docname).suffix == ".ipynb":
        source[0] = offline_notebook(source[0])


def setup(app):
    app.connect("source-read", _source_read)
