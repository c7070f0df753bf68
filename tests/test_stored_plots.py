"""Every plotting cell of every lesson and solution stores its picture.

A cell *plots* when it calls ``plt.subplots`` / ``plt.figure`` / ``plt.show`` / ``.plot(`` / ``.imshow(``
and is not ``NBVAL_SKIP``. nbval ignores the outputs of plot cells (``NBVAL_IGNORE_OUTPUT``), so a notebook
executed with a non-inline matplotlib backend (``MPLBACKEND=Agg`` left set) passes nbval with every figure
missing; this test is what catches it. A picture counts when the cell stores an ``image/png`` output, or
when the cell displays an ipywidgets view whose saved widget state (the notebook's ``metadata.widgets``)
holds an ``image/png`` in an ``Output`` widget reachable from that view (the stepper of lesson 4 draws
into one).
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("*.ipynb"))
PLOTS = re.compile(r"plt\.subplots|plt\.figure|plt\.show|\.plot\(|\.imshow\(")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def plotting_cells(nb):
    for i, cell in enumerate(nb["cells"]):
        src = "".join(cell["source"])
        if cell["cell_type"] == "code" and PLOTS.search(src) and "NBVAL_SKIP" not in src:
            yield i, cell


def widget_shows_image(state: dict, model_id: str, seen=None) -> bool:
    """Whether the widget ``model_id`` or any widget it references holds an image/png output."""
    seen = set() if seen is None else seen
    if model_id in seen or model_id not in state:
        return False
    seen.add(model_id)
    wstate = state[model_id].get("state", {})
    if any("image/png" in o.get("data", {}) for o in wstate.get("outputs", [])):
        return True
    refs = re.findall(r"IPY_MODEL_([0-9a-f]+)", json.dumps(wstate))
    return any(widget_shows_image(state, r, seen) for r in refs)


def stores_image(cell, widget_state: dict) -> bool:
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        if "image/png" in data:
            return True
        if WIDGET_VIEW in data and widget_shows_image(widget_state, data[WIDGET_VIEW]["model_id"]):
            return True
    return False


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_plotting_cell_stores_an_image(path):
    nb = json.loads(path.read_text())
    state = nb["metadata"].get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    missing = [i for i, cell in plotting_cells(nb) if not stores_image(cell, state)]
    assert not missing, (
        f"{path.parent.name}/{path.name}: plotting cells {missing} store no image. Execute the notebook with the "
        f"inline backend: env -u MPLBACKEND python -m jupyter nbconvert --to notebook --execute --inplace {path.name}")


def test_the_check_can_fail():
    """A figure cell with only text output (the non-inline backend's trace) is reported."""
    nb = {"cells": [{"cell_type": "code", "source": ["fig, ax = plt.subplots()\n", "plt.show()"],
                     "outputs": [{"output_type": "stream", "name": "stdout", "text": ["done\n"]}]}],
          "metadata": {}}
    assert [i for i, c in plotting_cells(nb) if not stores_image(c, {})] == [0]
    skipped = {"cell_type": "code", "source": ["# NBVAL_SKIP\n", "plt.show()"], "outputs": []}
    assert list(plotting_cells({"cells": [skipped]})) == []
