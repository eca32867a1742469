"""provider="local": node agents as processes of this machine (`provider.py`). It reads one
field beyond the pool's shape (`spec.py`): ready_timeout_seconds, how long a process waits in line
for a warm pool another process holds."""

from skytasks.providers import ProviderPlugin

PLUGIN = ProviderPlugin("local", "skytasks.providers.local.provider:LocalProvider",
                        settings="skytasks.providers.local.spec:LocalSettings")
