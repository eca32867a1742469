"""The call engine, in the process that calls a distributed task.

`pool_runtime` (a pool in use: `with pool:`, SIGTERM, the active pool) holds a `session` (the
nodes that are up: their `channel`s and one `rank_group`). Each attempt of a call is a `call_run`
state machine that ends with an `outcome`; the `runner` owns the attempts and asks the
`FailurePolicy` (in `outcome`) whether to try again, and tells an observer everything that
happens: `console` here, or the Prefect records (`skytasks.prefect_records`). `packing` makes the
payload, `failures` the caller's error.
"""
