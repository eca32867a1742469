"""The documentation site builds strictly: no broken link, no missing page, the API reference
generated from the docstrings. A few seconds (MkDocs reads the sources; it imports nothing)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    for page in ("index", "concepts", "providers/local", "providers/ssh", "providers/aws", "providers/slurm",
                 "providers/kubernetes", "prefect-ui", "fault-tolerance", "gpus", "benchmarks", "security",
                 "configuration", "architecture", "contributing", "cli", "API", "reference"):
        assert (site / page / "index.html").is_file() or (page == "index" and (site / "index.html").is_file()), page

    reference = (site / "reference" / "index.html").read_text()
    for anchor in ("skytasks.task.distributed_task", "skytasks.script.run_script", "skytasks.checkpoint.Checkpointer",
                   "skytasks.rank.rank_info", "skytasks.rank.RankInfo", "skytasks.sharding.shard",
                   "skytasks.metrics.report", "skytasks.output.stdout", "skytasks.preemption.on_preemption",
                   "skytasks.preemption.Preempted", "skytasks.errors.HangError", "skytasks.errors.DistributedTaskError",
                   "skytasks.errors.PoolConfigError", "blocks.gpu_pool.GPUPool"):
        assert f'id="{anchor}"' in reference, f"the Python reference has no entry for {anchor}"
    assert (site / "flow-run-graph.png").is_file()  # the UI pages' screenshots travel with the site


def test_the_getting_started_page_shows_the_readme_example():
    """tests/test_readme.py runs the README's first example; the site's first page shows the same."""
    block = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
    readme = block.search((ROOT / "README.md").read_text())
    index = block.search((ROOT / "docs" / "index.md").read_text())
    assert readme and index and readme.group(1) == index.group(1)
