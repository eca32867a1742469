"""One pool's view of its pods and their events, kept by watching the API server, not by polling it.

A `PoolWatch` lists the pool's pods (by its label) and the namespace's Pod events once, then
follows each with a WATCH from its list's resourceVersion: a pool of 256 pods costs the API server
what a pool of 2 does (two open watches, each renewed every few minutes), whatever happens to the
pods. The server ends each watch after WATCH_SECONDS (with a bookmark just before, on 1.17 and
later), and the watch goes on from the last resourceVersion it saw; a resourceVersion the server
no longer holds (410 Gone, as after an API server restart) costs one new LIST; a broken connection,
a 429 or a 5xx is retried with backoff (`api_retry`) and never reaches the caller. A 401 or 403 is
the caller's: `start()` raises it as `cluster.refused` words it, naming the verb and resource.

    watch = PoolWatch(cfg, namespace, pool_id)
    watch.start()                              # after the first lists and watches; raises a refusal
    seen = watch.version
    while ...:
        pods, gone = watch.pods(), watch.deleted()
        ...                                    # decide; a pod in neither is not seen yet
        seen = watch.wait_for_change(seen, 1.0)
    watch.stop()                               # idempotent; ends both threads

Pods and events are plain dicts as the API returns them (camelCase, `pod_status.view` reads
them), shared, not copied: read them, never change them.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from typing import Any, Callable, Optional

from skytasks.providers.kubernetes import api_retry, cluster, pods
from skytasks.providers.kubernetes.pod_events import event_time

WATCH_SECONDS = 240  # the server ends a watch after this (and a random part of a minute more)
READ_SLACK_SECONDS = 60  # past the server's end with no byte: the connection is dead
CONNECT_SECONDS = 10
LIST_SECONDS = 60
PAGE = 500  # objects per LIST page (a namespace's events can be thousands)
QUIET_SECONDS = 5.0  # a watch that ended sooner, having brought nothing, is retried with backoff
KINDS = ("pods", "events")


class _Gone(Exception):
    """The server no longer holds the resourceVersion the watch asked from (410): list again."""


class PoolWatch:
    """The pods of pool `pool_id` in `namespace` and the events about them, as the API server last
    said. `on_change()`, when given, is called from the watch's threads after each change."""

    def __init__(self, cfg: Any, namespace: str, pool_id: str, on_change: Optional[Callable[[], None]] = None,
                 watch_seconds: int = WATCH_SECONDS):
        self.cfg, self.namespace, self.pool_id = cfg, namespace, pool_id
        self.on_change = on_change
        self.watch_seconds = watch_seconds
        self.requests: Counter[str] = Counter()  # "LIST pods", "WATCH events", ...: each HTTP request made
        self.version = 0  # goes up at each change (and at `wake()`)
        self.last_error = ""  # the latest failure, in the API's words, for diagnostics
        self._refusals: dict[str, Exception] = {}  # kind -> the 401/403 its requests get now
        self._healthy = {k: False for k in KINDS}
        self._cond = threading.Condition()
        self._pods: dict[str, dict[str, Any]] = {}
        self._gone: dict[str, dict[str, Any]] = {}  # deleted pods, with their last state
        self._events: dict[str, dict[str, dict[str, Any]]] = {}  # pod -> event name -> event
        self._rv: dict[str, Optional[str]] = {k: None for k in KINDS}  # None: list (again) first
        self._apis: dict[str, Any] = {}
        self._open: dict[str, Any] = {}  # kind -> the watch response being read (stop() cuts it)
        self._first = {k: threading.Event() for k in KINDS}  # the first watch answered (or failed)
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- the provider's calls ------------------------------------------------------------------

    def start(self, timeout: Optional[float] = None) -> PoolWatch:
        """List the pods and events, open both watches, and return. A 401/403 is raised as
        `cluster.refused` words it ("may not list pods ..."); a 429, a 5xx or no answer is asked
        again with backoff until `timeout` (seconds; None: until `stop()`), then raised."""
        import urllib3
        from kubernetes import client

        deadline = None if timeout is None else time.monotonic() + timeout
        for kind in KINDS:
            # Each stream its own client: the official client's objects are not safe to share.
            api_client = cluster.api_client(self.cfg)
            # urllib3 itself would retry a 429/503 that has a Retry-After, sleeping it out unseen
            # and unstoppable: every retry here is this module's, counted and ended by stop().
            api_client.rest_client.pool_manager.connection_pool_kw["retries"] = urllib3.Retry(
                0, redirect=0, respect_retry_after_header=False, raise_on_status=False)
            self._apis[kind] = client.CoreV1Api(api_client)
        for kind in KINDS:
            def list_it(k: str = kind) -> None:
                self._list(k)

            def note(exc: BaseException, wait: float, k: str = kind) -> None:
                self._failed(f"list {k}", exc)

            try:
                api_retry.call_with_retry(list_it, self._stopped, deadline, note)
            except Exception as exc:
                self.stop()
                raise cluster.refused(exc, f"list {kind}", self.namespace) from exc
        for kind in KINDS:
            t = threading.Thread(target=self._follow, args=(kind,), daemon=True,
                                 name=f"skytasks-k8s-watch-{kind}-{self.pool_id}")
            self._threads.append(t)
            t.start()
        for kind in KINDS:
            self._first[kind].wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        refusal = self.refusal
        if refusal is not None:
            self.stop()
            raise refusal
        return self

    def pods(self) -> dict[str, dict[str, Any]]:
        """The pool's pods the API server holds, by name."""
        with self._cond:
            return dict(self._pods)

    def deleted(self) -> set[str]:
        """The pods seen once and deleted since (a pod in neither is not seen yet)."""
        with self._cond:
            return set(self._gone)

    def last_state(self, name: str) -> Optional[dict[str, Any]]:
        """A pod as it is, or as it was last seen before its deletion; None if never seen."""
        with self._cond:
            return self._pods.get(name) or self._gone.get(name)

    def events(self, pod: str) -> list[dict[str, Any]]:
        """The events about `pod`, oldest first (`event_time`)."""
        with self._cond:
            return sorted((self._events.get(pod) or {}).values(), key=event_time)

    @property
    def refusal(self) -> Optional[Exception]:
        """The 401/403 the API server gives the watch now (pods' first), as `cluster.refused` words
        it ("may not watch pods ..."): for the caller to raise. None once a request works again."""
        return next((self._refusals[k] for k in KINDS if k in self._refusals), None)

    @property
    def healthy(self) -> bool:
        """Both watches are open (or reopening after a normal end) and the last request worked."""
        return all(self._healthy.values()) and not self._stopped.is_set()

    def wait_for_change(self, since: int, timeout: Optional[float]) -> int:
        """Until `version` differs from `since` (a change, `wake()` or `stop()`) or `timeout`
        passes: the version now."""
        with self._cond:
            self._cond.wait_for(lambda: self.version != since or self._stopped.is_set(), timeout)
            return self.version

    def wake(self) -> None:
        """Wake every `wait_for_change` (an abort, a stop of the caller's own)."""
        self._changed()

    def stop(self) -> None:
        """End both watches and their threads (within a second unless a LIST is in flight; at
        most its timeout). Idempotent."""
        self._stopped.set()
        with self._cond:
            open_now = list(self._open.values())
            self._cond.notify_all()
        for resp in open_now:
            api_retry.cut(resp)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(LIST_SECONDS + CONNECT_SECONDS)
        for api in self._apis.values():
            try:
                api.api_client.close()
            except Exception:  # noqa: BLE001 - closing what is closed already
                pass

    # -- lists and watches ---------------------------------------------------------------------

    def _selector(self, kind: str) -> dict[str, str]:
        if kind == "pods":
            return {"label_selector": f"{pods.POOL_LABEL}={self.pool_id}"}
        return {"field_selector": "involvedObject.kind=Pod"}  # no prefix match: the pool's are kept below

    def _call(self, kind: str, **kw: Any) -> Any:
        api = self._apis[kind]
        method = api.list_namespaced_pod if kind == "pods" else api.list_namespaced_event
        self.requests[f"{'WATCH' if kw.get('watch') else 'LIST'} {kind}"] += 1
        return method(self.namespace, _preload_content=False, **self._selector(kind), **kw)

    def _list(self, kind: str) -> None:
        items: list[dict[str, Any]] = []
        rv, more = None, None
        while True:
            page: dict[str, str] = {"_continue": more} if more else {}
            resp = self._call(kind, limit=PAGE, _request_timeout=(CONNECT_SECONDS, LIST_SECONDS), **page)
            body = json.loads(resp.data)
            items += body.get("items") or []
            meta = body.get("metadata") or {}
            rv = rv or meta.get("resourceVersion")
            more = meta.get("continue")
            if not more:
                break
        with self._cond:
            if kind == "pods":
                listed = {p["metadata"]["name"]: p for p in items}
                self._gone.update({n: p for n, p in self._pods.items() if n not in listed})
                self._pods = listed
            else:
                self._events = {}
                for e in items:
                    self._keep_event("ADDED", e)
            self._rv[kind] = rv
        self._changed()

    def _follow(self, kind: str) -> None:
        """The watch of one kind, for the pool's life: re-watched when the server ends it,
        re-listed on 410, retried with backoff on anything else."""
        backoff = api_retry.Backoff()
        while not self._stopped.is_set():
            wait = 0.0
            try:
                if self._rv[kind] is None:
                    self._list(kind)
                opened = time.monotonic()
                brought = self._watch_once(kind)
                if not brought and time.monotonic() - opened < QUIET_SECONDS:
                    wait = backoff.delay()  # ended at once with nothing: a proxy's cut, not the server's timeout
                else:
                    backoff.reset()
            except _Gone as gone:
                self.last_error = f"{time.strftime('%H:%M:%S')} watch {kind}: HTTP 410: {gone} (listed again)"
                with self._cond:
                    self._rv[kind] = None
                wait = backoff.delay()
            except Exception as exc:  # noqa: BLE001 - every failure is retried; refusals are also recorded
                if self._stopped.is_set():
                    break
                self._failed(f"{'list' if self._rv[kind] is None else 'watch'} {kind}", exc)
                if not api_retry.passing(exc) and not api_retry.refused(exc):
                    with self._cond:
                        self._rv[kind] = None  # a 410 as an HTTP status, a 400, a garbled stream: start afresh
                wait = backoff.delay(api_retry.retry_after(exc))
                self._first[kind].set()
            if wait and self._stopped.wait(wait):
                break

    def _watch_once(self, kind: str) -> int:
        """One WATCH from the last resourceVersion, read until the server ends it: how many
        changes it brought."""
        server_seconds = self.watch_seconds + random.randint(0, 60)  # pools that started together renew apart
        resp = self._call(kind, watch=True, resource_version=self._rv[kind], allow_watch_bookmarks=True,
                          timeout_seconds=server_seconds,
                          _request_timeout=(CONNECT_SECONDS, server_seconds + READ_SLACK_SECONDS))
        with self._cond:
            if self._stopped.is_set():
                api_retry.cut(resp)
                return 0
            self._open[kind] = resp
        self._ok(kind)
        brought = 0
        try:
            for line in api_retry.watch_lines(resp):
                try:
                    event = json.loads(line)
                except ValueError:  # not JSON, or not UTF-8: a line mangled as the connection was cut
                    break  # under the reader (seen in tests): the next watch goes on from the last version
                kind_of, obj = event.get("type"), event.get("object") or {}
                if kind_of == "ERROR":  # a Status: 410 when the resourceVersion is too old
                    if obj.get("code") == 410:
                        raise _Gone(obj.get("message"))
                    raise api_retry.StreamError(obj)
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                with self._cond:
                    ours = kind_of != "BOOKMARK" and (self._keep_pod(kind_of, obj) if kind == "pods"
                                                      else self._keep_event(kind_of, obj))
                    self._rv[kind] = rv or self._rv[kind]
                brought += kind_of != "BOOKMARK"
                if ours:
                    self._changed()
        finally:
            with self._cond:
                self._open.pop(kind, None)
            api_retry.cut(resp)
        return brought

    def _keep_pod(self, kind_of: str, pod: dict[str, Any]) -> bool:
        name = pod["metadata"]["name"]
        if kind_of == "DELETED":
            self._pods.pop(name, None)
            self._gone[name] = pod
        else:
            self._pods[name] = pod
        return True

    def _keep_event(self, kind_of: str, event: dict[str, Any]) -> bool:
        """Keep an event about one of the pool's pods; whether it was one (the rest of the
        namespace's Pod events are dropped, and wake nobody)."""
        pod = (event.get("involvedObject") or {}).get("name") or ""
        if not pod.startswith(f"{self.pool_id}-"):
            return False
        name = event["metadata"]["name"]
        if kind_of == "DELETED":  # expired (the API server keeps events an hour)
            (self._events.get(pod) or {}).pop(name, None)
        else:
            self._events.setdefault(pod, {})[name] = event
        return True

    # -- health --------------------------------------------------------------------------------

    def _changed(self) -> None:
        with self._cond:
            self.version += 1
            self._cond.notify_all()
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception as exc:  # noqa: BLE001 - the caller's; the watch goes on
                self.last_error = f"on_change: {type(exc).__name__}: {exc}"

    def _ok(self, kind: str) -> None:
        self._healthy[kind] = True
        self._first[kind].set()
        self._refusals.pop(kind, None)

    def _failed(self, doing: str, exc: BaseException) -> None:
        kind = doing.split()[-1]
        self._healthy[kind] = False
        status = api_retry.status_of(exc)
        self.last_error = (f"{time.strftime('%H:%M:%S')} {doing}: "
                           f"{'HTTP %s: ' % status if status else ''}{cluster.api_message(exc)[:300]}")
        if api_retry.refused(exc):
            self._refusals[kind] = cluster.refused(exc, doing, self.namespace)
            self._changed()
