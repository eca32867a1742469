"""The composition root (skytasks/wiring.py): importing a module wires nothing; building a pool's
runtime hands the controller the node health check, Prefect's warm store (a maker, called at the
first warm use), and adds
Prefect's pool-event sink to the bus once. Each check runs in a fresh interpreter: this one has
built runtimes by now."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import json, sys
    import skytasks.blocks.gpu_pool, skytasks.prefect_records, skytasks.prefect_records.warm_store
    import skytasks.pools_command, skytasks.task
    from skytasks import event_bus
    after_imports = [s.__qualname__ for s in event_bus._SINKS]

    from skytasks import GPUPool
    from skytasks.controller.pool_runtime import PoolRuntime
    from skytasks.errors import PoolConfigError
    runtime = GPUPool(provider="local", nodes=2).runtime()
    GPUPool(provider="local", nodes=1).runtime()  # a second runtime adds no second sink
    sinks = [s.__module__ + "." + s.__qualname__ for s in event_bus._SINKS]
    store = runtime._make_warm_store()
    bare = PoolRuntime(runtime.spec, None)
    try:
        bare.warm_pool()
        unwired = "no error"
    except PoolConfigError as exc:
        unwired = str(exc)
    print("WIRED " + json.dumps({"after_imports": after_imports, "sinks": sinks,
                                 "store": type(store).__module__ + "." + type(store).__name__,
                                 "before_use": runtime.warm_store, "unwired": unwired,
                                 "health_check": runtime.health_check.__module__ + "." + runtime.health_check.__name__,
                                 "bare_health_check": bare.health_check,
                                 "preflight_loaded": "skytasks.preflight.check" in sys.modules}))
""")


def test_imports_wire_nothing_and_a_runtime_is_handed_prefects_store_and_sink_once():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("WIRED ")]
    seen = json.loads(line.removeprefix("WIRED "))
    assert seen["after_imports"] == []
    assert seen["sinks"] == ["skytasks.prefect_records.pool_events.record_pool_event"]
    assert seen["store"] == "skytasks.prefect_records.warm_store.PrefectWarmStore"
    assert seen["before_use"] is None  # made at the first warm use, not when the runtime is built
    assert seen["unwired"].startswith("keep_warm_minutes:")
    # the preflight is handed in too (it runs calls through the controller, which never imports it),
    # and loaded at a pool's first call, not when its runtime is built
    assert seen["health_check"] == "skytasks.wiring.preflight" and seen["bare_health_check"] is None
    assert seen["preflight_loaded"] is False
