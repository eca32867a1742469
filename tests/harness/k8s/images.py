"""The two images, written as `docker save` tars: no registry is reached."""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import tarfile
from pathlib import Path

from tests.harness.k8s.layout import BIN, IMAGE, PAUSE_IMAGE


def oci_image_tar(name: str, files: dict[str, bytes | str | None], cmd: list[str], env: list[str]) -> bytes:
    """A one-layer image in `docker save` form, which `ctr images import` reads: `files` maps a
    path in the image to its bytes (mode 0755), a str (a symlink to it) or None (a folder)."""
    layer_buf = io.BytesIO()
    with tarfile.open(fileobj=layer_buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, content in sorted(files.items()):
            info = tarfile.TarInfo(path.lstrip("/"))
            info.mtime = 0
            if content is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o1777 if path == "/tmp" else 0o755
                tar.addfile(info)
            elif isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content
                tar.addfile(info)
            else:
                info.size, info.mode = len(content), 0o755
                tar.addfile(info, io.BytesIO(content))
    layer = layer_buf.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.dumps({
        "architecture": "amd64", "os": "linux", "created": "1970-01-01T00:00:00Z",
        "config": {"Env": env, "Cmd": cmd, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [name], "Layers": ["layer.tar"]}]).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for member, data in (("layer.tar", layer), (config_name, config), ("manifest.json", manifest)):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def python_image_tar() -> bytes:
    """IMAGE: the folders of a root file system, the usual links into /usr (merged /usr), and
    the host's Python as its command, which works once `host_python_template()` mounts it."""
    files: dict[str, bytes | str | None] = {d: None for d in ("/usr", "/etc", "/tmp", "/root", "/home", "/var",
                                                              "/var/tmp", "/run", "/proc", "/sys", "/dev")}
    for d in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        if os.path.islink(f"/{d}"):
            files[f"/{d}"] = os.readlink(f"/{d}")
        elif os.path.isdir(f"/{d}"):
            files[f"/{d}"] = None
    files["/etc/passwd"] = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
    files["/etc/group"] = b"root:x:0:\nnogroup:x:65534:\n"
    path = f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return oci_image_tar(IMAGE, files, [sys.executable], [f"PATH={path}", "LANG=C.UTF-8"])


def pause_image_tar() -> bytes:
    return oci_image_tar(PAUSE_IMAGE, {"/pause": (BIN / "pause").read_bytes()}, ["/pause"], [])
