"""`skytasks check --pool NAME`: a pool's pre-flight checks, run without starting anything.

Each provider that can tell cheaply whether a pool would start (credentials and permissions, that
what the pool names exists, capacity) names a function in its plugin (`ProviderPlugin.check`):
given the pool's spec, it yields one `Check` per question, each with its verdict and the words
that explain it. A check that could not be asked passes as `None` (skipped), never as a failure.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Optional

if TYPE_CHECKING:
    from skytasks.pool_spec import PoolSpec


@dataclass(frozen=True)
class Check:
    name: str  # what was asked, e.g. "may create pods in namespace ml"
    passed: Optional[bool]  # None: could not be asked here (skipped)
    detail: str = ""

    def line(self) -> str:
        verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[self.passed]
        return f"{verdict}  {self.name}" + (f": {self.detail}" if self.detail else "")


def checks_for(spec: PoolSpec) -> Iterable[Check]:
    from skytasks.providers.registry import plugin

    found = plugin(spec.provider).check
    if not found:
        yield Check(f"provider {spec.provider!r} has no pre-flight checks", None, "nothing to ask before a start")
        return
    module, _, name = found.partition(":")
    run: Callable[[PoolSpec], Iterable[Check]] = getattr(importlib.import_module(module), name)
    yield from run(spec)
