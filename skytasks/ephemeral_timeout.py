"""Time for Prefect's ephemeral server to start: a first run on a small machine just works.

With no API configured, a flow's first run starts Prefect's temporary server, which first creates
and migrates its database under PREFECT_HOME, and Prefect waits 20 s for it
(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS). On a loaded 2-core machine that takes longer
and the flow fails before it begins ("Timed out while attempting to connect to ephemeral Prefect
API server"). Importing skytasks raises that default to FIRST_START_SECONDS, only when the user
said nothing of it: not in the environment, not in Prefect's settings files (the active
profile, `prefect.toml`, `.env`, `pyproject.toml`), not in the settings Prefect already read.

Prefect reads its settings once, when `prefect.context` is imported: the environment is enough
when skytasks comes first; when Prefect came first (`from prefect import flow` above
`from skytasks import ...`), the value is also raised in the settings Prefect holds (its root
settings context, a Prefect internal that tests/test_first_run.py checks against the installed
Prefect). A longer limit costs nothing when the server is quick: Prefect stops waiting at its
first answer. Standard library only at import: node agents and ranks import skytasks too.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

SETTING_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
PREFECT_DEFAULT_SECONDS = 20
FIRST_START_SECONDS = 180  # a first start's migrations on a loaded 2-core machine, with room to spare
# How the setting is spelled in a profile or `.env` (the variable) and in a TOML table (its path).
_NAMED = re.compile(r"EPHEMERAL_STARTUP_TIMEOUT|startup_timeout_seconds", re.I)


def give_the_ephemeral_server_time() -> None:
    """Raise Prefect's wait for its ephemeral server, unless the user set one anywhere."""
    if SETTING_ENV in os.environ or _named_in_settings_files():
        return
    os.environ[SETTING_ENV] = str(FIRST_START_SECONDS)
    context = sys.modules.get("prefect.context")
    if context is not None:
        _raise_in_prefects_settings(context)


def _named_in_settings_files() -> bool:
    """Whether a file Prefect reads its settings from may set the limit (in doubt: yes)."""
    home = Path(os.environ.get("PREFECT_HOME", "~/.prefect")).expanduser()
    files = [Path(os.environ.get("PREFECT_PROFILES_PATH", home / "profiles.toml")).expanduser(),
             *(Path.cwd() / name for name in ("prefect.toml", ".env", "pyproject.toml"))]
    for path in files:
        try:
            if _NAMED.search(path.read_text(errors="replace")):
                return True
        except FileNotFoundError:
            continue
        except OSError:
            return True
    return False


def _raise_in_prefects_settings(context: object) -> None:
    """The same, in the settings Prefect already holds, when they are still Prefect's default."""
    try:
        ephemeral = context.GLOBAL_SETTINGS_CONTEXT.settings.server.ephemeral  # type: ignore[attr-defined]
        if "startup_timeout_seconds" not in ephemeral.model_fields_set and \
                ephemeral.startup_timeout_seconds == PREFECT_DEFAULT_SECONDS:
            ephemeral.startup_timeout_seconds = FIRST_START_SECONDS
    except AttributeError:  # another Prefect keeps them elsewhere: it still reads the environment anew
        pass
