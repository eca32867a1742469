"""A distributed call as Prefect records it: `parent_task` (the call as a Prefect task run:
plain calls, `.submit`, `await`), `observer` (what the engine tells Prefect), `rank_runs` (one task
run per rank, recorded as state events like Prefect's own engine), `artifacts` (tables and
progress, written beside the call) and `events` (what an Automation can act on)."""
