"""benchmarks/results.json: each run's figures merged into what the file already holds."""

from __future__ import annotations

import json
from pathlib import Path


def update_results(out: Path, **figures: object) -> None:
    """These figures into results.json, the others kept as they were (`--only`, `--write`)."""
    merged = json.loads(out.read_text()) if out.exists() else {}
    out.write_text(json.dumps({**merged, **figures}, indent=2))
    print(f"\nupdated {out}")
