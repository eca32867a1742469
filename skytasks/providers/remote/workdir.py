"""A workdir onto an SSH node, content-addressed: only file contents the node lacks travel.

On the node, `~/.cache/skytasks/files/<sha256>` holds every file content it ever received, and
`~/.cache/skytasks/work-<digest>/` a finished tree (hard links into the store). A node that holds
the tree already gets nothing; one that holds an older tree gets only the changed files. Two round
trips at most: "what do you lack?", then one tar of exactly that, which the node unpacks and links
into a new tree, renamed into place when complete (a half-built tree is never used).
"""

from __future__ import annotations

import asyncio
import io
import json
import shlex
import tarfile
from dataclasses import dataclass
from typing import Any, Callable, Coroutine

from skytasks.workdir import Workdir

STORE = ".cache/skytasks/files"

# Runs on the node with its Python (stdlib only). argv[1]: "missing" or "build"; argv[2]: the tree.
_REMOTE = r'''
import json, os, sys, tarfile, shutil
mode, tree = sys.argv[1], sys.argv[2]
store = os.path.expanduser("~/" + "%(store)s")
os.makedirs(store, exist_ok=True)
if mode == "missing":
    manifest = json.load(sys.stdin)
    lacking = sorted({h for _, h, _ in manifest if not os.path.exists(os.path.join(store, h))})
    print(json.dumps({"built": os.path.isdir(tree), "missing": lacking}))
    sys.exit(0)
tar = tarfile.open(fileobj=sys.stdin.buffer, mode="r|")
manifest = None
for member in tar:
    data = tar.extractfile(member).read()
    if member.name == "manifest.json":
        manifest = json.loads(data); continue
    tmp = os.path.join(store, member.name + ".%%d" %% os.getpid())
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, os.path.join(store, member.name))
if os.path.isdir(tree):
    sys.exit(0)
build = tree + ".%%d" %% os.getpid()
for rel, digest, perm in manifest:
    dest = os.path.join(build, rel)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    shutil.copyfile(os.path.join(store, digest), dest)  # a copy: a rank editing its file must not edit the store
    os.chmod(dest, perm)
try:
    os.rename(build, tree)
except OSError:  # another node on the same home finished first
    shutil.rmtree(build, ignore_errors=True)
''' % {"store": STORE}


@dataclass(frozen=True)
class SyncResult:
    path: str  # relative to the node's home, where its agent starts
    files_sent: int
    bytes_sent: int


async def sync_workdir(conn: Any, python: str, tree: Workdir) -> SyncResult:
    target = f".cache/skytasks/work-{tree.digest}"
    manifest = [[f.path, f.sha256, f.mode] for f in tree.files]
    command = f"cd && {python} -c {shlex.quote(_REMOTE)}"
    asked = await conn.run(f"{command} missing {target}", input=json.dumps(manifest), check=True)
    answer = json.loads(asked.stdout)
    if answer["built"]:
        return SyncResult(target, 0, 0)
    missing = set(answer["missing"])
    first_with: dict[str, Any] = {}
    for f in tree.files:
        if f.sha256 in missing:
            first_with.setdefault(f.sha256, f)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        _add(tar, "manifest.json", json.dumps(manifest).encode())
        for digest, f in sorted(first_with.items()):
            _add(tar, digest, (tree.root / f.path).read_bytes())
    await conn.run(f"{command} build {target}", input=buf.getvalue(), encoding=None, check=True)
    return SyncResult(target, len(first_with), sum(f.size for f in first_with.values()))


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


class SentWorkdirs:
    """The workdirs a pool's nodes hold, by tree digest: a tree goes once per session, onto every
    node in parallel (`sync_workdir` over each provider's shell: an SSH connection, an srun step,
    a pod exec)."""

    def __init__(self) -> None:
        self._paths: dict[str, str] = {}

    def send(self, request: Any, python: str, nodes: list[tuple[str, Any]],
             run: Callable[[Coroutine[Any, Any, list[SyncResult]]], list[SyncResult]] = asyncio.run) -> tuple[str, str | None]:
        """Its path on the nodes, and what was sent (None: they had it): `nodes` is each node's
        label ("node 0 (host)") and shell; `run` runs the sends (on the provider's loop, if it has one)."""
        from skytasks.workdir import describe_sync, read_workdir

        tree = request.tree or read_workdir(request.root)
        if self._paths.get(tree.digest):  # this session sent it already
            return self._paths[tree.digest], None

        async def every_node() -> list[SyncResult]:
            return list(await asyncio.gather(*(sync_workdir(shell, python, tree) for _, shell in nodes)))

        results = run(every_node())
        self._paths[tree.digest] = results[0].path
        sent = [(label, r.files_sent, r.bytes_sent) for (label, _), r in zip(nodes, results)]
        return results[0].path, describe_sync(request.root, sent)
