"""Look at the GPU Pool block and the example deployment in Prefect's UI, as a person meets them:
a real `prefect server start` on loopback and headless Chromium (Debian's `chromium` package),
driven over the DevTools protocol so that each picture waits for what it shows.

- `gpu-pool-create.png`: Blocks -> GPU Pool -> Create, as it opens (before a provider is chosen);
- `gpu-pool-create-<provider>.png`: the same form after choosing each provider's tab;
- `gpu-pool-edit.png`: the edit form of a saved ssh pool;
- `deployment-run-pool-picker.png`: the example deployment's custom run, with the saved GPU Pools
  offered in the `pool` parameter's picker and one of them picked.

It prints the number of input fields each form shows (the DOM query `FIELDS_JS`, over the rendered
page: what a person sees, not the block's schema). tests/test_prefect_ui_form.py uses the same parts.

    .venv/bin/python scripts/screenshot_ui.py [OUT_DIR]        # default: docs/
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import websockets

from scripts.screenshot_flow_run import CHROMIUM_FLAGS, HEIGHT, WIDTH, Page, _free_port
from tests.harness.processes import end

ROOT = Path(__file__).resolve().parent.parent

PROVIDERS = ("local", "ssh", "aws", "slurm", "kubernetes")

# Every input a person fills in or picks from in the page's form, counted where it is rendered
# (a hidden tab's fields are not). Prefect's schema form renders text, number and secret fields as
# <input>, choices and block pickers as <select>, long strings and JSON as <textarea>.
FIELDS_JS = """(() => {
  const form = document.querySelector('form');
  if (!form) return null;
  const shown = e => { const r = e.getBoundingClientRect(); return r.width > 0 && r.height > 0; };
  const fields = [...form.querySelectorAll('input:not([type=hidden]), select, textarea, [role=combobox]')].filter(shown);
  const labels = [...form.querySelectorAll('label')].filter(shown).map(l => l.innerText.split('\\n')[0].trim());
  return {count: fields.length, labels: labels};
})()"""


class UI:
    """A Prefect server with its UI and a headless Chromium looking at it, both on loopback.

    `database`: a migrated Prefect database to start from (a fresh one is migrated first, which
    takes Prefect 20 s or more here)."""

    def __init__(self, database: Path | None = None) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="skytasks-ui-"))
        if database is not None:
            shutil.copy(database, self.home / "prefect.db")
        port, self.devtools_port = _free_port(), _free_port()
        self.ui, self.api = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/api"
        self.env = {**os.environ, "PREFECT_HOME": str(self.home), "PREFECT_API_URL": self.api,
                    "PREFECT_UI_API_URL": self.api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        self._procs: list[subprocess.Popen] = []
        self._profile = tempfile.mkdtemp(prefix="skytasks-chromium-")

    def __enter__(self) -> UI:
        try:
            # Started in its own home, not the repository: its skytasks is the installed one.
            self._procs.append(subprocess.Popen(
                [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                 "--port", self.ui.rsplit(":", 1)[1]], cwd=self.home, env=self.env,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            chromium = shutil.which("chromium") or shutil.which("chromium-browser")
            if chromium is None:
                raise RuntimeError("no chromium on PATH (Debian: apt-get install chromium; `make system-deps` does)")
            self._procs.append(subprocess.Popen(
                [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={self._profile}", "--remote-debugging-address=127.0.0.1",
                 f"--remote-debugging-port={self.devtools_port}", "about:blank"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self._wait_for(f"{self.api}/block_types/slug/gpu-pool", "the server's GPU Pool block type")
            self._wait_for(f"http://127.0.0.1:{self.devtools_port}/json/version", "Chromium's DevTools")
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_for(self, url: str, what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or any(p.poll() is not None for p in self._procs):
                raise RuntimeError(f"{what} never came up at {url}")
            time.sleep(0.3)

    def __exit__(self, *exc_info: Any) -> None:
        for proc in reversed(self._procs):
            end(proc, 30)
        self._procs.clear()
        shutil.rmtree(self._profile, ignore_errors=True)
        shutil.rmtree(self.home, ignore_errors=True)

    def tab(self) -> FormPage:
        """A new Chromium tab (use it with `async with`)."""
        return FormPage(self.devtools_port)


class FormPage(Page):
    """A Chromium tab that also reads and fills Prefect's forms."""

    def __init__(self, devtools_port: int) -> None:
        self._port = devtools_port

    async def __aenter__(self) -> FormPage:
        target = httpx.put(f"http://127.0.0.1:{self._port}/json/new?about:blank", timeout=10).json()
        self._conn = websockets.connect(target["webSocketDebuggerUrl"], max_size=1 << 26)
        super().__init__(await self._conn.__aenter__())
        await self.send("Page.enable")
        await self.resize(WIDTH, HEIGHT)
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self._conn.__aexit__(*exc_info)

    async def resize(self, width: int, height: int) -> None:
        await self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                        mobile=False)

    async def js(self, expression: str) -> Any:
        found = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in found:
            raise RuntimeError(f"{expression[:80]}...: {found['exceptionDetails']}")
        return found.get("result", {}).get("value")

    async def fields(self) -> dict:
        """{"count": the input fields the page's form shows, "labels": the labels it shows}."""
        return await self.js(FIELDS_JS)

    async def click_button(self, text: str) -> None:
        """Click the form's button that reads `text` (a provider's tab, a union's choice)."""
        clicked = await self.js(f"""(() => {{ const b = [...document.querySelectorAll('form button')]
            .find(e => e.innerText.trim() === {json.dumps(text)}); if (b) b.click(); return !!b; }})()""")
        if not clicked:
            raise RuntimeError(f"no button {text!r} in the form")
        await asyncio.sleep(1.0)

    async def pick(self, option: str) -> None:
        """Choose `option` in the form's select that offers it (a block picker)."""
        picked = await self.js(f"""(() => {{
            const s = [...document.querySelectorAll('form select')]
                .find(s => [...s.options].some(o => o.text === {json.dumps(option)}));
            if (!s) return false;
            s.value = [...s.options].find(o => o.text === {json.dumps(option)}).value;
            s.dispatchEvent(new Event('change', {{bubbles: true}})); return true; }})()""")
        if not picked:
            raise RuntimeError(f"no picker offers {option!r}")
        await asyncio.sleep(1.0)

    async def whole_form(self, path: Path) -> None:
        """A screenshot tall enough for the whole form."""
        bottom = await self.js("(() => { const f = document.querySelector('form'); "
                               "return f ? f.getBoundingClientRect().bottom + window.scrollY : 0; })()")
        await self.resize(WIDTH, max(HEIGHT, int(bottom or 0) + 60))
        await asyncio.sleep(0.5)
        await self.screenshot(path)
        await self.resize(WIDTH, HEIGHT)


def create_form_url(ui: UI) -> str:
    return f"{ui.ui}/blocks/catalog/gpu-pool/create"


def save_pools(ui: UI) -> dict[str, str]:
    """Two saved pools, in a process of their own pointed at `ui`'s API: {name: block document id}."""
    code = ("from skytasks import GPUPool\n"
            "print(GPUPool(provider='local', nodes=2).save('local-two', overwrite=True))\n"
            "print(GPUPool(provider='ssh', nodes=2, accelerator='A100', hosts=['alice@gpu-1', 'alice@gpu-2'])"
            ".save('team-ssh', overwrite=True))\n")
    out = subprocess.run([sys.executable, "-c", code], env=ui.env, cwd=ui.home, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    return {"local-two": out[-2], "team-ssh": out[-1]}


def deploy_example(ui: UI) -> str:
    """The example deployment (deployments/prefect.yaml), as its docs deploy it; its id."""
    from prefect.workers.process import ProcessWorker

    httpx.post(f"{ui.api}/work_pools/", json={"name": "skytasks-local", "type": "process",
                                              "base_job_template": ProcessWorker.get_default_base_job_template()})
    subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file",
                    "deployments/prefect.yaml"], env=ui.env, cwd=ROOT, capture_output=True, timeout=300, check=True)
    return httpx.get(f"{ui.api}/deployments/name/ddp-train/ddp-train-nightly").json()["id"]


async def shoot(ui: UI, out_dir: Path) -> None:
    pools = save_pools(ui)
    deployment = deploy_example(ui)
    async with ui.tab() as page:
        await page.open(create_form_url(ui), shows="Nodes")
        seen = await page.fields()
        print(f"create form, as it opens: {seen['count']} input fields")
        await page.whole_form(out_dir / "gpu-pool-create.png")
        for provider in PROVIDERS:
            await page.click_button(provider)
            seen = await page.fields()
            print(f"create form, {provider} chosen: {seen['count']} input fields")
            await page.whole_form(out_dir / f"gpu-pool-create-{provider}.png")

        await page.open(f"{ui.ui}/blocks/block/{pools['team-ssh']}/edit", shows="Nodes")
        print(f"edit form of the saved ssh pool: {(await page.fields())['count']} input fields")
        await page.whole_form(out_dir / "gpu-pool-edit.png")

        await page.open(f"{ui.ui}/deployments/deployment/{deployment}/run", shows="pool")
        await page.click_button("GPUPool")
        await page.pick("team-ssh")
        await page.whole_form(out_dir / "deployment-run-pool-picker.png")


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with UI() as ui:
        asyncio.run(shoot(ui, out_dir))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs")
