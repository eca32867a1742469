"""GPUPool: the Prefect block that says which nodes a distributed task runs on.

Configuration plus a few verbs, after prefect-aws: the fields are validated at construction (a
bad pool never launches anything), and `with pool:` / `async with pool:` keeps its nodes up
across calls and always tears them down.
"""

from __future__ import annotations

import ipaddress
import re
from typing import TYPE_CHECKING, Any, Optional

from prefect.blocks.core import Block
from prefect_aws import AwsCredentials
from pydantic import Field, PrivateAttr, SecretStr, ValidationError, field_validator, model_validator

import skytasks.prefect_records  # noqa: F401 - the Prefect side of pool events (flow-run logs, Prefect events)
from skytasks.errors import PoolConfigError
from skytasks.pool_spec import AWSSpec, PoolSpec, SlurmSpec, SSHSpec
from skytasks.providers import ProviderName

if TYPE_CHECKING:
    from skytasks.controller.pool_runtime import PoolRuntime

HOST_PATTERN = re.compile(r"^(?:(?P<user>[A-Za-z0-9._-]+)@)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::(?P<port>\d{1,5}))?$")

class GPUPool(Block):
    _block_type_name = "GPU Pool"
    _block_type_slug = "gpu-pool"
    _logo_url = "https://images.ctfassets.net/gm98wzqotmnx/4HlN0GkcPMXp6TxuQtHEjt/16dd0296f4f2ccd3db3e5eb1e1b66ddc/pytorch-logo.png"  # noqa: E501
    _description = ("Nodes for multi-node PyTorch training: local processes, SSH hosts, EC2 instances or the nodes "
                    "of a SLURM allocation.")
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

    provider: ProviderName = Field(
        "local", description="local: processes here; ssh: your machines; aws: EC2 it launches; slurm: a SLURM allocation")
    nodes: int = Field(2, ge=1, description="Number of nodes (the most, when min_nodes is set).")
    min_nodes: Optional[int] = Field(
        None, ge=1, description="Elastic: start with what can be had, at least this many; None: exactly `nodes`.")
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
    slurm_login: Optional[str] = Field(
        None, description='slurm: "[user@]host[:port]" of a login node where SLURM commands run over SSH; None: here.')
    slurm_partition: Optional[str] = Field(None, description="slurm: the allocation's --partition.")
    slurm_account: Optional[str] = Field(None, description="slurm: the allocation's --account.")
    slurm_qos: Optional[str] = Field(None, description="slurm: the allocation's --qos.")
    slurm_constraint: Optional[str] = Field(None, description="slurm: the allocation's --constraint.")
    slurm_gres: Optional[str] = Field(
        None, description='slurm: GPUs per node as SLURM names them ("gpu:h100:8"); None: gpu:<accelerators_per_node>.')
    slurm_extra_args: list[str] = Field(default_factory=list, description="slurm: further sbatch arguments, as written.")
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

    _runtime: Any = PrivateAttr(default=None)

    def __init__(self, **fields: Any) -> None:
        # pydantic's ValidationError is not the PoolConfigError the contract promises: a caller's
        # `except PoolConfigError` must catch every bad pool field, naming it.
        try:
            super().__init__(**fields)
        except ValidationError as exc:
            raise PoolConfigError(pool_field_errors(exc)) from None

    @field_validator("slurm_login")
    @classmethod
    def _login_is_well_formed(cls, login: Optional[str]) -> Optional[str]:
        return None if login is None else _host("slurm_login", login)

    @field_validator("slurm_extra_args")
    @classmethod
    def _extra_args_are_options(cls, args: list[str]) -> list[str]:
        for a in args:
            if not isinstance(a, str) or not a.startswith("-"):
                raise ValueError(f"slurm_extra_args: {a!r} is not an sbatch option (each item is one argument, "
                                 "such as '--exclusive' or '--mem=64G')")
        return args

    @field_validator("hosts")
    @classmethod
    def _hosts_are_well_formed(cls, hosts: list[str]) -> list[str]:
        return [_host("hosts", h) for h in hosts]

    @model_validator(mode="after")
    def _fields_agree(self) -> GPUPool:
        if self.accelerator is not None and self.accelerators_per_node is None:
            self.accelerators_per_node = 1
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ValueError(f"min_nodes: {self.min_nodes} is more than nodes={self.nodes} (nodes is the most the "
                             "pool asks for, min_nodes the fewest it runs on)")
        if self.provider == "ssh":
            if not self.hosts:
                raise ValueError("hosts: provider='ssh' needs one host per node, head first")
            if len(self.hosts) != self.nodes:
                raise ValueError(f"hosts: {len(self.hosts)} host(s) given for nodes={self.nodes}; give one per node")
        if self.provider != "ssh" and self.hosts:
            raise ValueError(f"hosts: only provider='ssh' takes hosts; provider={self.provider!r} brings its own nodes")
        slurm_set = [f for f in ("slurm_login", "slurm_partition", "slurm_account", "slurm_qos", "slurm_constraint",
                                 "slurm_gres", "slurm_extra_args") if getattr(self, f)]
        if self.provider != "slurm" and slurm_set:
            raise ValueError(f"{slurm_set[0]}: only provider='slurm' takes slurm_* fields (provider={self.provider!r})")
        for field in _AWS_ONLY:
            if self.provider != "aws" and getattr(self, field) != _default(field):
                raise ValueError(f"{field}: only provider='aws' takes it (provider={self.provider!r}); a field of "
                                 "another provider is never ignored silently")
        if self.provider == "slurm" and self.slurm_login and not self.known_hosts:
            raise ValueError("known_hosts: slurm_login needs the login node's host key in known_hosts (text or a "
                             "path); host keys are never trusted blindly")
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

    # -- what it is, frozen ---------------------------------------------------------------

    @property
    def saved_name(self) -> str | None:
        """The name it was saved or loaded as, if any."""
        return getattr(self, "_block_document_name", None)

    @property
    def display_name(self) -> str:
        """The saved block's name, or the provider's for an unsaved pool (tags, events)."""
        return self.saved_name or f"{self.provider}-pool"

    def spec(self) -> PoolSpec:
        """The validated fields as the frozen, typed spec the runtime and providers use."""
        login = dict(ssh_user=self.ssh_user, ssh_private_key=self.ssh_private_key, remote_python=self.remote_python,
                     pip_packages=tuple(self.pip_packages))
        ssh = aws = slurm = None
        if self.provider == "slurm":
            gres = self.slurm_gres or (f"gpu:{self.accelerators_per_node}" if self.accelerator else None)
            slurm = SlurmSpec(
                login=self.slurm_login, ssh_user=self.ssh_user, ssh_private_key=self.ssh_private_key,
                known_hosts=self.known_hosts, remote_python=self.remote_python, partition=self.slurm_partition,
                account=self.slurm_account, qos=self.slurm_qos, constraint=self.slurm_constraint, gres=gres,
                extra_args=tuple(self.slurm_extra_args), ready_timeout_seconds=self.ready_timeout_seconds,
                idle_minutes=self.idle_minutes, max_lifetime_minutes=self.max_lifetime_minutes)
        if self.provider == "ssh":
            ssh = SSHSpec(hosts=tuple(self.hosts), known_hosts=self.known_hosts,
                          ready_timeout_seconds=self.ready_timeout_seconds, **login)
        elif self.provider == "aws":
            aws = AWSSpec(
                credentials=self.aws_credentials, accelerator=self.accelerator,
                accelerators_per_node=self.accelerators_per_node, instance_type=self.instance_type,
                image_id=self.image_id, subnet_id=self.subnet_id, security_group_ids=tuple(self.security_group_ids),
                key_name=self.key_name, spot=self.spot, root_volume_gb=self.root_volume_gb,
                iam_instance_profile=self.iam_instance_profile, tags=dict(self.tags),
                ssh_ingress_cidr=self.ssh_ingress_cidr, torch_version=self.torch_version, torch_cuda=self.torch_cuda,
                torchvision=self.torchvision, torchaudio=self.torchaudio,
                ready_timeout_seconds=self.ready_timeout_seconds, idle_minutes=self.idle_minutes,
                max_lifetime_minutes=self.max_lifetime_minutes, **login)
        return PoolSpec(name=self.display_name, provider=self.provider, nodes=self.nodes, min_nodes=self.min_nodes,
                        procs_per_node=self.procs_per_node, accelerators_per_node=self.accelerators_per_node,
                        env={**aws_environment(self.aws_credentials), **self.env}, ssh=ssh, aws=aws, slurm=slurm)

    def reshaped(self, **shape: int) -> GPUPool:
        """A copy with other `nodes`/`procs_per_node`: another shape cannot use these nodes, so
        the copy has a runtime of its own."""
        if self.min_nodes is not None and shape.get("nodes", self.nodes) < self.min_nodes:
            shape = {**shape, "min_nodes": None}  # a fixed count below the floor: exactly that many
        copy = self.model_copy(update=shape)
        copy._runtime = None
        return copy

    # -- bringing nodes up and down: the runtime does it ------------------------------------

    def runtime(self) -> PoolRuntime:
        """This pool's runtime (skytasks.controller.pool_runtime), made from its spec on first use."""
        from skytasks.controller.pool_runtime import PoolRuntime

        rt = self._runtime
        if rt is None or (not rt.is_up and rt.spec != (spec := self.spec())):
            rt = self._runtime = PoolRuntime(self.spec() if rt is None else spec, self)
        return rt

    @property
    def is_up(self) -> bool:
        return self._runtime is not None and self._runtime.is_up

    def __enter__(self) -> GPUPool:
        self.runtime().enter()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.runtime().exit()

    async def __aenter__(self) -> GPUPool:
        await self.runtime().aenter()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.runtime().aexit()


# What only an aws pool uses (hosts and slurm_* are checked beside them, above).
_AWS_ONLY = ("instance_type", "image_id", "subnet_id", "security_group_ids", "key_name", "spot", "root_volume_gb",
             "iam_instance_profile", "tags", "ssh_ingress_cidr")


def _default(field: str) -> Any:
    info = GPUPool.model_fields[field]
    return info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]


def pool_field_errors(exc: ValidationError) -> str:
    """pydantic's errors as `field: what is wrong (got value)`, one per line, the field first."""
    lines = []
    for e in exc.errors():
        field = ".".join(str(part) for part in e["loc"])
        text = e["msg"].removeprefix("Value error, ")
        if field and not text.startswith(field + ":"):
            got = f" (got {e['input']!r})" if e["type"] != "missing" and not isinstance(e["input"], dict) else ""
            text = f"{field}: {text}{got}"
        lines.append(text)
    return "; ".join(lines)


def _host(field: str, text: str) -> str:
    """`[user@]host[:port]`, stripped, or a ValueError naming the field."""
    m = HOST_PATTERN.match(text.strip())
    if not m or (m["port"] and not 0 < int(m["port"]) < 65536):
        raise ValueError(f"{field}: {text!r} is not of the form [user@]host[:port]")
    return text.strip()


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
