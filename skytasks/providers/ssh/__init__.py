"""provider="ssh": machines you already have, reached with asyncssh, host keys always checked.

`spec.py` (its field and spec), `provider.py` (the provider), `check.py` (`skytasks check`), and the
SSH transport that aws and slurm login nodes share: `nodes.py` (agents on SSH channels), `bridge.py`,
`workdir.py`."""

from skytasks.providers import ProviderPlugin

PLUGIN = ProviderPlugin("ssh", "skytasks.providers.ssh.provider:SSHProvider", spec="skytasks.providers.ssh.spec",
                        check="skytasks.providers.ssh.check:run")
