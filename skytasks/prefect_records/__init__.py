"""A distributed call as Prefect records it: `parent_task` (the call as a Prefect task run:
plain calls, `.submit`, `await`), `observer` (what the engine tells Prefect), `rank_runs` (one task
run per rank, recorded as state events like Prefect's own engine), `artifacts` (tables and
progress, written beside the call), `events` and `pool_events` (typed events as Prefect events an
Automation can act on), `record_queue` (a call that starts before its record exists), and
`warm_store` (warm pools' records as Prefect secrets).

The only side of skytasks that imports Prefect; what it takes from inside Prefect (what Prefect
does not promise to keep) only through `prefect_internals`, which tests/test_prefect_internals.py
checks against the installed Prefect. Importing it wires nothing: the composition root
(`skytasks.wiring`) hands the pool-event sink and the warm store to the controller; nothing here
imports Prefect at import time.
"""
