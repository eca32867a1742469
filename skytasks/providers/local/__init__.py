"""provider="local": node agents as processes of this machine (`provider.py`). It reads
no field beyond the pool's shape."""

from skytasks.providers import ProviderPlugin

PLUGIN = ProviderPlugin("local", "skytasks.providers.local.provider:LocalProvider")
