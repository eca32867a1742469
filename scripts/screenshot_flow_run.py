"""Start a Prefect server on loopback, run the example flow against it, and screenshot the flow
run page and the rank task run page with headless Chromium (Debian's `chromium` package).

    .venv/bin/python scripts/screenshot_flow_run.py OUT_DIR
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--window-size=1600,1100", "--virtual-time-budget=15000"]


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_API_URL": api}
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        subprocess.run([sys.executable, str(ROOT / "flows/ddp_train.py")], env={**env, "SKYTASKS_EXAMPLE_EPOCHS": "4",
                       "SKYTASKS_EXAMPLE_SAMPLES": "512"}, check=True, cwd=ROOT)
        run = httpx.post(f"{api}/flow_runs/filter", json={"limit": 1, "sort": "START_TIME_DESC"}).json()[0]
        tasks = httpx.post(f"{api}/task_runs/filter", json={"flow_runs": {"id": {"any_": [run["id"]]}}}).json()
        rank0 = next(t for t in tasks if t["name"].endswith("[rank 0/2]"))
        pages = {
            "flow-run.png": f"http://127.0.0.1:{port}/runs/flow-run/{run['id']}",
            "rank0-task-run.png": f"http://127.0.0.1:{port}/runs/task-run/{rank0['id']}",
            "artifacts.png": f"http://127.0.0.1:{port}/runs/flow-run/{run['id']}?tab=Artifacts",
        }
        for name, url in pages.items():
            subprocess.run(["chromium", *CHROMIUM_FLAGS, f"--user-data-dir={tempfile.mkdtemp()}",
                            f"--screenshot={out_dir / name}", url], check=True, timeout=120,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            print(out_dir / name)
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "screenshots"))
