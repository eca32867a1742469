"""Start a Prefect server on loopback, run the example flow against it, and screenshot its run in
Prefect's UI with headless Chromium (Debian's `chromium` package), driven over the DevTools
protocol so that each picture waits for what it shows:

- `flow-run.png`: the flow run page;
- `flow-run-graph.png`: its graph with the parent task run expanded to its rank runs;
- `rank0-task-run.png`: rank 0's task run page, once its logs have loaded (the UI first says
  "This run didn't generate Logs" and fills them in a moment later);
- `artifacts.png`: the flow run's artifacts tab (a call leaves at most five);
- `rank-table.png`: the `train-ranks` table at 1,400 px wide, where its useful columns must fit.

    .venv/bin/python scripts/screenshot_flow_run.py OUT_DIR
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import websockets

ROOT = Path(__file__).resolve().parent.parent
WIDTH, HEIGHT = 1600, 1100
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", f"--window-size={WIDTH},{HEIGHT}"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Page:
    """One Chromium tab over the DevTools protocol: navigate, wait for text, click, screenshot."""

    def __init__(self, ws: websockets.ClientConnection) -> None:
        self._ws, self._ids = ws, itertools.count(1)

    async def send(self, method: str, **params: object) -> dict:
        call_id = next(self._ids)
        await self._ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            answer = json.loads(await self._ws.recv())
            if answer.get("id") == call_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})

    async def text(self) -> str:
        found = await self.send("Runtime.evaluate", expression="document.body ? document.body.innerText : ''",
                                returnByValue=True)
        return found.get("result", {}).get("value", "")

    async def wait_for(self, shows: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while shows not in await self.text():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page never showed {shows!r}")
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)

    async def open(self, url: str, shows: str, timeout: float = 60.0) -> None:
        """Go to `url` and wait until the page's text contains `shows` (reloading now and then:
        the UI does not always poll for what arrived after it loaded)."""
        deadline = time.monotonic() + timeout
        while True:
            await self.send("Page.navigate", url=url)
            for _ in range(20):
                await asyncio.sleep(0.5)
                if shows in await self.text():
                    await asyncio.sleep(1.0)  # let the last of it render
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} never showed {shows!r}; it showed:\n{(await self.text())[:2000]}")

    async def click(self, x: float, y: float) -> None:
        for kind in ("mousePressed", "mouseReleased"):
            await self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    async def screenshot(self, path: Path) -> None:
        shot = await self.send("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))
        print(path)


@contextlib.asynccontextmanager
async def devtools_page(devtools_port: int) -> AsyncIterator[Page]:
    """A new blank tab of the Chromium whose DevTools listen on `devtools_port` (within 30 s of
    its start), WIDTH x HEIGHT."""
    deadline = time.monotonic() + 30
    while True:
        try:
            target = httpx.put(f"http://127.0.0.1:{devtools_port}/json/new?about:blank", timeout=2).json()
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)
    async with websockets.connect(target["webSocketDebuggerUrl"], max_size=1 << 26) as ws:
        page = Page(ws)
        await page.send("Page.enable")
        await page.send("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT, deviceScaleFactor=1,
                        mobile=False)
        yield page


async def _shoot(devtools_port: int, ui: str, run: dict, tasks: list[dict], artifacts: list[dict],
                 out_dir: Path) -> None:
    async with devtools_page(devtools_port) as page:
        rank0 = next(t for t in tasks if t["name"].endswith("[rank 0/2]"))
        flow_url = f"{ui}/runs/flow-run/{run['id']}"
        await page.open(flow_url, shows=run["name"])
        await page.screenshot(out_dir / "flow-run.png")
        await page.open(f"{ui}/runs/task-run/{rank0['id']}", shows="[rank 0]")
        await page.wait_for("used over the call")  # what the rank used, on its own page
        await page.screenshot(out_dir / "rank-task-run.png")
        await _graph_expanded(page, flow_url, out_dir / "flow-run-graph.png")
        await page.open(flow_url, shows=run["name"])
        await page.send("Runtime.evaluate", expression="""[...document.querySelectorAll('*')]
            .filter(e => e.children.length === 0 && e.textContent.trim() === 'Artifacts').pop().click()""")
        await page.wait_for("train-ranks")
        await page.screenshot(out_dir / "artifacts.png")
        ranks = next(a for a in artifacts if a["key"] == "train-ranks")
        await page.send("Emulation.setDeviceMetricsOverride", width=1400, height=700, deviceScaleFactor=1, mobile=False)
        await page.open(f"{ui}/artifacts/artifact/{ranks['id']}", shows="mean CPU")
        await page.screenshot(out_dir / "rank-table.png")


async def _graph_expanded(page: Page, flow_url: str, path: Path) -> None:
    """The graph is a canvas, so the parent task's node is found in a screenshot: the first run
    of its green, left to right, top to bottom, above the state bar. A click on it opens its
    rank runs below it."""
    await page.open(flow_url, shows="train")
    where = await page.send("Runtime.evaluate", returnByValue=True, expression="""
        (() => { const c = document.querySelector('canvas'); if (!c) return null;
                 const r = c.getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; })()""")
    box = where.get("result", {}).get("value")
    if not box:
        raise RuntimeError("the flow run page has no graph canvas")
    shot = await page.send("Page.captureScreenshot", format="png")
    pixels = _png_rgb(base64.b64decode(shot["data"]))
    x0, y0, w, h = (int(v) for v in box)
    node = next(((x, y) for y in range(y0 + 10, y0 + h - 40) for x in range(x0, x0 + w)
                 if _is_node_green(pixels[y][x]) and all(_is_node_green(pixels[y][x + d]) for d in range(1, 30))), None)
    if node is None:
        raise RuntimeError("no task run node found in the graph")
    await page.click(node[0] + 12, node[1] + 10)  # the node's chevron: expand
    await asyncio.sleep(3.0)
    await page.screenshot(path)


def _is_node_green(rgb: tuple[int, int, int]) -> bool:
    r, g, b = rgb
    return g > 130 and g > r + 60 and g > b + 40


def _png_rgb(data: bytes) -> list[list[tuple[int, int, int]]]:
    """Rows of (r, g, b) from Chromium's 8-bit RGB(A) PNG (no Pillow in the dev environment)."""
    import struct
    import zlib

    width, height, depth, color = struct.unpack(">IIBB", data[16:26])
    assert depth == 8 and color in (2, 6), (depth, color)
    channels = 3 if color == 2 else 4
    chunks, pos = [], 8
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        if kind == b"IDAT":
            chunks.append(data[pos + 8:pos + 8 + length])
        pos += 12 + length
    raw, stride, rows, prev = zlib.decompress(b"".join(chunks)), width * channels, [], bytearray(width * channels)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b, c = prev[i], prev[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append([tuple(line[x * channels:x * channels + 3]) for x in range(width)])
        prev = line
    return rows


def _wait_healthy(api: str) -> None:
    """Until the Prefect server at `api` answers its health check."""
    while True:
        try:
            if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)


def _latest_flow_run(api: str) -> tuple[dict, list[dict]]:
    """The flow run that started last, and its task runs."""
    run = httpx.post(f"{api}/flow_runs/filter", json={"limit": 1, "sort": "START_TIME_DESC"}).json()[0]
    return run, httpx.post(f"{api}/task_runs/filter", json={"flow_runs": {"id": {"any_": [run["id"]]}}}).json()


def _chromium(profile: str, devtools_port: int) -> subprocess.Popen:
    """Headless Chromium with its DevTools on loopback, its profile in `profile`."""
    return subprocess.Popen(["chromium", *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                             f"--remote-debugging-port={devtools_port}", "--remote-debugging-address=127.0.0.1",
                             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop(procs: tuple[subprocess.Popen | None, ...], *folders: str | Path) -> None:
    """The browser and the server, then their folders."""
    for proc in procs:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp())
    port, devtools_port = _free_port(), _free_port()
    api, ui = f"http://127.0.0.1:{port}/api", f"http://127.0.0.1:{port}"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_API_URL": api}
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    browser = None
    profile = tempfile.mkdtemp()
    try:
        _wait_healthy(api)
        subprocess.run([sys.executable, str(ROOT / "flows/ddp_train.py")], env={**env, "SKYTASKS_EXAMPLE_EPOCHS": "4",
                       "SKYTASKS_EXAMPLE_SAMPLES": "512"}, check=True, cwd=ROOT)
        run, tasks = _latest_flow_run(api)
        browser = _chromium(profile, devtools_port)
        artifacts = httpx.post(f"{api}/artifacts/filter", json={"flow_runs": {"id": {"any_": [run["id"]]}}}).json()
        print(f"artifacts of the flow run: {sorted(a['key'] for a in artifacts)}")
        asyncio.run(_shoot(devtools_port, ui, run, tasks, artifacts, out_dir))
    finally:
        _stop((browser, server), profile, home)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "screenshots"))
