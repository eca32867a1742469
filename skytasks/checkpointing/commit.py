"""Where sharded checkpoints live, and which of them count: committed ones only.

A sharded checkpoint of step 42 is a folder `step-000000000042/` beside the plain path's
`step-000000000042.pt` files: DCP's files (each rank's `__R_0.distcp`, the head's `.metadata`)
and, written last by the head once every rank said its part is written, `COMMITTED` (JSON: step,
world size, bytes). A folder without it (a rank died, a node was lost, a process was killed
mid-write) is never restored, never counted by `keep`, and the next save removes it.

`DirectoryLayout` is a folder that every node sees (shared storage; on one machine, any folder);
`S3Layout` a prefix, each rank uploading its own files from a local staging folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import Any

from skytasks.checkpoint_stores import S3Store, _create_private, _make_private_dirs

MARKER = "COMMITTED"
_FOLDER = re.compile(r"^step-(\d{12})$")


def folder_name(step: int) -> str:
    return f"step-{step:012d}"


def steps_of(folders: list[str]) -> list[int]:
    return sorted(int(m.group(1)) for f in folders if (m := _FOLDER.match(f)))


class DirectoryLayout:
    def __init__(self, root: str):
        self.root = root
        self.where = root

    def describe(self, step: int) -> str:
        return os.path.join(self.root, folder_name(step))

    def _folders(self) -> list[str]:
        try:
            return [f for f in os.listdir(self.root) if os.path.isdir(os.path.join(self.root, f))]
        except FileNotFoundError:
            return []

    def committed_steps(self) -> list[int]:
        return [s for s in steps_of(self._folders())
                if os.path.isfile(os.path.join(self.root, folder_name(s), MARKER))]

    def uncommitted_steps(self) -> list[int]:
        done = set(self.committed_steps())
        return [s for s in steps_of(self._folders()) if s not in done]

    def remove(self, step: int) -> None:
        shutil.rmtree(os.path.join(self.root, folder_name(step)), ignore_errors=True)

    def prepare(self, step: int) -> None:
        """The head, before any rank writes: the step's folder, empty, 0700."""
        self.remove(step)
        _make_private_dirs(os.path.join(self.root, folder_name(step)))

    def writing_folder(self, step: int) -> str:
        """Where this rank's DCP writer writes: the step's folder itself."""
        return os.path.join(self.root, folder_name(step))

    def publish(self, local: str, step: int, rank: int) -> int:
        """This rank's files are in place already, made 0600 (DCP's writer makes them by the
        umask; the 0700 folder kept them private meanwhile); their bytes (the head's count the
        metadata)."""
        own = [os.path.join(local, f) for f in _own_files(os.listdir(local), rank)]
        for path in own:
            os.chmod(path, 0o600)
        return sum(os.path.getsize(path) for path in own)

    def discard_writing_folder(self, local: str) -> None:
        pass

    def write_marker(self, step: int, info: dict[str, Any]) -> None:
        folder = os.path.join(self.root, folder_name(step))
        tmp = os.path.join(folder, f".{MARKER}.partial")
        with os.fdopen(_create_private(tmp), "w") as f:
            json.dump(info, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(folder, MARKER))  # the marker appears whole, or not at all

    def reading_folder(self, step: int) -> str:
        return os.path.join(self.root, folder_name(step))

    def done_reading(self, local: str) -> None:
        pass


class S3Layout:
    def __init__(self, store: S3Store):
        self.store = store
        self.where = f"s3://{store.bucket}/{store.prefix}".rstrip("/")

    def describe(self, step: int) -> str:
        return f"{self.where}/{folder_name(step)}"

    def committed_steps(self) -> list[int]:
        steps = steps_of(self.store.folders())
        return [s for s in steps if f"{folder_name(s)}/{MARKER}" in self.store.names_under(folder_name(s))]

    def uncommitted_steps(self) -> list[int]:
        done = set(self.committed_steps())
        return [s for s in steps_of(self.store.folders()) if s not in done]

    def remove(self, step: int) -> None:
        self.store.delete_folder(folder_name(step))

    def prepare(self, step: int) -> None:
        self.remove(step)

    def writing_folder(self, step: int) -> str:
        return tempfile.mkdtemp(prefix=f"skytasks-ckpt-{step}-")  # 0700: this rank's staging

    def publish(self, local: str, step: int, rank: int) -> int:
        """Upload this rank's own files (its shards; the head also the metadata), each by
        boto3's managed upload, multipart for large ones. Returns their bytes."""
        total = 0
        for name in _own_files(os.listdir(local), rank):
            path = os.path.join(local, name)
            self.store.upload_file(path, f"{folder_name(step)}/{name}")
            total += os.path.getsize(path)
        return total

    def discard_writing_folder(self, local: str) -> None:
        shutil.rmtree(local, ignore_errors=True)

    def write_marker(self, step: int, info: dict[str, Any]) -> None:
        self.store.put_small(f"{folder_name(step)}/{MARKER}", json.dumps(info).encode())

    def reading_folder(self, step: int) -> str:
        """The step's objects in a local folder of this rank (0700), to read with DCP's reader."""
        local = tempfile.mkdtemp(prefix=f"skytasks-restore-{step}-")
        try:
            for name in self.store.names_under(folder_name(step)):
                base = name.split("/", 1)[1]
                if base == MARKER or "/" in base:
                    continue
                self.store.download_file(name, os.path.join(local, base))
        except BaseException:
            shutil.rmtree(local, ignore_errors=True)
            raise
        return local

    def done_reading(self, local: str) -> None:
        shutil.rmtree(local, ignore_errors=True)


def _own_files(names: list[str], rank: int) -> list[str]:
    """A rank's files in a DCP folder: its shards (`__R_*.distcp`), and on the head the metadata."""
    own = [n for n in names if n.startswith(f"__{rank}_") and n.endswith(".distcp")]
    if rank == 0:
        own += [n for n in names if n == ".metadata"]
    return own
