"""The scrubber in a real JupyterLab, driven by Debian's chromium through Python playwright.

A small prepared notebook (a 12-step run written with ``dstt.store.save``, then the scrubber)
is opened in JupyterLab on 127.0.0.1 with a random token; the test runs all cells, waits for
the widget's label, moves the step slider with the keyboard (the browser's own slider, not
the Python model), and checks that the kernel answered and the page shows it: the label names
the new step, and the PNG bytes behind each view's ``<img>`` (the loss curve with its cursor,
the tensor heatmap, the change bars) differ from before the move and are the bytes the kernel
drew for the new step (read back through the kernel connection). A screenshot lands in the
test's tmp_path.

Skipped only where chromium, python playwright or jupyterlab is absent. Rejected alternative:
playwright's bundled browser — it is downloaded at install time, which CI here cannot do.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("DSTT_CHROMIUM", "/usr/bin/chromium")
KERNEL = "dstt-browser-python"
STEPS = 12

SETUP = f"""\
import numpy as np
import dstt, dstt.widgets
from dstt.store import LocalStorage, save

storage = LocalStorage("run", create=True, durability="none")
rng = np.random.default_rng(0)
w = rng.standard_normal((6, 8)).astype(np.float32)
for step in range(1, {STEPS} + 1):
    w = w + 0.1 * rng.standard_normal(w.shape).astype(np.float32)
    save(storage, step, {{"params/layers/0/weight": w, "params/layers/0/bias": w[0]}},
         metrics={{"loss": 3.0 / step + (4.0 if step == 9 else 0.0)}})
run = dstt.open("run")
"""
SHOW = "scrubber = dstt.widgets.scrubber(run, spike_window=4)\nscrubber"


def _requirements() -> str | None:
    if not (shutil.which(CHROMIUM) or Path(CHROMIUM).exists()):
        return f"chromium not found at {CHROMIUM} (apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "python playwright is not installed (pip install playwright)"
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        return "jupyterlab is not installed (pip install jupyterlab)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _notebook(path: Path) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(SETUP), nbformat.v4.new_code_cell(SHOW)]
    )
    nb.metadata["kernelspec"] = {
        "name": KERNEL,
        "display_name": "dstt browser test",
        "language": "python",
    }
    nbformat.write(nb, path)


@contextlib.contextmanager
def _jupyterlab(root: Path, home: Path) -> Iterator[str]:
    """JupyterLab serving ``root``; yields its base URL with the token."""
    port, token = _free_port(), secrets.token_hex(16)
    spec = home / "data" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "dstt browser test",
                "language": "python",
            }
        )
    )
    labconfig = home / "config" / "labconfig"
    labconfig.mkdir(parents=True)
    (labconfig / "page_config.json").write_text(
        json.dumps(  # no "news?" toast over the view
            {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}
        )
    )
    env = {
        **os.environ,
        "JUPYTER_PATH": str(home / "data"),
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
    }
    log = (home / "jupyterlab.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--allow-root",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            f"--ServerApp.token={token}",
            f"--ServerApp.root_dir={root}",
            "--ServerApp.port_retries=0",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.expose_app_in_browser=True",
        ],
        cwd=root,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        "JupyterLab did not start; log:\n"
                        + (home / "jupyterlab.log").read_text()[-3000:]
                    ) from None
                time.sleep(0.3)
        yield f"{base}|{token}"
    finally:
        proc.send_signal(signal.SIGINT)  # the server shuts its kernels down on SIGINT
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # our own session: the server and its kernels
            proc.wait(timeout=10)
        log.close()


VIEWS = ("loss", "tensor", "change")
#: the PNG bytes behind a view's <img> (a blob: URL in ipywidgets 8), base64, once loaded
IMAGE_JS = """async (cls) => {
  const img = document.querySelector(`.dstt-scrubber img.${cls}`);
  if (!img || !img.src || !img.complete || img.naturalWidth === 0) return null;
  const bytes = new Uint8Array(await (await fetch(img.src)).arrayBuffer());
  let s = "";
  for (const b of bytes) s += String.fromCharCode(b);
  return btoa(s);
}"""
#: run code in the notebook's kernel (no cell): what the kernel holds, for comparison
KERNEL_JS = """async (code) => {
  const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
  return (await kernel.requestExecute({code}).done).content.status;
}"""
DUMP = """\
from pathlib import Path
for _k, _img in scrubber.images.items():
    Path(f"kernel-{_k}.png").write_bytes(_img.value)
"""


def _shown(page: Any) -> dict[str, bytes | None]:
    """The bytes each view's <img> shows now (None while one is not loaded)."""
    out: dict[str, bytes | None] = {}
    for k in VIEWS:
        b64 = page.evaluate(IMAGE_JS, f"dstt-view-{k}")
        out[k] = None if b64 is None else base64.b64decode(b64)
    return out


def _wait_shown(page: Any, ok: Any, what: str, timeout: float = 30.0) -> dict[str, bytes | None]:
    deadline = time.monotonic() + timeout
    while True:
        shown = _shown(page)
        if ok(shown):
            return shown
        if time.monotonic() > deadline:
            sizes = {k: None if v is None else len(v) for k, v in shown.items()}
            raise AssertionError(f"the page never showed {what}; image bytes now: {sizes}")
        time.sleep(0.2)


def _label_step(page: Any) -> int:
    el = page.wait_for_selector(".dstt-scrubber-label .dstt-step", timeout=90_000)
    return int(el.get_attribute("data-step"))


def test_scrubber_moves_in_jupyterlab(tmp_path: Path) -> None:
    missing = _requirements()
    if missing and os.environ.get("CI"):
        pytest.fail(f"CI installs chromium, playwright and jupyterlab (.ci/run), but: {missing}")
    if missing:
        pytest.skip(missing)
    from playwright.sync_api import expect, sync_playwright

    root = tmp_path / "lab"
    root.mkdir()
    _notebook(root / "scrub.ipynb")
    with _jupyterlab(root, tmp_path / "jupyter") as where, sync_playwright() as pw:
        base, token = where.split("|")
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--no-first-run",
                "--disable-dev-shm-usage",
            ],
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(f"{base}/lab/tree/scrub.ipynb?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
            page.wait_for_function(
                "window.jupyterapp && window.jupyterapp.shell.currentWidget"
                " && window.jupyterapp.shell.currentWidget.sessionContext",
                timeout=90_000,
            )
            page.evaluate("window.jupyterapp.shell.currentWidget.sessionContext.ready")
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            assert _label_step(page) == STEPS
            label = page.locator(".dstt-scrubber-label")
            expect(label).to_contain_text(f"step {STEPS} ·", timeout=30_000)
            before = _wait_shown(page, lambda v: all(v.values()), "all three views")
            assert all(b is not None and b.startswith(b"\x89PNG") for b in before.values())

            handle = page.locator(".dstt-scrubber .noUi-handle").first
            handle.focus()
            page.keyboard.press("ArrowLeft")
            page.keyboard.press("ArrowLeft")
            page.keyboard.press("ArrowLeft")  # to the spike at step 9
            expect(page.locator(".dstt-scrubber-label .dstt-step")).to_have_attribute(
                "data-step", str(STEPS - 3), timeout=30_000
            )
            expect(label).to_contain_text("SPIKE", timeout=10_000)
            expect(page.locator(".dstt-scrubber .widget-readout").first).to_contain_text(
                str(STEPS - 3)
            )

            # what the user sees moved too: every view's pixels are the kernel's new drawing
            assert page.evaluate(KERNEL_JS, DUMP) == "ok"
            drawn = {k: (root / f"kernel-{k}.png").read_bytes() for k in VIEWS}
            after = _wait_shown(
                page, lambda v: v == drawn, f"the kernel's drawing of step {STEPS - 3}"
            )
            for k in VIEWS:
                assert after[k] != before[k], f"the {k} view did not change with the step"
            page.screenshot(path=str(tmp_path / "scrubber.png"), full_page=True)
        except Exception:
            with contextlib.suppress(Exception):
                page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
            raise
        finally:
            browser.close()
    assert (tmp_path / "scrubber.png").stat().st_size > 10_000
