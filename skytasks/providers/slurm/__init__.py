"""provider="slurm": the nodes of a SLURM allocation. `spec.py` (its fields and spec), `provider.py`
(allocate, start agents, replace, cancel), `job.py` (sbatch arguments, the batch script, SLURM's
answers read), `shell.py` (where SLURM's commands run: here or on a login node over SSH), `gc.py`
(`skytasks gc --slurm`), `check.py` (`skytasks check`)."""

from skytasks.providers import ProviderPlugin

PLUGIN = ProviderPlugin("slurm", "skytasks.providers.slurm.provider:SlurmProvider",
                        settings="skytasks.providers.slurm.spec:SlurmSettings",
                        check="skytasks.providers.slurm.check:run", gc="skytasks.providers.slurm.gc:command")
