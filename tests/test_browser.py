"""Real-browser check: the lessons run in JupyterLab with Chromium as a learner runs them, and every plot draws.

One JupyterLab server, with its default settings (windowing on: cells off screen are left out of the page), and one
headless Chromium serve every test here. Each test serves a *copy* of its lesson (JupyterLab autosaves, and the stored
lessons must keep their nbval outputs), clicks Kernel -> Restart Kernel and Run All Cells, waits for the last cell,
and fails naming every cell that raised (error outputs, or a stderr output with a Traceback). Then it scrolls every
cell with a plot or a widget output into view and fails on any plotly plot without a trace that has points
(`plot_problems`): a widget's plot that came up blank, or a static figure that did; and on any plot wider than its
cell's column in JupyterLab's default 1280 x 900 window with the file browser open (a cut legend or title).
What runs, and why:
- lesson 01, whole: type into the token viewer (the ids become the typed text's cl100k_base ids), paste a long
  paragraph (its tokens and ids wrap inside the cell). Heading ids must equal notebook_links.anchor's.
- lesson 04, whole: the sampling playground's labels are not cut off, and a move of the temperature slider changes
  the text.
- lesson 05, its first cell and its explorer cell only (the whole lesson is mostly measurements the explorer does not
  need): a slider move measures one more prompt length; two typed prompt lengths add points for the screenshot.
- lesson 06, whole: set the KV calculator's batch to 8; its summary and its cache curve follow.
- lesson 07, the cells its batch roofline needs: a batch slider move draws the new point on both plots.
- lesson 08, the cells its decode stream needs: the streamed text fills the box, and the box shows its newest line.
- lesson 09, the cells its dashboard needs: the dashboard draws its Gantt (queued, prefill, decode) and meters; its
  button is disabled while a run is in progress; a second run, of 128 requests, redraws a chart that stays under
  700 px, keeps y labels and a title clear of its legend; a moved control dims the results.
- lesson 11, the cells its interference and budget plots need: both fit the column, each run's arrival line is in
  the legend, and printed lines wrap at spaces.
- lesson 10, whole: every figure draws, each best-k star in its line's colour.
The partial lessons read those cells from the .ipynb at test time, so the test cannot drift from the lesson.

Every widget test saves a screenshot to a temporary folder, so a test run leaves the checkout as it was;
SCREENSHOT_DIR=docs refreshes the pictures the README and docs/widgets.md show.
The kernel: the server gets its own kernelspec "prefill-decode-lab" (a temp JUPYTER_PATH entry running this Python) and
PYTHONPATH starting with this checkout, and a first cell checks that the kernel imports this checkout's labutils.
Needs chromium (Debian: `apt-get install chromium fonts-noto-cjk fonts-noto-color-emoji`; `.ci/run` installs them) and
playwright (a dev extra). Without them the test skips, saying how to enable it; under CI=true it fails instead.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from kernel_preludes import ONE_RUN_A_BUDGET, ONE_SAMPLE
from notebook_links import anchors

ROOT = Path(__file__).resolve().parents[1]
LESSONS = ROOT / "notebooks"
SHOTS = Path(os.environ.get("SCREENSHOT_DIR") or tempfile.gettempdir()) / (
    "" if os.environ.get("SCREENSHOT_DIR") else "prefill-decode-lab-screenshots")
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
KERNEL = {"name": "prefill-decode-lab", "display_name": "Prefill & Decode Lab", "language": "python"}
DONE = "ALL CELLS RAN"
CHECK_LABUTILS = ("import pathlib, labutils\n"
                  "assert pathlib.Path(labutils.__file__).resolve().parent == pathlib.Path({!r}), labutils.__file__\n"
                  "print('labutils from', pathlib.Path(labutils.__file__).parent)")
PLOTS_JS = ("(sel) => JSON.stringify([...document.querySelectorAll(sel + ' .js-plotly-plot')]"
            ".map(gd => (gd.data || []).map(t => [Array.from(t.x || []), Array.from(t.y || [])])))")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kernel_env(state: Path) -> dict:
    """The server's environment: a kernelspec running this Python, this checkout first on PYTHONPATH."""
    spec = state / "kernels" / KERNEL["name"]
    spec.mkdir(parents=True)
    argv = [sys.executable, "-Xfrozen_modules=off", "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": KERNEL["display_name"],
                                                  "language": "python"}))
    # No settings at all: the learner's defaults, windowing included.
    env = dict(os.environ, JUPYTER_PATH=os.pathsep.join(filter(None, [str(state), os.environ.get("JUPYTER_PATH")])))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env


@contextlib.contextmanager
def jupyter_lab(root_dir: Path, timeout_s: float = 90):
    """Start JupyterLab on a free port with a random token and its own kernelspec; yield (url, token); stop it."""
    port, token = _free_port(), secrets.token_hex(16)
    state = Path(tempfile.mkdtemp(prefix="lab-state-"))
    env = _kernel_env(state)
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--ServerApp.port={port}",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root_dir}", "--allow-root",
           "--LabApp.expose_app_in_browser=True",                     # window.jupyterapp: read cells' outputs
           f"--LabApp.workspaces_dir={state}", f"--LabApp.user_settings_dir={state / 'settings'}"]
    log = open(state / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=root_dir, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not start; see {state / 'server.log'}")
                time.sleep(0.5)
        yield url, token
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    shutil.rmtree(state, ignore_errors=True)      # only after a clean run: a failure's message names its server.log


def shut_down_kernels(url: str, token: str) -> None:
    """One kernel at a time: a finished lesson's kernel must not compete for the 2 CPU cores with the next one."""
    with urllib.request.urlopen(f"{url}/api/kernels?token={token}", timeout=10) as r:
        kernels = json.load(r)
    for k in kernels:
        req = urllib.request.Request(f"{url}/api/kernels/{k['id']}?token={token}", method="DELETE")
        urllib.request.urlopen(req, timeout=30).close()


# What a page checks is how the plots draw, not what they measure: a lesson that times many repeats of each call
# (nbval runs it whole, as stored) is served here with one sample of each timed call and one run of each serving
# point, and lesson 10 speculates on two of the bench's four prompts (the two its cells name), which draw the same
# plots (lesson 10 here: 180 s -> 104 s; lesson 11: 110 s -> 58 s).
ONE_SAMPLE_TWO_PROMPTS = ONE_SAMPLE + """import labutils.bench as bench
bench.SPEC_PROMPTS = bench.SPEC_PROMPTS[:2]
"""


def lesson_copy(root: Path, lesson: str, pick=None, prelude: str = "") -> str:
    """Write a copy of a lesson into the served folder: a labutils check first (then `prelude`, where given), its
    cells (all, or those `pick` chooses), then a cell that prints DONE. Returns the copy's file name."""
    import nbformat
    nb = nbformat.read(LESSONS / lesson, as_version=4)
    cells = nb.cells if pick is None else pick(nb.cells)
    check = nbformat.v4.new_code_cell(CHECK_LABUTILS.format(str(ROOT / "labutils")) + "\n" + prelude)
    nb.cells = [check, *cells, nbformat.v4.new_code_cell(f"print({DONE!r})")]
    nb.metadata["kernelspec"] = KERNEL
    name = lesson if pick is None else lesson.replace(".ipynb", "_widget.ipynb")
    nbformat.write(nb, root / name)
    return name


def code_cells(cells, *markers: str) -> list:
    """The first code cell, then for each marker the first code cell whose source contains it."""
    code = [c for c in cells if c.cell_type == "code"]
    chosen = [code[0]]
    for marker in markers:
        found = [c for c in code if marker in c.source]
        assert found, f"no code cell of the lesson contains {marker!r}; update the marker in tests/test_browser.py"
        chosen.append(found[0])
    return chosen


def cell_report(page) -> list[dict]:
    """Every code cell of the open notebook: its index, execution count, printed text, and its error outputs and
    stderr tracebacks. It walks the notebook's model and copies only streams and errors: run_all reads it every second
    while a lesson runs, and serializing plotly figures that often took the CPU the lesson ran on."""
    return page.evaluate("""() => { const cells = window.jupyterapp.shell.currentWidget.context.model.cells, out = [];
        for (let i = 0; i < cells.length; i++) {
            const c = cells.get(i);
            if (c.type !== 'code') continue;
            let text = '';
            const errors = [];
            for (let j = 0; j < c.outputs.length; j++) {
                const o = c.outputs.get(j);
                if (o.type !== 'stream' && o.type !== 'error') continue;
                const json = o.toJSON(), t = [].concat(json.text || []).join('');
                if (o.type === 'error') errors.push(`${json.ename}: ${json.evalue}`);
                else if (json.name === 'stderr' && t.includes('Traceback')) errors.push(t.slice(-400));
                text += t; }
            out.push({i, count: c.executionCount ?? null, text, errors,
                      source: c.sharedModel.getSource().slice(0, 80)}); }
        return out; }""")


def run_all(page, url: str, token: str, notebook: str, timeout_s: float = 300) -> None:
    """Open a notebook, wait for its kernel, Kernel -> Restart Kernel and Run All Cells, wait for the last cell;
    fail on any cell's error. Cells are read from the notebook's model, which holds them all even while
    JupyterLab's windowing keeps most of them out of the page."""
    # A workspace of its own, reset: JupyterLab would otherwise reopen (and restart the kernels of) earlier lessons.
    page.goto(f"{url}/lab/workspaces/{Path(notebook).stem}/tree/{notebook}?reset&token={token}")
    page.wait_for_selector(".jp-Notebook", timeout=timeout_s * 1000)
    # The status bar reads "<kernel name> | Idle" once the kernel has really started.
    page.wait_for_selector(".jp-StatusBar-TextItem:has-text('| Idle')", timeout=timeout_s * 1000)
    with contextlib.suppress(Exception):         # JupyterLab's first-run "news?" toast; not always shown
        page.click(".jp-toast-button:has-text('No')", timeout=2000)
    page.click(".lm-MenuBar-itemLabel:text-is('Kernel')")
    page.click(".lm-Menu-itemLabel:text-is('Restart Kernel and Run All Cells…')")
    page.click(".jp-Dialog-button.jp-mod-accept", timeout=30_000)       # "Restart" in the confirmation
    deadline = time.monotonic() + timeout_s
    while True:                                  # an error stops Run All, so DONE alone could wait forever
        cells = cell_report(page)
        errors = [c for c in cells if c["errors"]]
        if errors or DONE in cells[-1]["text"] or time.monotonic() > deadline:
            break
        page.wait_for_timeout(1000)
    assert not errors, f"{notebook}: cells raised: " + "; ".join(
        f"cell {c['i']} ({c['source']!r}): {' | '.join(c['errors'])}" for c in errors)
    assert DONE in cells[-1]["text"], f"{notebook}: not every cell ran within {timeout_s:.0f} s: " + ", ".join(
        f"cell {c['i']} count {c['count']}" for c in cells if c["count"] is None)


def show_cell(page, marker: str) -> int:
    """Scroll the first cell whose source contains `marker` into view (windowing attaches it); return its index."""
    index = page.evaluate("""(marker) => {
        const nb = window.jupyterapp.shell.currentWidget.content;
        const i = nb.widgets.findIndex(c => c.model.sharedModel.getSource().includes(marker));
        if (i >= 0) { nb.activeCellIndex = i; nb.scrollToItem(i, 'start'); }
        return i; }""", marker)
    assert index >= 0, f"no cell contains {marker!r}; update the marker in tests/test_browser.py"
    page.wait_for_timeout(500)
    return index


# Per cell, per plot: [traces, traces with points, its width, the room from its left edge to the cell's right edge].
# Plotly keeps the figure it drew on the element (gd.data, and gd._fullLayout.width: the width it drew at).
CELL_PLOTS_JS = """(i) => { const nb = window.jupyterapp.shell.currentWidget.content; const cell = nb.widgets[i];
    nb.scrollToItem(i, 'center');
    if (!cell.node.isConnected) return null;
    return [...cell.node.querySelectorAll('.js-plotly-plot')].map(gd => {
        const data = gd.data || [];
        const points = t => ['x', 'y', 'z', 'values'].some(k => t[k] && t[k].length > 0);
        const area = gd.closest('.jp-Cell-outputArea');
        return [data.length, data.filter(points).length,
                Math.round(gd._fullLayout ? gd._fullLayout.width : gd.getBoundingClientRect().width),
                area ? area.getBoundingClientRect().right - gd.getBoundingClientRect().left : Infinity]; }); }"""


def plot_problems(page) -> list[str]:
    """Scroll through every cell that may hold a plot and name each plotly plot that has no trace with points, is
    not drawn at all where the notebook's model says a plot was output, or is wider than the cell's output column
    (its right edge, a legend or a title, then sits out of sight)."""
    problems = []
    # Per cell: its plotly outputs, and whether any output can hold a plot (a plotly figure, a widget, or HTML that
    # draws one). Only those cells are scrolled to: a lesson's other cells cannot show a plot.
    expected = page.evaluate("""() => window.jupyterapp.shell.currentWidget.context.model.toJSON().cells.map(c => {
        const data = (c.outputs || []).map(o => o.data || {});
        return [data.filter(d => d['application/vnd.plotly.v1+json']).length,
                data.some(d => d['application/vnd.plotly.v1+json'] || d['application/vnd.jupyter.widget-view+json']
                               || [].concat(d['text/html'] || []).join('').includes('plotly'))]; })""")
    for i, (plotly_outputs, may_plot) in enumerate(expected):
        if not may_plot:
            continue
        page.evaluate(CELL_PLOTS_JS, i)
        page.wait_for_timeout(150)                   # the renderer draws once the cell is attached
        found = page.evaluate(CELL_PLOTS_JS, i)
        if found is None:
            problems.append(f"cell {i}: never attached to the page")
            continue
        if len(found) < plotly_outputs:
            problems.append(f"cell {i}: {plotly_outputs} plotly outputs in the notebook, {len(found)} drawn")
        for j, (traces, drawn, width, room) in enumerate(found):
            if drawn == 0:
                problems.append(f"cell {i}, plot {j}: {traces} traces, none with points")
            if width > room:
                problems.append(f"cell {i}, plot {j}: {width} px wide in an output column of {room:.0f} px")
    return problems


def assert_every_plot_drawn(page) -> None:
    problems = plot_problems(page)
    assert not problems, "plots that did not draw, or do not fit their column:\n" + "\n".join(problems)


def plots(page, scope: str) -> str:
    """Every plotly figure's trace x and y values inside `scope` (a CSS selector), as one comparable string."""
    return page.evaluate(PLOTS_JS, scope)


def wait_for_new_plots(page, scope: str, before: str, timeout_s: float) -> None:
    page.wait_for_function(f"([sel, before]) => ({PLOTS_JS})(sel) !== before", arg=[scope, before],
                           timeout=timeout_s * 1000)


def type_into_readout(page, widget: str, label: str, value: int) -> None:
    """Type a value into a slider's readout (one change, so one observer call), as a learner does."""
    readout = page.locator(f"{widget} .widget-slider:has(label:text-is('{label}')) .widget-readout").first
    readout.scroll_into_view_if_needed()
    readout.click()
    page.keyboard.press("Control+A")
    page.keyboard.type(str(value))
    page.keyboard.press("Enter")


def save_shot(page, widget: str, name: str) -> None:
    page.wait_for_timeout(1000)                  # let plotly finish its transition
    SHOTS.mkdir(parents=True, exist_ok=True)
    target = page.locator(widget).first
    target.scroll_into_view_if_needed()
    target.screenshot(path=str(SHOTS / name))


def _missing(reason: str) -> None:
    """CI must prove what a learner sees, so there a missing browser is a failure, not a skip."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """(page factory, url, token, served folder): one server and one browser for every lesson here."""
    if CHROMIUM is None:
        _missing("no chromium on PATH (Debian: apt-get install chromium; or set CHROMIUM=/path/to/it)")
    try:
        sync_api = __import__("playwright.sync_api", fromlist=["sync_playwright"])
    except ImportError:
        _missing("playwright is not installed (pip install -e '.[dev]')")
    try:
        __import__("ipykernel")
    except ImportError:
        _missing(f"ipykernel is not installed in {sys.executable} (make setup)")
    root = tmp_path_factory.mktemp("served")
    with jupyter_lab(root) as (url, token), sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser, url, token, root
        browser.close()


@contextlib.contextmanager
def served_page(lab, notebook: str, timeout_s: float = 300):
    """A page with a notebook of the served folder run to the end; its kernel is shut down afterwards."""
    browser, url, token, _ = lab
    # JupyterLab's defaults as a learner meets them: a 1280 x 900 window with the file browser open, which leaves
    # the notebook an output column of about 845 px.
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        run_all(page, url, token, notebook, timeout_s)
        yield page
    finally:
        page.close()
        shut_down_kernels(url, token)


def lesson_page(lab, lesson: str, pick=None, timeout_s: float = 300, prelude: str = ""):
    """A page with the lesson (or the cells `pick` chooses) run to the end."""
    return served_page(lab, lesson_copy(lab[3], lesson, pick, prelude), timeout_s)


def label_cuts(page, scope: str) -> list[str]:
    """Widget labels and button captions inside `scope` that the page cuts off with an ellipsis."""
    return page.evaluate("""(sel) => [...document.querySelectorAll(sel + ' .widget-label, ' + sel + ' button')]
        .filter(e => e.offsetParent !== null && e.scrollWidth > e.clientWidth + 1).map(e => e.textContent)""", scope)


def test_the_plot_check_names_a_plot_without_points_and_one_too_wide(lab):
    """The check every lesson's page gets can fail: a static figure and a FigureWidget with no points, and a figure
    wider than its column, are each named; a drawn figure and a cell with only printed text are not."""
    import nbformat
    cells = ["import plotly.graph_objects as go\nprint('printed text only')",
             "go.Figure(go.Scatter(x=[1, 2], y=[1, 2])).show()",
             "go.Figure(go.Scatter(x=[], y=[])).show()",
             "go.FigureWidget(go.Scatter(x=[], y=[]))",
             "go.Figure(go.Scatter(x=[1], y=[1]), layout=dict(width=2000)).show()",
             f"print({DONE!r})"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells], metadata={"kernelspec": KERNEL})
    nbformat.write(nb, lab[3] / "plot_check.ipynb")
    with served_page(lab, "plot_check.ipynb") as page:
        problems = plot_problems(page)
    assert [p.split(":")[0] for p in problems] == ["cell 2, plot 0", "cell 3, plot 0", "cell 4, plot 0"], problems
    assert "none with points" in problems[1] and "2000 px wide" in problems[2], problems


def test_lesson01_token_viewer_shows_the_ids_of_what_is_typed(lab):
    from labutils.text.tokenizer import encode, get_encoding
    viewer = ".jp-OutputArea-output:has(.token-counts)"
    typed = "Prefill reads the prompt; decode writes 東京の天気 🙂 one token at a time."
    with lesson_page(lab, "01_tokenization.ipynb") as page:
        assert_every_plot_drawn(page)
        show_cell(page, "token_viewer(")
        ids_line = page.locator(f"{viewer} .token-ids").last
        before = ids_line.inner_text()
        page.locator(f"{viewer} textarea").first.fill(typed)
        page.wait_for_function("([sel, before]) => document.querySelector(sel).innerText !== before",
                               arg=[f"{viewer} .token-ids", before], timeout=30_000)
        assert json.loads(ids_line.inner_text()) == encode(get_encoding("cl100k_base"), typed)
        save_shot(page, viewer, "token_viewer.png")
        # A pasted paragraph wraps inside the cell: no block of tokens or ids is wider than the output area.
        page.locator(f"{viewer} textarea").first.fill(" ".join(["Prefill reads the whole prompt at once."] * 60))
        page.wait_for_timeout(1500)
        widths = page.evaluate("""(sel) => { const out = document.querySelector(sel);
            return [out.clientWidth, ...[...out.querySelectorAll('.token-spans, .token-ids')].map(e => e.scrollWidth)]; }""",
                               viewer)
        assert max(widths[1:]) <= widths[0], f"tokens or ids overflow the cell: {widths}"
        # The README's and test_lessons' links rely on notebook_links.anchor: it must give JupyterLab's own ids.
        ids = set()
        for i in range(page.evaluate("() => window.jupyterapp.shell.currentWidget.content.widgets.length")):
            ids |= set(page.evaluate("""(i) => { const nb = window.jupyterapp.shell.currentWidget.content;
                nb.scrollToItem(i); return [...nb.widgets[i].node.querySelectorAll('.jp-MarkdownOutput :is(h1, h2, h3)')]
                .map(h => h.id || h.getAttribute('data-jupyter-id')); }""", i))
        assert ids == anchors(LESSONS / "01_tokenization.ipynb")


def test_lesson04_sampling_playground_answers_and_shows_its_labels(lab):
    playground = ".jp-OutputArea-output:has(.widget-slider):has(textarea)"
    with lesson_page(lab, "04_tiny_transformer.ipynb") as page:
        assert_every_plot_drawn(page)
        show_cell(page, "widgets.VBox([*controls.values(), text_out])")
        assert label_cuts(page, playground) == []
        text = page.locator(f"{playground} textarea").first
        before = text.input_value()
        assert before and not before.startswith("(")
        type_into_readout(page, playground, "temperature", 1.5)
        page.wait_for_function("([sel, before]) => document.querySelector(sel + ' textarea').value !== before",
                               arg=[playground, before], timeout=60_000)
        save_shot(page, playground, "sampling.png")


def test_lesson05_explorer_redraws_after_a_slider_move(lab):
    explorer = ".jp-OutputArea-output:has(.widget-slider):has(.js-plotly-plot)"
    pick = lambda cells: code_cells(cells, "explorer(")                        # noqa: E731
    with lesson_page(lab, "05_prefill_decode.ipynb", pick) as page:
        show_cell(page, "explorer(")
        done = ("(sel) => [...document.querySelectorAll(sel + ' .widget-html-content')]"
                ".some(e => e.textContent.includes('TTFT') && e.textContent.includes('copy bandwidth'))")
        page.wait_for_function(done, arg=explorer, timeout=300_000)
        assert page.locator(f"{explorer} .widget-slider").count() >= 3            # prompt, output, batch
        assert page.locator(f"{explorer} .js-plotly-plot").count() == 3           # timeline, sweep, utilization
        assert_every_plot_drawn(page)
        assert label_cuts(page, explorer) == []
        show_cell(page, "explorer(")
        before = plots(page, explorer)
        handle = page.locator(f"{explorer} .widget-slider:has(label:text-is('prompt tokens')) .noUi-handle").first
        handle.scroll_into_view_if_needed()
        handle.focus()
        page.keyboard.press("ArrowRight")                                       # 128 -> 136 tokens
        wait_for_new_plots(page, explorer, before, timeout_s=300)
        page.wait_for_function(done, arg=explorer, timeout=300_000)
        after = json.loads(plots(page, explorer))
        assert len(after[1][0][0]) == len(json.loads(before)[1][0][0]) + 1      # one more measured prompt length
        assert max(after[2][0][1]) <= 100                                       # no bar above 100% of a peak
        for n in (256, 512):                                                    # a sweep worth a screenshot
            before = plots(page, explorer)
            type_into_readout(page, explorer, "prompt tokens", n)
            wait_for_new_plots(page, explorer, before, timeout_s=300)
            page.wait_for_function(done, arg=explorer, timeout=300_000)
        save_shot(page, explorer, "explorer.png")


def test_lesson06_kv_calculator_answers_a_batch_change(lab):
    from labutils.widgets.kv_calculator import kv_summary
    calc = ".jp-OutputArea-output:has(.widget-toggle-buttons):has(.js-plotly-plot)"
    with lesson_page(lab, "06_kv_cache.ipynb") as page:
        assert_every_plot_drawn(page)
        show_cell(page, "kv_calculator(")
        summary = page.locator(f"{calc} .widget-html-content").first
        assert summary.inner_text() == kv_summary("llama-2-7b", 4096, 1, "fp16")["text"]
        before = plots(page, calc)
        assert json.loads(before)[0][0][0], "the KV calculator's cache curve has no points"
        type_into_readout(page, calc, "batch", 8)
        wait_for_new_plots(page, calc, before, timeout_s=30)
        assert summary.inner_text() == kv_summary("llama-2-7b", 4096, 8, "fp16")["text"]
        # Plotly names a trace it got no name for "trace N"; every entry the learner sees must say what it is.
        legend = page.locator(f"{calc} .legendtext").all_text_contents()
        assert "crossover" in legend and not [t for t in legend if re.fullmatch(r"trace \d+", t)], legend
        save_shot(page, calc, "kv_calculator.png")


def test_lesson07_batch_roofline_draws_each_batch(lab):
    board = ".jp-OutputArea-output:has(.widget-slider):has(.js-plotly-plot)"
    pick = lambda cells: code_cells(cells, "PRESET, DTYPE = ", "measured_peaks(", "batch_roofline(")        # noqa: E731
    with lesson_page(lab, "07_memory_wall.ipynb", pick) as page:
        assert_every_plot_drawn(page)
        show_cell(page, "batch_roofline(")
        assert page.locator(f"{board} .js-plotly-plot").count() == 2              # roofline, tokens/s
        before = plots(page, board)
        handle = page.locator(f"{board} .widget-slider .noUi-handle").first
        handle.scroll_into_view_if_needed()
        handle.focus()
        for _ in range(3):
            page.keyboard.press("ArrowRight")                                   # batch 1 -> 8
        wait_for_new_plots(page, board, before, timeout_s=120)
        page.wait_for_function("(sel) => document.querySelector(sel).innerText.includes('batch 8')",
                               arg=board, timeout=120_000)
        assert_every_plot_drawn(page)
        save_shot(page, board, "batch_roofline.png")


def test_lesson08_decode_stream_keeps_the_newest_text_in_view(lab):
    stream = ".jp-OutputArea-output:has(.decode-stream)"
    pick = lambda cells: code_cells(cells, "load_pretrained(", "model = copy.deepcopy(tiny)", "decode_stream(")  # noqa
    with lesson_page(lab, "08_fast_decode.ipynb", pick) as page:
        show_cell(page, "decode_stream(")
        box = page.locator(f"{stream} .decode-stream").first
        page.wait_for_function("(sel) => document.querySelector(sel).innerText.includes('120 tokens')",
                               arg=stream, timeout=120_000)
        state = box.evaluate("""b => ({overflows: b.scrollHeight > b.clientHeight,
            atEnd: Math.abs(b.scrollTop) < 2 || b.scrollHeight - b.clientHeight - b.scrollTop < 2,
            column: getComputedStyle(b).flexDirection, color: getComputedStyle(b).color,
            page: getComputedStyle(document.body).color})""")
        assert state["overflows"], "120 tokens should fill more than the box"
        # column-reverse anchors the view at the newest text (scrollTop 0 there means the end).
        assert state["column"] == "column-reverse" and state["atEnd"], state
        assert state["color"] == state["page"], f"the stream's text is not in the page's colour: {state}"
        save_shot(page, stream, "decode_stream.png")


def test_lesson09_dashboard_serves_and_draws_its_gantt(lab):
    board = ".jp-OutputArea-output:has(.widget-button):has(.js-plotly-plot)"      # plain CSS: page JS reads it too
    pick = lambda cells: code_cells(cells, "load_pretrained(", "serving_dashboard(")  # noqa: E731
    with lesson_page(lab, "09_serving.ipynb", pick) as page:
        show_cell(page, "serving_dashboard(")
        page.wait_for_selector(f"{board} .js-plotly-plot", timeout=60_000)
        assert "TTFT p50 / p99" in page.locator(board).inner_text()
        first = plots(page, board)
        assert json.loads(first)[0], "the dashboard's Gantt has no traces after dashboard.run()"
        legend = set(page.locator(f"{board} .legendtext").all_text_contents())
        assert {"queued", "prefill", "decode"} <= legend, legend
        assert label_cuts(page, board) == []                                     # "Run wor..." was cut once
        type_into_readout(page, board, "requests", 128)                          # the slider's most
        button = page.locator(f"{board} button:has-text('Run workload')")
        button.click()
        page.wait_for_function("(sel) => document.querySelector(sel + ' button').disabled", arg=board,
                               timeout=30_000)                                   # disabled while it serves
        wait_for_new_plots(page, board, first, timeout_s=300)
        page.wait_for_function("(sel) => !document.querySelector(sel + ' button').disabled", arg=board,
                               timeout=300_000)
        assert "Could not serve" not in page.locator(board).inner_text()
        assert_every_plot_drawn(page)
        show_cell(page, "serving_dashboard(")
        chart = page.evaluate("""(sel) => { const gd = document.querySelector(sel + ' .js-plotly-plot');
            const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
            return {height: gd._fullLayout.height, rows: gd.data.map(t => t.y.length),
                    yticks: gd.querySelectorAll('.ytick text').length,
                    title: box(gd.querySelector('.gtitle')), legend: box(gd.querySelector('.legend'))}; }""", board)
        # 128 rows once made a chart 1,912 px tall with no y labels and its title on its legend.
        assert chart["height"] <= 700 and chart["yticks"] >= 3, chart
        t, g = chart["title"], chart["legend"]
        assert t[2] <= g[0] or g[2] <= t[0] or t[3] <= g[1] or g[3] <= t[1], f"the title overlaps the legend: {chart}"
        save_shot(page, board, "serving_dashboard.png")
        # A moved control dims the results it no longer describes, and the status line says so.
        type_into_readout(page, board, "batch slots", 4)
        page.wait_for_function("(sel) => { const e = document.querySelector(sel + ' .pdl-stale');"
                               " return e !== null && getComputedStyle(e).opacity < 0.5; }", arg=board, timeout=30_000)
        assert "settings changed" in page.locator(board).inner_text()


def test_lesson11_plots_fit_and_label_each_runs_arrival(lab):
    pick = lambda cells: code_cells(cells, "model = GPT(cfg)", "wide = build(", "itl_figure(runs",  # noqa
                                    "budget_figure(points)")
    with lesson_page(lab, "11_two_phases.ipynb", pick, timeout_s=600, prelude=ONE_RUN_A_BUDGET) as page:
        assert_every_plot_drawn(page)
        # Printed lines wrap at spaces on this page (labutils.PAGE_STYLE), not mid-word as JupyterLab's default.
        assert page.evaluate("() => { const pre = document.querySelector('.jp-OutputArea-output pre');"
                             " return pre && getComputedStyle(pre).wordBreak; }") == "normal"
        for marker, name in (("itl_figure(runs", "itl.png"), ("budget_figure(points)", "budgets.png")):
            show_cell(page, marker)
            cell = ".jp-Cell.jp-mod-active .js-plotly-plot"
            if name == "itl.png":
                page.wait_for_selector(f"{cell} .legendtext", state="attached", timeout=30_000)
                legend = page.locator(f"{cell} .legendtext").all_text_contents()
                assert sum("the long prompt arrives" in t for t in legend) == 2, legend
            save_shot(page, cell, name)


def test_lesson10_every_figure_draws_and_stars_match_their_lines(lab):
    with lesson_page(lab, "10_speculative_decoding.ipynb", timeout_s=900, prelude=ONE_SAMPLE_TWO_PROMPTS) as page:
        assert_every_plot_drawn(page)
        show_cell(page, 'symbol="star"')
        colours = page.evaluate("""() => { const gd = document.querySelector('.jp-Cell.jp-mod-active .js-plotly-plot');
            const line = {}, star = {};
            for (const t of gd._fullData) {
                if (t.marker && t.marker.symbol === 'star') star[t.legendgroup] = t.marker.color;
                else if (t.legendgroup) line[t.legendgroup] = t.line.color; }
            return [line, star]; }""")
        line, star = colours
        assert star and all(star[g] == line.get(g) for g in star), colours
