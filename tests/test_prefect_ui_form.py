"""The GPU Pool form as a person sees it: Blocks -> GPU Pool -> Create, rendered by a real
`prefect server start` in headless Chromium, its input fields counted over the rendered page (a
DOM query, not the block's schema). Before a provider is chosen it shows at most about 15
(API.md, "The form in Prefect's UI"); a provider's own fields come with its tab.

One server and one browser serve the whole module; `scripts/screenshot_ui.py` takes the pictures
in docs/prefect-ui.md with the same parts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from scripts.screenshot_ui import PROVIDERS, UI, create_form_url

MOST_FIELDS_BEFORE_A_PROVIDER = 15


@pytest.fixture(scope="module")
def ui(prefect_api: Path):
    with UI(database=prefect_api) as started:  # the session's migrated, empty database: no migration
        yield started


# Every image of the page that the browser could not load (a broken logo shows as one).
BROKEN_IMAGES_JS = "[...document.images].filter(i => i.complete && i.naturalWidth === 0).map(i => i.src)"
OTHER_COLLECTIONS_LOGOS = "https://raw.githubusercontent.com/PrefectHQ/"
LOGO_JS = "[...document.images].filter(i => i.naturalWidth > 0).map(i => i.src)"


async def _create_form(ui: UI, choose: tuple[str, ...] = (), shots: Path | None = None) -> list[dict]:
    """The create form's fields as it opens, then after choosing each provider in `choose` (with
    the page's broken and loaded images; a screenshot of each into `shots`)."""
    async with ui.tab() as page:
        await page.open(create_form_url(ui), shows="Nodes")
        seen = []
        for provider in ("", *choose):
            if provider:
                await page.click_button(provider)
            await asyncio.sleep(0.5)  # images still loading are not yet complete
            seen.append({**await page.fields(), "broken": await page.js(BROKEN_IMAGES_JS),
                         "images": await page.js(LOGO_JS)})
            if shots is not None:
                await page.whole_form(shots / f"gpu-pool-create{'-' if provider else ''}{provider}.png")
        return seen


def test_the_create_form_shows_at_most_15_fields_before_a_provider_is_chosen(ui):
    [opened] = asyncio.run(_create_form(ui))
    assert opened["count"] > 3, opened  # the form rendered: Block Name, Nodes, ... were counted
    assert opened["count"] <= MOST_FIELDS_BEFORE_A_PROVIDER, (
        f"Blocks -> GPU Pool -> Create shows {opened['count']} input fields before a provider is chosen "
        f"(at most {MOST_FIELDS_BEFORE_A_PROVIDER}): {opened['labels']}")


def test_choosing_a_provider_shows_its_own_fields_and_no_other_providers(ui):
    opened, *chosen = asyncio.run(_create_form(ui, PROVIDERS))
    own = {"ssh": "Hosts", "aws": "Instance Type", "slurm": "Slurm Partition", "kubernetes": "K8S Image"}
    for provider, seen in zip(PROVIDERS, chosen):
        labels = {label.removesuffix(" (Optional)") for label in seen["labels"]}
        for other, label in own.items():
            assert (label in labels) == (other == provider), f"{provider} chosen, the form shows: {sorted(labels)}"
        assert seen["count"] >= opened["count"] or provider == "local", (provider, seen)
        assert "Provider" not in labels, f"{provider}: the tab repeats the provider as a select: {sorted(labels)}"


def test_the_block_s_logo_loads_and_the_form_is_pictured(ui, tmp_path):
    seen = asyncio.run(_create_form(ui, ("kubernetes",), shots=tmp_path))
    for page in seen:
        # (the credentials pickers show prefect-aws' and prefect-kubernetes' own logos, which their
        # packages name on GitHub: broken without a network, theirs to fix, not the pool's)
        ours = [src for src in page["broken"] if not src.startswith(OTHER_COLLECTIONS_LOGOS)]
        assert ours == [], f"images the browser could not load: {ours}"
    assert any(src.endswith("/ico/android-chrome-192x192.png") for src in seen[0]["images"]), seen[0]["images"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-pool-create-kubernetes.png", "gpu-pool-create.png"]
