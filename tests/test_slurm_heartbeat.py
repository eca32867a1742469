"""A SLURM pool's heartbeat is the pool's own (issue 58): it lives in a per-job folder of this
user's made 0700 on each node's /tmp, and the batch script that holds the allocation reads only
such folders. Another user on the node (a real other uid, made here with useradd and run with
setpriv) can neither end the allocation (a heartbeat with mtime 1) nor keep it alive (a fresh one).
"""

from __future__ import annotations

import glob
import os
import pwd
import stat
import subprocess
import time
import uuid

import pytest

from skytasks import distributed_task
from skytasks.node import heartbeat_file
from skytasks.providers.slurm import job as slurm_job
from tests.test_slurm_provider import slurm_pool

# After each test that used the SLURM cluster, its queue is empty (conftest).
pytestmark = pytest.mark.usefixtures("slurm_queue_empty_after")

INTRUDER = "skytasks-intruder"


@pytest.fixture(scope="module")
def intruder():
    """Another user of this machine: (uid, gid)."""
    if os.geteuid() != 0:
        pytest.skip("making another user needs root")
    made = False
    try:
        pwd.getpwnam(INTRUDER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", INTRUDER],
                       check=True, capture_output=True)
        made = True
    entry = pwd.getpwnam(INTRUDER)
    yield entry.pw_uid, entry.pw_gid
    if made:
        subprocess.run(["userdel", INTRUDER], check=False, capture_output=True)


def as_intruder(intruder, command: str) -> subprocess.CompletedProcess:
    uid, gid = intruder
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "sh", "-c", command],
                          capture_output=True, text=True, timeout=30)


def _remove(paths: list[str]) -> None:
    for p in paths:
        subprocess.run(["rm", "-rf", "--", p], check=False)


def test_the_agent_writes_its_heartbeat_through_no_link_and_into_no_strangers_file(tmp_path, intruder):
    target = tmp_path / "someone-elses-file"
    target.write_text("theirs")
    os.utime(target, (1000, 1000))
    link = tmp_path / "beat-link"
    link.symlink_to(target)
    assert not heartbeat_file.touch(str(link), "123\n")
    assert target.read_text() == "theirs" and target.stat().st_mtime == 1000
    theirs = tmp_path / "theirs"
    theirs.write_text("x")
    os.chown(theirs, *intruder)
    assert not heartbeat_file.touch(str(theirs), mtime=1)
    assert theirs.stat().st_mtime != 1
    mine = tmp_path / "beat"
    assert heartbeat_file.touch(str(mine), "123\n") and mine.read_text() == "123\n"
    assert heartbeat_file.touch(str(mine), mtime=1) and mine.stat().st_mtime == 1


def _batch_script(job: str) -> subprocess.Popen:
    """The batch script as sbatch runs it, with an idle limit of 2 s (checked every second)."""
    return subprocess.Popen(["bash", "-c", slurm_job.batch_script(2 / 60)], env={**os.environ, "SLURM_JOB_ID": job},
                            stderr=subprocess.PIPE, text=True)


def _strangers_folder(intruder, prefix: str, name: str, mtime: str) -> str:
    folder = prefix + name
    done = as_intruder(intruder, f"mkdir -m 0700 {folder} && touch -d {mtime} {folder}/beat")
    assert done.returncode == 0, done.stderr
    return folder


def test_the_batch_script_reads_only_this_users_0700_folders(intruder):
    job = f"test{uuid.uuid4().hex[:8]}"
    prefix = slurm_job.heartbeat_folders(job)
    made = []
    try:
        # a stranger's "end it now" (mtime 1), in a folder of theirs and through a link to it: unheard
        made.append(_strangers_folder(intruder, prefix, "end", "@1"))
        os.symlink(made[0], prefix + "link")
        made.append(prefix + "link")
        # a stranger's "keep it alive": a heartbeat kept fresh; also unheard
        keep = _strangers_folder(intruder, prefix, "keep", "now")
        made.append(keep)
        started = time.monotonic()
        script = _batch_script(job)
        while script.poll() is None and time.monotonic() - started < 20:
            as_intruder(intruder, f"touch {keep}/beat")
            time.sleep(0.5)
        _, said = script.communicate(timeout=10)
        took = time.monotonic() - started
        assert "the controller was silent" in said, said  # ended for idleness ...
        assert 2 <= took < 8, took  # ... at its idle limit: neither at once nor kept alive
        assert os.path.isdir(made[0]) and os.path.isdir(keep)  # the script removes only folders of its own

        # this user's own folder, as the bootstrap makes it: its mtime 1 does end the allocation at once
        own = prefix + "own"
        os.mkdir(own, 0o700)
        (open(own + "/beat", "w")).close()
        os.utime(own + "/beat", (1, 1))
        started = time.monotonic()
        _, said = _batch_script(job).communicate(timeout=20)
        assert "nobody held the warm pool" in said and time.monotonic() - started < 2, said
        assert not os.path.exists(own)  # removed on its way out
    finally:
        _remove(made + glob.glob(prefix + "*"))


def job_id() -> str:
    return os.environ["SLURM_JOB_ID"]


def test_another_uid_cannot_touch_a_slurm_pools_heartbeat(cluster, intruder):
    pool = slurm_pool(nodes=1, procs_per_node=1, idle_minutes=0.1)  # the batch script looks every 1.5 s
    task = distributed_task(job_id, pool=pool, init_torch=False)
    strangers: list[str] = []
    with pool:
        [job] = task()
        prefix = slurm_job.heartbeat_folders(job)
        folders = [f for f in glob.glob(prefix + "*") if os.lstat(f).st_uid == os.getuid()]
        assert len(folders) == 1, folders  # the nodes share this machine's /tmp: one folder for the job
        [folder] = folders
        st = os.lstat(folder)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        beat = os.path.join(folder, "beat")
        deadline = time.monotonic() + 15  # the agent touches it within a second or so of hearing the controller
        while not os.path.isfile(beat) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert os.path.isfile(beat) and os.stat(beat).st_mtime > time.time() - 30
        try:
            for attempt in (f"touch -d @1 {beat}", f"touch {beat}", f"rm -f {beat}", f"ln -s /dev/null {folder}/x",
                            f"ls {folder}"):
                done = as_intruder(intruder, attempt)
                assert done.returncode != 0 and "Permission denied" in done.stderr, (attempt, done)
            strangers.append(_strangers_folder(intruder, prefix, "end", "@1"))
            time.sleep(5)  # three of the batch script's looks
            assert cluster.run("squeue", "-h", "-j", job, "-o", "%T").stdout.strip() == "RUNNING"
            assert os.stat(beat).st_mtime != 1
            assert task() == [job]  # the same allocation serves on
        finally:
            _remove(strangers)
    cluster.wait_queue_empty_of(job)
