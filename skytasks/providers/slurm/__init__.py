"""provider="slurm": the nodes of a SLURM allocation. `provider.py` (allocate, start agents,
replace, cancel), `job.py` (sbatch arguments, the batch script, SLURM's answers read), `shell.py`
(where SLURM's commands run: here or on a login node over SSH), `gc.py` (`skytasks gc --slurm`)."""
