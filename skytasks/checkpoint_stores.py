"""Where checkpoints live: a directory (atomic renames, 0700 folders, 0600 files) or an S3 prefix.

`skytasks.checkpoint.Checkpointer` picks one from its `path`; each keeps whole objects named by
their step and nothing else.
"""

from __future__ import annotations

import io
import os
from typing import Protocol


class Store(Protocol):
    def put(self, name: str, data: memoryview) -> str: ...
    def get(self, name: str) -> bytes: ...
    def names(self) -> list[str]: ...
    def delete(self, name: str) -> None: ...


class DirectoryStore(Store):
    def __init__(self, root: str):
        self.root = root

    def put(self, name: str, data: memoryview) -> str:
        _make_private_dirs(self.root)
        final = os.path.join(self.root, name)
        tmp = os.path.join(self.root, f".{name}.{os.getpid()}.partial")
        try:
            with os.fdopen(_create_private(tmp), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)  # atomic: the name appears only with the whole content
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        try:  # the rename itself survives a power cut only once the directory is flushed
            fd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass
        return final

    def get(self, name: str) -> bytes:
        with open(os.path.join(self.root, name), "rb") as f:
            return f.read()

    def names(self) -> list[str]:
        try:
            return os.listdir(self.root)
        except FileNotFoundError:
            return []

    def delete(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.root, name))
        except FileNotFoundError:
            pass


def _make_private_dirs(root: str) -> None:
    """`root` and every directory above it that is missing, each made 0700 (those that exist
    keep their mode: they are the user's)."""
    missing = []
    while not os.path.isdir(root):
        missing.append(root)
        parent = os.path.dirname(root)
        if parent == root:
            break
        root = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue  # made meanwhile by another process: its mode is its maker's
        os.chmod(d, 0o700)  # exactly 0700, whatever the umask


def _create_private(path: str) -> int:
    """A new file at `path`, 0600, opened for writing; never through a link planted there (a
    temporary name that a dead process with the same pid left is replaced)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        os.unlink(path)
        fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)  # the rename keeps this mode
    return fd


class S3Store(Store):
    def __init__(self, bucket: str, prefix: str):
        import boto3

        self.bucket, self.prefix = bucket, prefix
        self._s3 = boto3.client("s3")  # the default chain: instance profile, or the rank's environment

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def put(self, name: str, data: memoryview) -> str:
        # One PutObject: S3 never shows a partial object. (boto3's multipart upload would be
        # needed past 5 GB; it too completes atomically.)
        self._s3.upload_fileobj(io.BytesIO(data), self.bucket, self._key(name))
        return f"s3://{self.bucket}/{self._key(name)}"

    def get(self, name: str) -> bytes:
        return self._s3.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read()

    def names(self) -> list[str]:
        start = f"{self.prefix}/" if self.prefix else ""
        names = []
        for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
            names += [o["Key"][len(start):] for o in page.get("Contents", [])]
        return [n for n in names if "/" not in n]

    def delete(self, name: str) -> None:
        self._s3.delete_object(Bucket=self.bucket, Key=self._key(name))

    # -- sharded checkpoints: a folder of objects per step, each rank's own files -------------

    def upload_file(self, local: str, name: str) -> None:
        """One file, as `name` under the prefix; boto3 switches to a multipart upload for large
        ones (8 MB parts, in parallel), which S3 shows whole once it completes."""
        self._s3.upload_file(local, self.bucket, self._key(name))

    def put_small(self, name: str, data: bytes) -> None:
        self._s3.put_object(Bucket=self.bucket, Key=self._key(name), Body=data)

    def download_file(self, name: str, local: str) -> None:
        self._s3.download_file(self.bucket, self._key(name), local)

    def names_under(self, folder: str) -> list[str]:
        """Every object under `folder/`, as names relative to the prefix (`folder/file`)."""
        start = f"{self._key(folder)}/"
        cut = len(f"{self.prefix}/") if self.prefix else 0
        names = []
        for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
            names += [o["Key"][cut:] for o in page.get("Contents", [])]
        return names

    def folders(self) -> list[str]:
        """The folders directly under the prefix (a sharded checkpoint's step folders)."""
        start = f"{self.prefix}/" if self.prefix else ""
        found: list[str] = []
        for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start,
                                                                         Delimiter="/"):
            found += [p["Prefix"][len(start):].rstrip("/") for p in page.get("CommonPrefixes", [])]
        return found

    def delete_folder(self, folder: str) -> None:
        names = self.names_under(folder)
        for i in range(0, len(names), 1000):  # DeleteObjects takes at most 1,000 keys
            self._s3.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": self._key(n)} for n in names[i:i + 1000]], "Quiet": True})
