"""provider="aws": EC2 instances the pool launches, reaches over SSH, and always terminates.

Start: plan and validate (`aws_plan`), make the pool's own key pair, security group and (GPU)
placement group, launch every node in one RunInstances call (all or nothing), wait until each
node answers SSH with the host key the controller gave it and reports its bootstrap done, then
hand the addresses to the shared SSH layer, which starts the node agents.

Stop, on every path: terminate the instances, wait until they are gone, then delete the security
group, key pair and placement group. What survives a controller that cannot run this (SIGKILL,
power loss) is ended by the node's own watchdog, and anything left behind is found by its tags
(`skytasks:pool`, `skytasks:expires-at`) and deleted by `skytasks gc`. The expiry is a lease the
pool renews on its instances while the controller lives (`remote_fields.lease_expiry`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from skytasks.errors import PoolStartError
from skytasks.event_bus import PoolReporter, flow_run_id
from skytasks.providers import Capabilities, NodeLink, NodeProvider
from skytasks.providers.aws.bootstrap import HEARTBEAT_FILE, NOTICE_FILE, VENV_PYTHON
from skytasks.providers.aws.capacity import launch_what_can_be_had, refused
from skytasks.providers.aws.launch import launch_request  # (check.py imports it from here too)
from skytasks.providers.aws.plan import LaunchPlan, plan_launch
from skytasks.providers.aws.readiness import known_hosts_text, probe_all, run_async
from skytasks.providers.aws.resources import POLL_SECONDS, PoolResources, pool_tags
from skytasks.providers.aws.spec import AWSSettings
from skytasks.providers.aws.warm_instances import WarmInstances
from skytasks.providers.remote_fields import Lease
from skytasks.providers.ssh.nodes import SSHLogin, SSHNodes
from skytasks.providers.teardown import uninterruptible

if TYPE_CHECKING:
    from skytasks.pool_spec import PoolSpec


class AWSProvider(WarmInstances, NodeProvider):
    # Instances cost money: a call of another shape must not launch its own; a workdir travels to
    # the nodes. A new SSH session to the instance reaches its running agent (ssh's reattach). A
    # replacement is a new instance: a node that failed its preflight is not taken again.
    capabilities = Capabilities(gpus_from_config=True, reattaches=True, replaces_elsewhere=True)

    def __init__(self, spec: PoolSpec, reporter: PoolReporter | None = None):
        self._spec = spec
        self._aws = spec.own(AWSSettings)
        self.pool_id = f"skytasks-{uuid.uuid4().hex[:10]}"
        self._ec2 = spec.credentials.get_client("ec2")
        self._ssm = spec.credentials.get_client("ssm")
        self.reporter = reporter or PoolReporter(spec.name, "aws")
        self.reporter.key = self.pool_id
        self._progress = self.reporter.progress
        self.owned = PoolResources(self._ec2, self.pool_id)
        self._nodes: SSHNodes | None = None
        self._teardown_lock = threading.Lock()
        self._aborted = threading.Event()
        self._lease = Lease(self._aws.idle_minutes, self._aws.max_lifetime_minutes)
        self._lease.keep_warm_minutes = spec.keep_warm_minutes  # a released warm pool is no orphan
        self._request: dict[str, Any] | None = None  # the launch request, for replacements alike

    def abort(self) -> None:
        """Cut a launch in progress short (from another thread): start() tears down and raises."""
        self._aborted.set()

    # -- start ------------------------------------------------------------------------------

    def start(self) -> list[NodeLink]:
        from botocore.exceptions import ClientError

        spec = self._spec
        try:
            plan, login_key, host_key = self.launch()
            addresses, private = self._wait_until_ready(plan, login_key, host_key)
            self._nodes = SSHNodes(SSHLogin(
                targets=[(plan.login, a, 22) for a in addresses], known_hosts=known_hosts_text(addresses, host_key),
                peer_addresses=private,
                private_key=login_key.export_private_key().decode(), python=self._python(),
                python_default=None if self._aws.remote_python else "the default: the venv the node's bootstrap built",
                env=dict(spec.env), heartbeat_file=HEARTBEAT_FILE, timeout=self._aws.ready_timeout_seconds,
                notice_file=NOTICE_FILE if self._aws.spot else None,
            ), self.reporter)
            return self._nodes.start()
        except BaseException as exc:
            self.stop()
            if isinstance(exc, ClientError):  # EC2 refused a step: its words, after everything made was deleted
                raise PoolStartError(refused(exc, f"starting {self.pool_id}") + "; everything the pool had made "
                                     "was deleted") from exc
            raise

    def launch(self) -> tuple[LaunchPlan, Any, Any]:
        """Plan (raising before anything exists), make the keys, group and instances; do not wait
        for them. What `start` does first; `stop` deletes everything it made. Returns the plan, the
        login key and the host key the nodes were given."""
        spec = self._spec
        plan = plan_launch(spec, self._ec2, self._ssm)
        cap = self._aws.max_lifetime_minutes
        hours = None if cap is None else cap / 60
        self._progress(0, spec.nodes, plan.cost_line(spec.nodes, hours, self._aws.spot))
        login_key, host_key = self._make_keys()
        short = self._launch(plan, host_key)
        if short:  # an elastic pool got fewer: why, and the cost of what it really has
            launched = len(self.owned.instance_ids)
            self.reporter.note(f"{self.pool_id}: launched {launched} of {spec.nodes} nodes ({short}); "
                                 f"{plan.cost_line(launched, hours, self._aws.spot)}")
        self._plan, self._login_key, self._host_key = plan, login_key, host_key  # for replace()
        self._node_ids = dict(enumerate(self.owned.instance_ids))  # node id -> its instance
        self._lease.keep(lambda until: self.owned.renew_expiry(list(self._node_ids.values()), until),
                         lambda line: self.reporter.note(f"{self.pool_id}: {line}", level=logging.WARNING),
                         name=f"skytasks-lease-{self.pool_id}")
        return plan, login_key, host_key

    def _fresh_request(self) -> dict[str, Any]:
        """The launch request again, with tags made now: a replacement must not start with the
        lease its pool had at its start, long run out."""
        if self._request is None:  # an adopted pool: planned again, a host key of its own
            groups = [self.owned.security_group_id, *self._aws.security_group_ids]
            self._plan = plan_launch(self._spec, self._ec2, self._ssm)
            self._request = launch_request(self._spec, self._plan, self._host_key, self._tags,
                                           [g for g in groups if g],
                                           # the pool's own key pair (in its handle) or the user's:
                                           # a replacement launched without it cannot be logged in to
                                           self.owned.key_name or self._aws.key_name, self.owned.placement_group)
        assert self._request is not None
        return {**self._request, "TagSpecifications": self._tags("instance") + self._tags("volume")}

    def tags(self, resource_type: str) -> list[dict]:
        """The TagSpecifications every resource of this pool carries (skytasks gc finds them by it)."""
        return self._tags(resource_type)

    def prepare_workdir(self, request) -> tuple[str, str | None]:
        return self._nodes.prepare_workdir(request)  # type: ignore[union-attr]

    def replace(self, node_id: int) -> NodeLink:
        """A lost node (its agent gone, its instance terminated: a spot interruption too): the
        instance is terminated, and one launched exactly alike (group, key, tags, user-data) joins
        the pool in its place, owned and torn down like the rest."""
        from botocore.exceptions import ClientError

        self._ec2.terminate_instances(InstanceIds=[self._node_ids.pop(node_id)])
        try:
            [new], _ = launch_what_can_be_had(self._ec2, self._fresh_request(), 1, 1)
        except PoolStartError as exc:
            raise PoolStartError(f"node {node_id} was lost and no replacement could be had: {exc}") from exc.__cause__
        try:
            [node] = self._join([new["InstanceId"]], node_ids=[node_id])
        except ClientError as exc:
            raise PoolStartError(f"node {node_id} was lost and its replacement did not join: "
                                 f"{refused(exc, 'waiting for it')}") from exc
        return node

    def grow(self, count: int) -> list[NodeLink]:
        """Up to `count` more instances launched alike, when EC2 has the capacity now."""
        try:
            instances, short = launch_what_can_be_had(self._ec2, self._fresh_request(), 1, count)
        except PoolStartError as exc:
            self.reporter.note(f"{self.pool_id}: could not grow: {exc}")
            return []
        if short:
            self.reporter.note(f"{self.pool_id}: grew by {len(instances)} of {count} nodes ({short})")
        return self._join([i["InstanceId"] for i in instances])

    def _join(self, ids: list[str], node_ids: list[int] | None = None) -> list[NodeLink]:
        """New instances, once ready, as nodes of the pool (with their agents started)."""
        self.owned.instance_ids += ids
        addresses, private = self._wait_until_ready(self._plan, self._login_key, self._host_key, ids=ids)
        assert self._nodes is not None
        links = []
        for i, (iid, address, peer) in enumerate(zip(ids, addresses, private)):
            target, known = (self._plan.login, address, 22), known_hosts_text([address], self._host_key)
            if node_ids is None:
                node_id = self._nodes.add_target(target, peer, known)
            else:
                node_id = node_ids[i]
                self._nodes.retarget(node_id, target, peer, known)
            self._node_ids[node_id] = iid
            links.append(self._nodes.replace(node_id))
        return links

    def reattach(self, node_id: int, door: str, timeout: float) -> NodeLink:
        """A new SSH session to the node's running agent, as for ssh; NodeGone when EC2 says its
        instance is no longer pending or running (terminated, stopped, a spot interruption)."""
        from botocore.exceptions import ClientError

        from skytasks.errors import NodeGone

        assert self._nodes is not None
        iid = self._node_ids.get(node_id)
        if iid is None:
            raise NodeGone(f"node {node_id} has no instance any more")
        try:
            found = [i for r in self._ec2.describe_instances(InstanceIds=[iid])["Reservations"] for i in r["Instances"]]
        except ClientError as exc:
            if exc.response["Error"]["Code"] == "InvalidInstanceID.NotFound":
                raise NodeGone(f"node {node_id}: its instance {iid} no longer exists") from exc
            raise  # throttled, or EC2 unreachable: tried again
        state = found[0]["State"]["Name"] if found else "gone"
        if state not in ("pending", "running"):
            why = (found[0].get("StateReason") or {}).get("Message", "") if found else ""
            raise NodeGone(f"node {node_id}: its instance {iid} is {state}" + (f" ({why})" if why else ""))
        return self._nodes.reattach(node_id, door, timeout)

    def release(self, node_id: int) -> None:
        """A node the pool let go (preempted or lost): its instance is terminated now."""
        assert self._nodes is not None
        self._nodes.release(node_id)
        iid = self._node_ids.pop(node_id, None)
        if iid is not None:
            self._ec2.terminate_instances(InstanceIds=[iid])

    def _python(self) -> str:
        # remote_python, when set, names an interpreter the image already has; otherwise it is
        # the venv the bootstrap built.
        return self._aws.remote_python or VENV_PYTHON

    def _tags(self, resource_type: str) -> list[dict]:
        tags = pool_tags(self.pool_id, self._lease.expiry(), self._aws.tags, flow_run_id())
        return [{"ResourceType": resource_type, "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}]

    def _make_keys(self) -> tuple[Any, Any]:
        import asyncssh

        host_key = asyncssh.generate_private_key("ssh-ed25519")
        if self._aws.key_name:  # the user's own key pair; its private half is ssh_private_key
            private = self._aws.ssh_private_key
            assert private is not None  # the spec refuses key_name without it
            return asyncssh.import_private_key(private.get_secret_value()), host_key
        login_key = asyncssh.generate_private_key("ssh-ed25519")
        self._ec2.import_key_pair(KeyName=self.pool_id, PublicKeyMaterial=login_key.export_public_key(),
                                  TagSpecifications=self._tags("key-pair"))
        self.owned.key_name = self.pool_id
        return login_key, host_key

    def _launch(self, plan: LaunchPlan, host_key: Any) -> str:
        spec, ec2 = self._spec, self._ec2
        sg = ec2.create_security_group(GroupName=self.pool_id, VpcId=plan.vpc_id, TagSpecifications=self._tags("security-group"),
                                       Description=f"skytasks pool {self.pool_id}: SSH from the controller, all traffic inside")
        sg_id = self.owned.security_group_id = sg["GroupId"]
        ec2.authorize_security_group_ingress(GroupId=sg_id, IpPermissions=[
            {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22,
             "IpRanges": [{"CidrIp": plan.ssh_ingress_cidr, "Description": "skytasks controller"}]},
            {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": sg_id}]},  # rendezvous, NCCL
        ])
        if plan.placement_group:
            ec2.create_placement_group(GroupName=self.pool_id, Strategy="cluster",
                                       TagSpecifications=self._tags("placement-group"))
            self.owned.placement_group = self.pool_id
        groups = [sg_id, *self._aws.security_group_ids]
        request = launch_request(spec, plan, host_key, self._tags, groups, self.owned.key_name or self._aws.key_name,
                                 self.owned.placement_group)
        self._request = request  # a replacement is launched exactly alike (replace())
        instances, short = launch_what_can_be_had(ec2, request, spec.fewest, spec.nodes)
        self.owned.instance_ids = [i["InstanceId"] for i in instances]
        return short

    def _wait_until_ready(self, plan: LaunchPlan, login_key: Any, host_key: Any,
                          ids: list[str] | None = None) -> tuple[list[str], list[str]]:
        """Until every node answers SSH with its pinned host key and says its bootstrap is done.
        Returns the addresses to reach them on, and their private addresses (for the peers)."""
        deadline = time.monotonic() + self._aws.ready_timeout_seconds
        ids = list(self.owned.instance_ids) if ids is None else ids
        state: dict[str, str] = {i: "launching" for i in ids}
        addresses: dict[str, str] = {}
        private: dict[str, str] = {}
        ready: set[str] = set()
        while True:
            for instance in self._describe_new_instances():
                iid, name = instance["InstanceId"], instance["State"]["Name"]
                if iid not in ids:
                    continue  # a lost node's instance, already being terminated
                if name in ("shutting-down", "terminated", "stopped", "stopping"):
                    reason = instance.get("StateReason", {}).get("Message", "no reason given")
                    raise PoolStartError(f"aws node {iid} is {name} before it was ready: {reason}")
                address = instance.get("PublicIpAddress") or instance.get("PrivateIpAddress")
                if name == "running" and address:
                    addresses[iid], private[iid] = address, instance.get("PrivateIpAddress") or address
                    state.setdefault(iid, "running")
            waiting = [i for i in ids if i in addresses and i not in ready]
            if waiting:
                answers = run_async(probe_all([addresses[i] for i in waiting], plan.login, login_key, host_key))
                for iid, answer in zip(waiting, answers):
                    if answer.startswith("failed"):
                        raise PoolStartError(f"aws node {iid} ({addresses[iid]}): bootstrap {answer}")
                    state[iid] = answer
                    if answer == "ready":
                        ready.add(iid)
            self._progress(len(ready), len(ids), "; ".join(f"{i}: {state[i]}" for i in ids))
            if len(ready) == len(ids):
                return [addresses[i] for i in ids], [private[i] for i in ids]
            if time.monotonic() >= deadline:
                late = [f"{i} ({state[i]})" for i in ids if i not in ready]
                raise PoolStartError(
                    f"ready_timeout_seconds: {len(late)} of {len(ids)} node(s) not ready after "
                    f"{self._aws.ready_timeout_seconds:g}s: {', '.join(late)}; everything launched was terminated"
                )
            if self._aborted.wait(min(POLL_SECONDS, max(0.0, deadline - time.monotonic()))):
                raise InterruptedError(f"the launch of {self.pool_id} was cancelled; everything launched was terminated")

    def _describe_new_instances(self) -> list[dict]:
        from botocore.exceptions import ClientError

        try:
            return self.owned.describe_instances()
        except ClientError as exc:
            # EC2 is eventually consistent: ids just returned by RunInstances may not be
            # describable for a few seconds.
            if exc.response["Error"]["Code"] == "InvalidInstanceID.NotFound":
                return []
            raise

    def free_port(self, head: int) -> int:
        assert self._nodes is not None
        return self._nodes.free_port(head)

    # -- stop -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Tear everything down. Runs in a thread of its own and is waited for through Ctrl-C
        and SIGTERM: an interrupt must not abandon running instances half way; it is raised
        once the teardown is done."""
        uninterruptible(self._teardown, lambda: self.reporter.note("still terminating the pool's instances; please wait"),
                        name="skytasks-aws-teardown")

    def _teardown(self) -> BaseException | None:
        with self._teardown_lock:
            self._lease.stop()  # no renewal tags an instance being terminated
            if self._nodes is not None:
                self._nodes.stop()
                self._nodes = None
            errors = self.owned.teardown()
            left = self.owned.leftovers()  # each step clears what it confirmed gone
            if errors:
                # Raised from stop(), after every step was tried: the pool's exit raises it.
                return self.reporter.teardown_failed(left, "; ".join(errors))
            return None

