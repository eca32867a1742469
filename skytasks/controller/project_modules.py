"""Which imported modules are the user's own project (pickled by value with a call) and which are
libraries (imported by name on the ranks), told by where each module's file lies.

A file under an installed location (any site-packages or dist-packages, the standard library) is a
library's; a file under the current directory is the project's. Between them, a file whose
import root (the sys.path entry it was found under) is a plain folder is the project's too: a
script's own folder, PYTHONPATH. Only a root that an installation put there, one holding
distribution metadata (`pip install --target`), one a site folder's .pth file adds (an editable
install), or a module no plain path entry holds (an editable install's finder), asks which
distributions are installed: `importlib.metadata.packages_distributions()` reads every installed
distribution's file list (0.4 s in this environment), so a fresh process no longer pays it on its
first call unless the user's code imports a library installed in one of those ways.
"""

from __future__ import annotations

import functools
import os
import site
import sys
import sysconfig
from types import ModuleType

_INSTALLED_ROOTS = tuple(
    os.path.realpath(p) + os.sep
    for p in {*site.getsitepackages(), site.getusersitepackages(), sysconfig.get_paths()["stdlib"],
              sysconfig.get_paths()["platstdlib"]}
)
# Installed on every node (the controller's own version is what runs there).
_SHIPPED_PACKAGES = {"skytasks"}
_METADATA = (".dist-info", ".egg-info", ".egg-link")

_IS_PROJECT: dict[str, bool] = {}  # module name -> from the user's project (files never move)


def project_modules() -> list[ModuleType]:
    """Modules of the user's own project: imported from files outside any installed location.

    They are pickled by value, so a function that imports a helper from a sibling file works on a
    node that does not have the project, and a rank does not re-import the caller's module (and
    with it prefect, pytest, ...) just to find one function.
    """
    found = []
    for name, module in sys.modules.copy().items():  # copy(): other threads may be importing
        if name not in _IS_PROJECT:
            file = getattr(module, "__file__", None)
            # (a relative "file" is no file: torch.ops and torch.classes are objects named "_ops.py")
            real = _real_path(file) if isinstance(file, str) and os.path.isabs(file) else ""
            _IS_PROJECT[name] = bool(
                real and name != "__main__" and name.partition(".")[0] not in _SHIPPED_PACKAGES
                and not _is_installed_file(real) and not _is_other_library(name, real)
            )
        if _IS_PROJECT[name]:
            found.append(module)
    return found


def _real_path(file: str) -> str:
    """os.path.realpath, its folders resolved once per folder (a fresh process has 2,000 modules
    in a few hundred folders: a tenth of a second of its first call, resolved one by one)."""
    if os.path.islink(file):
        return os.path.realpath(file)
    folder, name = os.path.split(file)
    return os.path.join(_real_folder(folder), name)


@functools.lru_cache(maxsize=4096)
def _real_folder(folder: str) -> str:
    return os.path.realpath(folder)


def _is_installed_file(path: str) -> bool:
    # Any environment's site-packages counts, not only this interpreter's own: a venv can see
    # another's through a .pth line or PYTHONPATH.
    parts = path.split(os.sep)
    return path.startswith(_INSTALLED_ROOTS) or "site-packages" in parts or "dist-packages" in parts


def _is_other_library(name: str, path: str) -> bool:
    """An editable install of someone else's library (pip install -e ~/src/lib) is a library:
    pickling it by value would copy the whole library into every call. A distribution that
    lives under the current directory is the user's own project, and travels by value."""
    if path.startswith(os.path.realpath(os.getcwd()) + os.sep):
        return False
    root = _import_root(name, path)
    if root in _plain_path_entries() and not _holds_metadata(root):
        return False  # a folder of the user's on sys.path (the script's, PYTHONPATH's)
    return name.partition(".")[0] in _distribution_names()


def _import_root(name: str, path: str) -> str:
    """The folder the module's top-level package was found in: /x for a.b.c at /x/a/b/c.py or
    a.b at /x/a/b/__init__.py."""
    up = name.count(".") + int(os.path.basename(path).startswith("__init__."))
    root = os.path.dirname(path)
    for _ in range(up):
        root = os.path.dirname(root)
    return root


def _plain_path_entries() -> set[str]:
    """sys.path's folders, as real paths, less those a site folder's .pth file adds (an editable
    install's source folder): read each time, as a program may change sys.path."""
    return {os.path.realpath(p or os.getcwd()) for p in sys.path if isinstance(p, str)} - _pth_entries()


@functools.cache
def _pth_entries() -> frozenset[str]:
    found: set[str] = set()
    for folder in {*site.getsitepackages(), site.getusersitepackages()}:
        try:
            names = [n for n in os.listdir(folder) if n.endswith(".pth")]
        except OSError:
            continue
        for pth in names:
            try:
                with open(os.path.join(folder, pth), encoding="utf-8", errors="replace") as f:
                    lines = f.read().splitlines()
            except OSError:
                continue
            found.update(os.path.realpath(os.path.join(folder, line.strip())) for line in lines
                         if line.strip() and not line.startswith(("#", "import ", "import\t")))
    return frozenset(found)


@functools.cache
def _holds_metadata(root: str) -> bool:
    try:
        return any(n.endswith(_METADATA) for n in os.listdir(root))
    except OSError:
        return False


@functools.cache
def _distribution_names() -> frozenset[str]:
    """Every installed distribution's top-level names: the rare fallback (see the module's doc)."""
    from importlib.metadata import packages_distributions

    return frozenset(packages_distributions())
