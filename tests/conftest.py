"""Shared fixtures: one real Prefect API for the session, and a leak check after every test."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_TO_API_BATCH_INTERVAL", "0.3")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import signal  # noqa: E402

import psutil  # noqa: E402
import pytest  # noqa: E402

from tests.harness import session_scope, xdist_groups  # noqa: E402

# A shell starts a background job (`make test &`) with SIGINT ignored, and children inherit an
# ignored signal: the tests that press Ctrl-C on a CLI they start need it delivered.
signal.signal(signal.SIGINT, signal.default_int_handler)

ROLES = ("skytasks.node.agent", "skytasks.node.rank_template", "skytasks.node.worker")
SESSION_STARTED = psutil.Process().create_time()  # psutil's clock: comparable with its create_time()


def _runs_tests(config) -> bool:
    """This process runs tests: an xdist worker, or a session without workers (not xdist's
    controller, which only hands tests out)."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER")) or not getattr(config.option, "numprocesses", None)


def pytest_configure(config):
    if _runs_tests(config):
        session_scope.join_own_cgroup()
    elif getattr(config.option, "dist", None) == "loadgroup":
        xdist_groups.name_the_file()


def pytest_unconfigure(config):
    session_scope.leave_own_cgroup()
    if not _runs_tests(config):  # xdist's controller, once its workers are gone: their cgroups
        xdist_groups.remove_the_file()
        session_scope.sweep(wait=15)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        xdist_groups.longest_first(items)
        xdist_groups.write_groups(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`: the groups of tests/harness/xdist_groups.py (a cluster's tests in one
    worker, a module's together)."""
    if config.getvalue("dist") == "loadgroup":
        return xdist_groups.scheduler(config, log)
    return None


def running(*roles: str) -> list[psutil.Process]:
    """Every live process of this test session whose command line names one of `roles`, orphans
    included (`_own_processes`: the whole machine's, where sessions cannot be told apart)."""
    found = []
    for p in _own_processes(["cmdline", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if any(role in cmd for role in roles) and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def _own_processes(attrs: list[str]) -> Iterator[psutil.Process]:
    """This session's processes (those `session_scope.mine` is true of) with `attrs` in `.info`, as
    `psutil.process_iter` gives them: the pids its cgroups hold, or every process where the session
    owns the machine."""
    pids = session_scope.own_pids()
    if pids is None:
        yield from psutil.process_iter(attrs)
        return
    for pid in sorted(pids):
        try:
            p = psutil.Process(pid)
            p.info = p.as_dict(attrs)
        except psutil.NoSuchProcess:
            continue
        yield p


def gone(process: int | psutil.Process) -> bool:
    """The process has ended: no such process any more, or a zombie waiting for its parent."""
    try:
        p = process if isinstance(process, psutil.Process) else psutil.Process(process)
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def skytasks_processes() -> list[psutil.Process]:
    """Every node agent and rank process on this machine, orphans included."""
    return running(*ROLES)


def started_here(*roles: str) -> list[psutil.Process]:
    """Node agents and ranks (or those of `roles`) that this test process started and that still run."""
    mine = {p.pid for p in psutil.Process().children(recursive=True)}
    return [p for p in running(*(roles or ROLES)) if p.pid in mine]


def fork_servers() -> list[psutil.Process]:
    """Every local fork server on this machine (`skytasks.node.forkserver`), one per controller."""
    return running("skytasks.node.forkserver")


def orphaned_fork_servers(timeout: float = 10.0) -> list[psutil.Process]:
    """Fork servers whose controller has gone: each must leave with its controller."""
    deadline = time.monotonic() + timeout
    while True:
        orphans = []
        for p in fork_servers():
            try:
                cmd = p.info["cmdline"]
                if gone(int(cmd[cmd.index("--controller") + 1])):
                    orphans.append(p)
            except (psutil.AccessDenied, ValueError, IndexError):
                pass
        if not orphans or time.monotonic() > deadline:
            return orphans
        time.sleep(0.1)


def orphaned_test_sshd() -> list[psutil.Process]:
    """sshd processes started during this test session that no test server owns any more: a
    session whose listener is gone (its parent is then init, not sshd or this process)."""
    found = []
    for p in _own_processes(["name", "cmdline", "create_time", "ppid", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            is_sshd = (p.info["name"] or "").startswith("sshd") or cmd.startswith("sshd")
            if not is_sshd or p.info["create_time"] < SESSION_STARTED or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            # A listener's parent is a test process (python); a live session's is sshd. An
            # orphan's is init or a subreaper. (Another test session's servers are python's too.)
            owner = (psutil.Process(p.info["ppid"]).name() or "") if p.info["ppid"] > 1 else ""
            if not owner.startswith(("sshd", "python", "pytest")):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def wait_for_no_skytasks_processes(timeout: float = 10.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (left := skytasks_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture(scope="session", autouse=True)
def prefect_api(tmp_path_factory):
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield _keep_an_empty_database(tmp_path_factory.mktemp("prefect-db") / "prefect.db")


def _keep_an_empty_database(copy: Path) -> Path:
    """The harness's database as its server left it on start: migrated, with no run in it yet."""
    import sqlite3

    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL

    url = PREFECT_SERVER_DATABASE_CONNECTION_URL.value()
    source = sqlite3.connect(url.split(":///", 1)[1])
    target = sqlite3.connect(copy)
    try:
        source.backup(target)  # consistent even while the server runs
    finally:
        source.close()
        target.close()
    return copy


@pytest.fixture
def empty_prefect_database(prefect_api: Path) -> Path:
    """A copy of a migrated Prefect database with no run in it. Creating one, on a fresh Prefect
    home's first start, is Prefect's own work (about 20 s here); a test that starts Prefect's own
    server in a fresh home copies this there first."""
    return prefect_api


def assert_no_orphaned_sshd() -> None:
    deadline = time.monotonic() + 15  # a dropped client is given up within ClientAliveInterval x 3
    while (sshd := orphaned_test_sshd()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not sshd, f"leaked sshd sessions: {[(p.pid, p.info['cmdline']) for p in sshd]}"


@pytest.fixture(scope="session", autouse=True)
def no_sshd_left_at_the_end():
    """Module-scoped servers stop after the last test's own check: look once more at the end."""
    yield
    assert_no_orphaned_sshd()


@pytest.fixture(autouse=True)
def no_leaked_processes(request):
    yield
    if getattr(request.module, "POOLS_STAY_UP", False):
        return  # the module's `pools` stay up between its tests: checked once they are down
    left = wait_for_no_skytasks_processes()
    assert not left, f"leaked skytasks processes: {[(p.pid, p.info['cmdline']) for p in left]}"
    servers = orphaned_fork_servers()
    assert not servers, f"fork servers left behind by their controllers: {[(p.pid, p.info['cmdline']) for p in servers]}"
    assert_no_orphaned_sshd()


# -- the fleets' servers, shared by every module that uses them -------------------------------


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """A real OpenSSH server on two loopback addresses (two "machines", LOOPBACK_HOSTS), one per
    test module: a module may change its keys or its sessions without touching another's.
    `tests.harness.ssh_pools.ssh_pool(sshd)` is a pool on it."""
    from tests.harness.ssh_pools import LOOPBACK_HOSTS
    from tests.harness.sshd import SSHServer, free_port

    server = SSHServer(tmp_path_factory.mktemp("sshd"), list(LOOPBACK_HOSTS), free_port())
    yield server
    server.stop()


@pytest.fixture
def slurm_queue_empty_after(request):
    """For modules that mark themselves with it (`pytestmark = pytest.mark.usefixtures(...)`):
    after each test that used the SLURM cluster, its queue empties within 30 s (a job left behind
    is cancelled, and the test fails naming it)."""
    yield
    if "cluster" in request.fixturenames:
        c = request.getfixturevalue("cluster")
        left = c.wait_queue_empty(timeout=30)
        if left:
            c.run("scancel", "-u", "root", check=False)
        assert not left, f"jobs left in the queue: {left}"


@pytest.fixture
def k8s(k8s_cluster):
    """The session's Kubernetes test cluster, and after the test nothing skytasks made left in its
    default namespace (pods, owner config maps: `kube.held`) within 60 s."""
    from tests.harness.kube import held

    yield k8s_cluster
    deadline = time.monotonic() + 60
    while (left := held(k8s_cluster)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], f"left in the cluster: {left}"


@pytest.fixture(scope="module")
def pools():
    """Two local pools up for the whole module, `four` (2 nodes x 2) and `two` (1 x 2), so ranks
    start once per pool; for modules that set POOLS_STAY_UP, whose leak check runs here, when
    the pools are down, instead of after each test."""
    import contextlib

    from skytasks import GPUPool

    four, two = GPUPool(nodes=2, procs_per_node=2), GPUPool(nodes=1, procs_per_node=2)
    with contextlib.ExitStack() as stack:
        stack.enter_context(four)
        stack.enter_context(two)
        yield {"four": four, "two": two}
    left = wait_for_no_skytasks_processes()
    assert not left, f"leaked skytasks processes: {[p.pid for p in left]}"


@pytest.fixture
def pool_name():
    """A fresh name to save a pool under; whatever is left of the pool is ended after the test
    (`skytasks pools down`)."""
    import uuid

    from tests.harness.warm import pools_down

    name = f"warm-{uuid.uuid4().hex[:8]}"
    yield name
    pools_down(name)


@pytest.fixture(scope="module")
def login_node(cluster, tmp_path_factory):
    """A real sshd on loopback playing the SLURM cluster's login node (SLURM's commands run in its
    sessions, SLURM_CONF set), one per module."""
    from tests.harness.sshd import SSHServer, free_port

    server = SSHServer(tmp_path_factory.mktemp("login"), ["127.0.0.1"], free_port(),
                       set_env={"SLURM_CONF": str(cluster.conf)})
    yield server
    server.stop()


@pytest.fixture(scope="session")
def moto():
    """moto's EC2 server on loopback, with a loopback VPC and subnet: one for the session."""
    from moto.server import ThreadedMotoServer
    from prefect_aws import AwsCredentials
    from prefect_aws.client_parameters import AwsClientParameters

    os.environ["MOTO_EC2_ENABLE_INSTANCE_TYPE_VALIDATION"] = "true"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    creds = AwsCredentials(aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1",
                           aws_client_parameters=AwsClientParameters(endpoint_url=endpoint))
    ec2 = creds.get_client("ec2")
    # A loopback subnet of the session's own: an instance's sshd listens on its private address,
    # and two xdist workers' moto servers would otherwise hand out the same ones.
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    block = f"127.{100 + int(worker[2:]) if worker.startswith('gw') else 0}"
    vpc = ec2.create_vpc(CidrBlock=f"{block}.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock=f"{block}.0.0/24")["Subnet"]["SubnetId"]
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    yield {"endpoint": endpoint, "creds": creds, "ec2": ec2, "subnet": subnet, "vpc": vpc, "image": image,
           "vpc_prefix": block, "addresses": f"{block}.0."}
    server.stop()


def moto_bucket(moto: dict, name: str) -> dict:
    """A new S3 bucket on the session's moto server (one server answers for every AWS service):
    a client for it, and the credentials a pool reaches it with."""
    client = moto["creds"].get_client("s3")
    client.create_bucket(Bucket=name)
    return {"client": client, "creds": moto["creds"]}


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """The SLURM test cluster (three namespaced nodes): one for the session."""
    from tests.harness.slurm_cluster import SlurmCluster, available

    why = available()
    if why:
        pytest.skip(why)
    session_scope.exclusive("slurm")  # its subnet, bridge and ports are fixed: one session's at a time
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=3, gpus_per_node=2)
    # A partition that admits one account: an allocation for any other can never start.
    c.extra_partitions = ["PartitionName=proj Nodes=n0,n1 AllowAccounts=proj42 State=UP"]
    old = os.environ.get("SLURM_CONF")
    c.start()
    os.environ["SLURM_CONF"] = str(c.conf)
    try:
        yield c
    finally:
        c.stop()
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


@pytest.fixture(scope="session")
def k8s_cluster(tmp_path_factory):
    """The Kubernetes test cluster (v1.20.2: control plane on loopback, two nodes in namespaces
    of their own, `k8s_cluster.nodes`): one for the session. Skips only where it cannot run at
    all (not root; `make system-deps` installs and builds the rest). A test that kills a node
    (`kill_node`) restarts it (`restart_node`) before it ends. SKYTASKS_TEST_K8S_NODES=1 starts
    one node instead (to tell whether a failure comes from pods spread over two)."""
    from tests.harness.k8s import K8sCluster, available

    why = available()
    if why:
        pytest.skip(why)
    session_scope.exclusive("k8s")  # its subnets, ports and mounts are fixed: one session's at a time
    nodes = int(os.environ.get("SKYTASKS_TEST_K8S_NODES", "2"))
    c = K8sCluster(tmp_path_factory.mktemp("k8s"), nodes=nodes).start()
    try:
        yield c
    finally:
        c.stop()
