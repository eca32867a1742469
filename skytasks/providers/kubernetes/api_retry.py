"""Which of the Kubernetes API's answers pass, and how long to wait before asking again.

A 429 (API Priority and Fairness, a max-in-flight limit, a managed control plane's throttle) and a
5xx (an API server restarting or overloaded, etcd slow, a load balancer with no backend yet) say
"later", as does a connection that breaks or cannot be made: they are retried, with exponential
backoff and full jitter (so the pools of many flow runs that a restart cut off do not come back in
step), never sooner than the server's Retry-After. A 401 or 403 says "never, as you are": it is
the caller's to report. Pure functions, tested without a cluster; and the reading of a watch's
stream, cut from another thread when its reader stops.
"""

from __future__ import annotations

import email.utils
import json
import random
import time
from typing import Any, Callable, Iterator, Optional

FIRST_DELAY = 0.5  # seconds: the first retry's ceiling
MAX_DELAY = 30.0  # the ceiling of every later one
MAX_RETRY_AFTER = 120.0  # a longer Retry-After is taken as this (a server's clock or a typo)
REFUSED = (401, 403)


def status_of(exc: BaseException) -> Optional[int]:
    """The HTTP status of an API error; None for a connection that broke or could not be made
    (the client's ApiException carries status 0 for a TLS failure: also None)."""
    status = getattr(exc, "status", None) or getattr(exc, "status_code", None)
    return int(status) if isinstance(status, int) and status > 0 else None


def no_answer(exc: BaseException) -> bool:
    """A connection that could not be made or broke (refused, reset, timed out, cut mid-stream)."""
    import http.client

    import urllib3

    if isinstance(exc, (OSError, urllib3.exceptions.HTTPError, http.client.HTTPException)):
        return True
    return type(exc).__name__ == "ApiException" and status_of(exc) is None  # the client's TLS failure: status 0


def passing(exc: BaseException) -> bool:
    """Whether asking again later may succeed: a 429, a 5xx, or no answer at all."""
    status = status_of(exc)
    if status is None:
        return no_answer(exc)
    return status == 429 or 500 <= status <= 599


def refused(exc: BaseException) -> bool:
    """401 (the credentials are not accepted) or 403 (the identity may not): no wait mends it."""
    return status_of(exc) in REFUSED


def retry_after(exc: BaseException, now: Optional[float] = None) -> Optional[float]:
    """The seconds the server asked to wait (Retry-After: seconds, or an HTTP date), if it did."""
    headers = getattr(exc, "headers", None) or getattr(exc, "resp_headers", None)  # a websocket upgrade's: resp_headers
    if headers is None or not hasattr(headers, "get"):
        return None
    value = headers.get("Retry-After") or headers.get("retry-after")  # the upgrade's are lower-cased
    if not value:
        return None
    value = str(value).strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    return min(max(0.0, seconds), MAX_RETRY_AFTER)


class Backoff:
    """Exponential backoff with full jitter: the n-th wait in a row is uniform in
    [0, min(MAX_DELAY, FIRST_DELAY * 2**n)], and never shorter than a Retry-After the server gave.
    `reset()` once a request has worked for a while."""

    def __init__(self, first: float = FIRST_DELAY, cap: float = MAX_DELAY,
                 rng: Callable[[], float] = random.random):
        self.first, self.cap, self._rng = first, cap, rng
        self.failures = 0

    def delay(self, server_asked: Optional[float] = None) -> float:
        ceiling = min(self.cap, self.first * (2 ** min(self.failures, 30)))
        self.failures += 1
        wait = self._rng() * ceiling
        if server_asked is not None:
            wait = max(wait, server_asked + self._rng() * self.first)
        return wait

    def reset(self) -> None:
        self.failures = 0


def call_with_retry(call: Callable[[], Any], stopped: Any, deadline: Optional[float],
                    on_retry: Callable[[BaseException, float], None] = lambda exc, wait: None) -> Any:
    """`call()`, asked again after each passing failure (`passing`) until it answers, `stopped`
    (a threading.Event) is set, or `deadline` (time.monotonic()) comes; then the last failure is
    raised. Any other failure is raised at once."""
    backoff = Backoff()
    while True:
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - sorted below
            if not passing(exc):
                raise
            wait = backoff.delay(retry_after(exc))
            if deadline is not None and time.monotonic() + wait > deadline:
                raise
            on_retry(exc, wait)
            if stopped.wait(wait):
                raise


class StreamError(Exception):
    """An ERROR event in a watch other than 410: a Status with its HTTP code."""

    def __init__(self, status: dict[str, Any]):
        super().__init__(status.get("message") or str(status))
        self.status = status.get("code")
        self.body = json.dumps(status)


def watch_lines(resp: Any) -> Iterator[bytes]:
    """The complete lines of a watch response as they arrive (one JSON event each); a line the
    connection cut short is dropped."""
    buffer = b""
    while True:
        data = resp.read1(65536)
        if not data:
            return
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        yield from (line for line in lines if line.strip())


def cut(resp: Any) -> None:
    """End a response another thread may be blocked reading (urllib3's shutdown wakes it), and
    close its connection."""
    for end in (getattr(resp, "shutdown", None), resp.close):
        try:
            if end is not None:
                end()
        except Exception:  # noqa: BLE001 - released or closed already
            pass
