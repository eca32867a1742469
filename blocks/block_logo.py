"""The GPU Pool block type's logo, as a URL the Prefect UI that shows it serves itself.

A logo elsewhere (a CDN) is a broken image wherever the UI's browser cannot reach it (an
air-gapped cluster, CI), and a `data:` URL, which would need no network, is refused by Prefect's
client (`BlockType.logo_url` is a pydantic HttpUrl: http or https only). So the logo is the icon
the Prefect UI serves at `/ico/`, on the server the block type is registered with: the UI of
`PREFECT_UI_URL` (Prefect derives it from PREFECT_API_URL), or, in the server's own process as it
registers the installed collections, the host and port it serves on. Registering again from a
client pointed at another server moves the logo there (Prefect updates a block type whose logo
changed)."""

from __future__ import annotations

LOGO_PATH = "/ico/android-chrome-192x192.png"  # in Prefect's UI bundle (prefect/server/ui/ico/) since 2.x


def served_logo_url() -> str:
    """The logo's URL on the Prefect UI this process talks to (or, in a server, serves)."""
    from prefect.settings import get_current_settings

    current = get_current_settings()
    base = current.ui_url
    if not base:
        host, port = current.server.api.host, current.server.api.port
        base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{port}"
    return base.rstrip("/") + LOGO_PATH
