"""provider="ssh": machines you already have, reached with asyncssh, host keys always checked.

`spec.py` (its field and spec), `provider.py` (the provider), `check.py` (`skytasks check`), and the
SSH transport that aws (and a SLURM login node) share: `login.py` (reaching hosts), `nodes.py`
(agents on SSH channels, started by the remote toolkit's one starter, providers/remote/),
`channel.py` and `node_setup.py`."""

from skytasks.providers import ProviderPlugin

PLUGIN = ProviderPlugin("ssh", "skytasks.providers.ssh.provider:SSHProvider",
                        settings="skytasks.providers.ssh.spec:SSHSettings",
                        check="skytasks.providers.ssh.check:run")
