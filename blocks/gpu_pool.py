"""GPUPool: the Prefect block that says which nodes a distributed task runs on.

Configuration plus a few verbs, after prefect-aws: the fields are validated at construction (a
bad pool never launches anything), and `with pool:` / `async with pool:` keeps its nodes up
across calls and always tears them down.
"""

from __future__ import annotations

import asyncio
import contextvars
import ipaddress
import re
import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Literal, Optional

from prefect.blocks.core import Block
from prefect_aws import AwsCredentials
from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator

HOST_PATTERN = re.compile(r"^(?:(?P<user>[A-Za-z0-9._-]+)@)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::(?P<port>\d{1,5}))?$")

# The pools entered with `with pool:` in this context, innermost last. A contextvar follows
# async tasks and Prefect's task threads (they copy the context); the process-wide stack is the
# fallback for threads that were started without a copy.
_ACTIVE: contextvars.ContextVar[tuple["GPUPool", ...]] = contextvars.ContextVar("skytasks_active_pools", default=())
_ACTIVE_ANY_THREAD: list["GPUPool"] = []
_ACTIVE_LOCK = threading.Lock()


class TerminationRequested(SystemExit):
    """SIGTERM arrived while a pool was up: unwind so teardown runs, then exit 143."""


class GPUPool(Block):
    _block_type_name = "GPU Pool"
    _block_type_slug = "gpu-pool"
    _logo_url = "https://images.ctfassets.net/gm98wzqotmnx/4HlN0GkcPMXp6TxuQtHEjt/16dd0296f4f2ccd3db3e5eb1e1b66ddc/pytorch-logo.png"  # noqa: E501
    _description = "Nodes for multi-node PyTorch training: local processes, SSH hosts or EC2 instances."
    _documentation_url = "https://github.com/skytasks/skytasks#readme"
    _code_example = """
```python
from skytasks import GPUPool
from skytasks import distributed_task

GPUPool(provider="local", nodes=2).save("two-local-nodes")

@distributed_task(pool="two-local-nodes")
def train(epochs: int = 3) -> dict:
    ...
```
"""

    provider: Literal["local", "ssh", "aws"] = Field("local", description="local: processes here; ssh: your machines; aws: EC2 it launches")
    nodes: int = Field(2, ge=1, description="Number of nodes.")
    procs_per_node: int = Field(1, ge=1, description="Rank processes per node (one per GPU).")
    accelerator: Optional[str] = Field(None, description='GPU model, e.g. "A100", "H100", "L4". None means CPU.')
    accelerators_per_node: Optional[int] = Field(None, ge=1, description="GPUs per node; 1 when accelerator is set.")
    env: dict[str, str] = Field(default_factory=dict, description="Environment for every rank.")
    pip_packages: list[str] = Field(default_factory=list, description="Extra packages installed on launched nodes.")
    torch_version: str = Field("latest", description='"latest", a bare version (pinned with ==) or a constraint.')
    torch_cuda: str = Field("cu128", description="CUDA wheel index suffix, used when the accelerator has CUDA.")
    torchvision: Optional[str] = None
    torchaudio: Optional[str] = None
    hosts: list[str] = Field(default_factory=list, description='ssh: "[user@]host[:port]" per node, head first.')
    ssh_user: Optional[str] = None
    ssh_private_key: Optional[SecretStr] = Field(None, description="Private key (PEM/OpenSSH text) for ssh and aws.")
    known_hosts: Optional[str] = Field(None, description="known_hosts text or path; host keys are always checked.")
    remote_python: Optional[str] = Field(
        None, description='Python on the nodes: ssh default "python3"; aws default the venv its bootstrap builds.')
    aws_credentials: AwsCredentials = Field(default_factory=AwsCredentials)
    instance_type: Optional[str] = None
    image_id: Optional[str] = None
    subnet_id: Optional[str] = None
    security_group_ids: list[str] = Field(default_factory=list)
    key_name: Optional[str] = None
    spot: bool = False
    root_volume_gb: int = Field(100, ge=8)
    iam_instance_profile: Optional[str] = None
    tags: dict[str, str] = Field(default_factory=dict)
    ssh_ingress_cidr: Optional[str] = Field(None, description="aws: who may reach SSH on launched nodes.")
    ready_timeout_seconds: float = Field(900, gt=0)
    idle_minutes: float = Field(15, gt=0)
    max_lifetime_minutes: float = Field(720, gt=0)

    _session: Any = PrivateAttr(default=None)
    _depth: int = PrivateAttr(default=0)
    _tokens: list = PrivateAttr(default_factory=list)
    _previous_sigterm: Any = PrivateAttr(default=None)

    @field_validator("hosts")
    @classmethod
    def _hosts_are_well_formed(cls, hosts: list[str]) -> list[str]:
        for h in hosts:
            m = HOST_PATTERN.match(h.strip())
            if not m or (m["port"] and not 0 < int(m["port"]) < 65536):
                raise ValueError(f"hosts: {h!r} is not of the form [user@]host[:port]")
        return [h.strip() for h in hosts]

    @model_validator(mode="after")
    def _fields_agree(self) -> GPUPool:
        if self.accelerator is not None and self.accelerators_per_node is None:
            self.accelerators_per_node = 1
        if self.provider == "ssh":
            if not self.hosts:
                raise ValueError("hosts: provider='ssh' needs one host per node, head first")
            if len(self.hosts) != self.nodes:
                raise ValueError(f"hosts: {len(self.hosts)} host(s) given for nodes={self.nodes}; give one per node")
        if self.provider != "ssh" and self.hosts:
            raise ValueError(f"hosts: only provider='ssh' takes hosts; provider={self.provider!r} brings its own nodes")
        if self.provider == "aws":
            if self.key_name and self.ssh_private_key is None:
                raise ValueError("ssh_private_key: key_name names your own key pair; give its private key too")
        return self

    @field_validator("ssh_ingress_cidr")
    @classmethod
    def _cidr_is_a_network(cls, cidr: Optional[str]) -> Optional[str]:
        if cidr is not None:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"ssh_ingress_cidr: {cidr!r} is not a network such as 203.0.113.7/32") from None
        return cidr

    # -- bringing nodes up and down ---------------------------------------------------------

    @property
    def is_up(self) -> bool:
        return self._session is not None

    @property
    def display_name(self) -> str:
        """The saved block's name, or the provider's for an unsaved pool (tags, events)."""
        return getattr(self, "_block_document_name", None) or f"{self.provider}-pool"

    def _start_session(self, starting: dict | None = None):
        from skytasks.controller.events import emit, pool_resource
        from skytasks.controller.session import PoolSession
        from skytasks.providers import provider_for

        provider = provider_for(self)
        if starting is not None:  # lets a cancelled `async with` abort a launch in progress
            starting["provider"] = provider
        session = PoolSession(provider, self.procs_per_node, {**aws_environment(self.aws_credentials), **self.env})
        emit("skytasks.pool.up", pool_resource(self.display_name),
             payload={"provider": self.provider, "nodes": self.nodes, "procs_per_node": self.procs_per_node,
                      "addresses": [n.link.address for n in session.nodes]})
        return session

    def _close_session(self, session) -> None:
        from skytasks.controller.events import emit, pool_resource

        try:
            session.close()
        finally:
            emit("skytasks.pool.down", pool_resource(self.display_name), payload={"provider": self.provider})

    @contextmanager
    def _nodes(self) -> Iterator[Any]:
        """The live session: this pool's if it is up, else one brought up for this call only."""
        if self._session is not None:
            yield self._session
            return
        # A pool brought up for one call owns launched machines too: SIGTERM must unwind
        # through the teardown here exactly as it does for `with pool:`.
        self._trap_sigterm()
        try:
            session = self._start_session()
            try:
                yield session
            finally:
                self._close_session(session)
        finally:
            self._restore_sigterm()

    def _push_active(self) -> None:
        self._depth += 1
        self._tokens.append(_ACTIVE.set(_ACTIVE.get() + (self,)))
        with _ACTIVE_LOCK:
            _ACTIVE_ANY_THREAD.append(self)

    def _pop_active(self) -> Any:
        """Leave one level of `with`; returns the session to close when it was the last one."""
        with _ACTIVE_LOCK:
            for i in range(len(_ACTIVE_ANY_THREAD) - 1, -1, -1):
                if _ACTIVE_ANY_THREAD[i] is self:
                    del _ACTIVE_ANY_THREAD[i]
                    break
        try:
            _ACTIVE.reset(self._tokens.pop())
        except ValueError:  # left from another context than it was entered in
            pass
        self._depth -= 1
        if self._depth > 0:
            return None
        session, self._session = self._session, None
        return session

    def __enter__(self) -> GPUPool:
        if self._depth == 0:
            self._session = self._start_session()
            self._trap_sigterm()
        self._push_active()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        session = self._pop_active()
        if self._depth == 0:
            try:
                if session is not None:
                    self._close_session(session)
            finally:
                self._restore_sigterm()

    async def __aenter__(self) -> GPUPool:
        if self._depth == 0:
            starting: dict = {}
            future = asyncio.get_running_loop().run_in_executor(None, self._start_session, starting)
            try:
                self._session = await asyncio.shield(future)
            except asyncio.CancelledError:
                # The start goes on in its thread: cut a launch short where the provider can,
                # and take down whatever still comes up.
                abort = getattr(starting.get("provider"), "abort", None)
                if abort is not None:
                    abort()
                future.add_done_callback(self._close_late_session)
                raise
        self._push_active()
        return self

    def _close_late_session(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            threading.Thread(target=self._close_session, args=(future.result(),), name="skytasks-late-close").start()

    async def __aexit__(self, *exc_info: Any) -> None:
        session = self._pop_active()
        if session is not None:
            # shield: teardown finishes even when the awaiting task is being cancelled.
            await asyncio.shield(asyncio.to_thread(self._close_session, session))

    def _trap_sigterm(self) -> None:
        # Python's default SIGTERM ends the process without unwinding, which would skip
        # teardown; turn it into an exception while the pool is up (main thread only).
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return

        def on_sigterm(signum: int, frame: Any) -> None:
            raise TerminationRequested(143)

        self._previous_sigterm = signal.signal(signal.SIGTERM, on_sigterm)

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None


def aws_environment(creds: AwsCredentials) -> dict[str, str]:
    """The pool's AWS credentials as the standard variables boto3 reads on a rank (for
    `skytasks.Checkpointer("s3://...")` and the user's own boto3 calls). Only what is set: an
    unset block leaves the node's own chain (an instance profile) in charge. Never logged."""
    secret = creds.aws_secret_access_key
    values = {
        "AWS_ACCESS_KEY_ID": creds.aws_access_key_id,
        "AWS_SECRET_ACCESS_KEY": secret.get_secret_value() if secret is not None else None,
        "AWS_SESSION_TOKEN": creds.aws_session_token,
        "AWS_DEFAULT_REGION": creds.region_name,
        "AWS_ENDPOINT_URL": creds.aws_client_parameters.endpoint_url if creds.aws_client_parameters else None,
    }
    return {k: str(v) for k, v in values.items() if v}


def active_pool() -> GPUPool | None:
    stack = _ACTIVE.get()
    if stack:
        return stack[-1]
    with _ACTIVE_LOCK:
        return _ACTIVE_ANY_THREAD[-1] if _ACTIVE_ANY_THREAD else None
