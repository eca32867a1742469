"""The controller side: the process that calls a distributed task.

`session` holds a pool that is up (its node channels and rank group), `rank_group` is the state
machine of one call on one set of ranks, `runner` owns attempts and retries and tells observers
(`console`, `prefect_observer`) what happens, and `prefect_task` makes a call a Prefect task run.
"""
