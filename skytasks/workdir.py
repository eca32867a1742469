"""`workdir=`: a directory every node gets and every rank starts in.

A workdir is read once per call into a `Workdir`: every file's relative path, mode and content
hash, with `.git/` and whatever its `.gitignore` files name left behind. Its digest names the whole
tree, so a node that already holds the same tree gets nothing, and a node that holds an older one
gets only the files whose content it lacks (see `providers/remote/workdir.py`). Local nodes use the
directory in place.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from skytasks.errors import PoolConfigError

LIMIT_ENV = "SKYTASKS_WORKDIR_LIMIT_MB"


@dataclass(frozen=True)
class WorkdirFile:
    path: str  # relative, "/"-separated
    sha256: str
    size: int
    mode: int  # permission bits (an executable script stays executable)


@dataclass(frozen=True)
class Workdir:
    root: Path
    files: tuple[WorkdirFile, ...]

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for f in self.files:
            h.update(f"{f.path}\0{f.sha256}\0{f.mode:o}\n".encode())
        return h.hexdigest()[:20]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def limit_bytes() -> int:
    from skytasks.settings import settings

    return int(settings().workdir_limit_mb * 1000 * 1000)


def check_workdir(workdir: str | os.PathLike | None, argument: str = "workdir") -> Path | None:
    """The resolved directory, or a PoolConfigError naming the argument (nothing launched yet)."""
    if workdir is None:
        return None
    path = Path(workdir).expanduser()
    if not path.exists():
        raise PoolConfigError(f"{argument}: {str(workdir)!r} does not exist")
    if not path.is_dir():
        raise PoolConfigError(f"{argument}: {str(workdir)!r} is not a directory")
    return path.resolve()


def read_workdir(root: Path, argument: str = "workdir", limit: int | None = None) -> Workdir:
    """Every file that travels, hashed; refuses a tree over the limit, naming its largest entries."""
    limit = limit_bytes() if limit is None else limit
    paths = _files_that_travel(root)
    sizes = {p: (root / p).stat().st_size for p in paths}
    total = sum(sizes.values())
    if total > limit:
        raise PoolConfigError(
            f"{argument}: {root} holds {total / 1e6:.1f} MB to send, over the {limit / 1e6:g} MB limit "
            f"({LIMIT_ENV} raises it). Largest entries: {_largest_entries(sizes)}. Add them to .gitignore "
            f"or move them out of the workdir (data belongs in storage the nodes read, not in the workdir)"
        )
    files = []
    for p in sorted(paths):
        full = root / p
        h = hashlib.sha256()
        with open(full, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        files.append(WorkdirFile(p, h.hexdigest(), sizes[p], full.stat().st_mode & 0o777))
    return Workdir(root, tuple(files))


def _largest_entries(sizes: dict[str, int], count: int = 5) -> str:
    """Top-level entries by what they hold, so a 2 GB `data/` shows as one line."""
    by_entry: dict[str, int] = {}
    for p, n in sizes.items():
        top = p.split("/", 1)[0] + ("/" if "/" in p else "")
        by_entry[top] = by_entry.get(top, 0) + n
    ranked = sorted(by_entry.items(), key=lambda kv: -kv[1])[:count]
    return ", ".join(f"{name} ({n / 1e6:.1f} MB)" for name, n in ranked)


def _files_that_travel(root: Path) -> list[str]:
    """Relative paths of regular files, without `.git/` and `.gitignore`d ones (every
    `.gitignore` in the tree applies below its own directory, as in git)."""
    import pathspec

    found: list[str] = []
    specs: list[tuple[str, pathspec.PathSpec]] = []  # (directory prefix, its .gitignore)
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        if ".gitignore" in filenames:
            with open(os.path.join(dirpath, ".gitignore")) as f:
                specs.append((rel_dir, pathspec.GitIgnoreSpec.from_lines(f)))

        def ignored(rel: str, is_dir: bool) -> bool:
            for prefix, spec in specs:
                if rel.startswith(prefix) and spec.match_file(rel[len(prefix):] + ("/" if is_dir else "")):
                    return True
            return False

        dirnames[:] = sorted(d for d in dirnames if d != ".git" and not ignored(rel_dir + d, True)
                             and not os.path.islink(os.path.join(dirpath, d)))
        for name in sorted(filenames):
            rel = rel_dir + name
            full = os.path.join(dirpath, name)
            if os.path.isfile(full) and not ignored(rel, False):
                found.append(rel)
    return found


@dataclass(frozen=True)
class WorkdirRequest:
    """A call's workdir: used in place by local nodes; `tree` is read (and size-checked) before
    launch for nodes it must travel to. Part of the rank group's spec: new content, new group."""

    root: Path
    tree: Workdir | None = None


def describe_sync(root: Path, sent: list[tuple[str, int, int]]) -> str:
    """One line for the call's logs: what each node received."""
    parts = [f"{node} got {files} file(s), {size / 1e3:.1f} kB" if files else f"{node} had it already"
             for node, files, size in sent]
    return f"workdir {root}: " + "; ".join(parts)
