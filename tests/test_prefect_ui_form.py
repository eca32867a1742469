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


async def _create_form(ui: UI, choose: tuple[str, ...] = ()) -> list[dict]:
    """The create form's fields as it opens, then after choosing each provider in `choose`."""
    async with ui.tab() as page:
        await page.open(create_form_url(ui), shows="Nodes")
        seen = [await page.fields()]
        for provider in choose:
            await page.click_button(provider)
            seen.append(await page.fields())
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
