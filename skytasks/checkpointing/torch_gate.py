"""Whether this node's PyTorch can load a checkpoint without running code.

`torch.load(..., weights_only=True)` could be made to run code before PyTorch 2.6
(CVE-2025-32434), and DCP's shard reads rest on the same unpickler. With `trusted=False` a node
whose torch is older refuses to load at all, naming its version: the rule "a checkpoint runs no
code" would otherwise hold only where the nodes happen to be new enough.
"""

from __future__ import annotations

import re

from skytasks.errors import CheckpointError

SAFE_FROM = (2, 6)  # the first PyTorch whose weights-only unpickler is not CVE-2025-32434's


def refusal_for_torch(version: str) -> str | None:
    """Why a torch of `version` (torch.__version__: "2.5.1+cu124", "2.6.0a0+git...") must not
    load an untrusted checkpoint; None when it may. A version that cannot be read is refused."""
    found = re.match(r"^\s*(\d+)\.(\d+)", version)
    if found is None:
        return (f"this node's PyTorch version {version!r} cannot be read, so whether it is older than 2.6 "
                f"(CVE-2025-32434: weights-only loading could run code) is unknown")
    if (int(found.group(1)), int(found.group(2))) >= SAFE_FROM:
        return None
    return (f"this node's PyTorch is {version}: before 2.6, weights-only loading could be made to run code "
            f"(CVE-2025-32434)")


def check_torch_can_load_safely(trusted: bool, where: str = "") -> None:
    """Raise CheckpointError when `trusted` is False and this torch is older than 2.6."""
    if trusted:
        return
    import torch

    why = refusal_for_torch(torch.__version__)
    if why is not None:
        raise CheckpointError(f"refusing to load checkpoint {where or '(any)'}: {why}. Install torch>=2.6 on the "
                              f"nodes, or use Checkpointer(..., trusted=True) for checkpoints only you can write.",
                              "", where)
