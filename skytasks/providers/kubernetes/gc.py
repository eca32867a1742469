"""`skytasks gc --kubernetes`: delete what kubernetes pools left in a namespace.

Every pool makes one owner ConfigMap (`skytasks-<id>`, labelled `app.kubernetes.io/managed-by:
skytasks`, annotated with its expiry) that owns its pods. A pool deletes both on every path its
controller lives through; without the controller its pods end themselves after `idle_minutes` and
at `max_lifetime_minutes`, but the ended pods and the owner stay listed. This sweep deletes a
pool's owner (and so, through the garbage collector, its pods) when it is past its expiry, when
every pod of it has ended, or when it has had no pod for `grace_minutes`.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Mapping, Optional, Sequence

from skytasks.providers.kubernetes import pods
from skytasks.providers.kubernetes.teardown import delete_pool, list_pods


def _time(text: Optional[str]) -> Optional[datetime]:
    if not text:
        return None
    try:
        return datetime.strptime(text, pods.TIME_FORMAT).replace(tzinfo=timezone.utc)
    except ValueError:
        return None


def why_stale(owner: Mapping[str, Any], pool_pods: Sequence[Mapping[str, Any]], now: datetime,
              grace: timedelta) -> Optional[str]:
    """Why a pool's leftovers may go (None: its controller may still be using them)."""
    meta = owner.get("metadata", {})
    expires = _time((meta.get("annotations") or {}).get(pods.EXPIRES_ANNOTATION))
    if expires is not None and expires <= now:
        return f"expired {expires:%Y-%m-%d %H:%M}Z"
    phases = [p.get("status", {}).get("phase") for p in pool_pods]
    if phases and all(ph in ("Succeeded", "Failed") for ph in phases):
        return "every pod has ended (its controller is gone)"
    created = _time(meta.get("creationTimestamp"))
    if not phases and created is not None and created + grace <= now:
        return f"no pod since {created:%Y-%m-%d %H:%M}Z"
    return None


def sweep(core: Any, namespace: str, dry_run: bool = False, now: Optional[datetime] = None,
          grace_minutes: float = 15, wait_seconds: float = 60,
          log: Callable[[str], None] = lambda line: None) -> list[str]:
    """Delete (or with `dry_run`, only name) the stale pools of a namespace; their ids."""
    now = now or datetime.now(timezone.utc)
    selector = f"{pods.MANAGED_BY[0]}={pods.MANAGED_BY[1]}"
    owners = json.loads(core.list_namespaced_config_map(namespace, label_selector=selector, _preload_content=False,
                                                        _request_timeout=30).data)["items"]
    listed = list_pods(core, namespace, selector)
    swept = []
    for owner in owners:
        pool_id = owner["metadata"]["name"]
        mine = [p for p in listed if (p["metadata"].get("labels") or {}).get(pods.POOL_LABEL) == pool_id]
        why = why_stale(owner, mine, now, timedelta(minutes=grace_minutes))
        if why is None:
            continue
        swept.append(pool_id)
        log(f"skytasks gc: {'would delete' if dry_run else 'deleting'} kubernetes pool {namespace}/{pool_id} "
            f"({len(mine)} pod{'s' * (len(mine) != 1)}): {why}")
        if not dry_run:
            left, detail = delete_pool(core, namespace, pool_id, wait_seconds)
            if left:
                log(f"skytasks gc: still there: {', '.join(left)} ({detail})")
    return swept


def command(args: Any) -> int:
    """`skytasks gc --kubernetes`: with a saved pool's credentials and namespace (`--pool`), else the
    in-cluster config or the default kubeconfig. `args`: the command line's (cli.py)."""
    import sys
    from typing import cast

    from kubernetes import client

    from skytasks.providers.kubernetes import cluster

    credentials, namespace = None, args.namespace
    if args.pool:
        from skytasks.blocks.gpu_pool import GPUPool

        pool = cast(GPUPool, GPUPool.load(args.pool))
        credentials, namespace = pool.kubernetes_credentials, namespace or pool.k8s_namespace
    core = client.CoreV1Api(cluster.api_client(cluster.configuration(credentials)))
    swept = sweep(core, namespace or "default", dry_run=args.dry_run, now=args.now, grace_minutes=args.grace_minutes,
                  log=lambda line: print(line, file=sys.stderr))
    print(f"skytasks gc: {len(swept)} kubernetes pool(s) {'to delete' if args.dry_run else 'deleted'}")
    return 0
