"""Re-attach on SLURM, what only its transport has (issue 52): what every provider that re-attaches
promises (its way in reaches a door, NodeGone for a missing door or an ended node, a call goes
on whole through a broken stream) is the conformance suite's, tests/test_provider_conformance_reattach.py.
Here: letting go of a node's stream while its srun still runs (what the controller does with a
stream it found broken) never signals that srun, whose shepherd would cancel the agent's step.
"""

from __future__ import annotations

import sys
import time

import psutil

from skytasks import GPUPool
from skytasks.protocol import Op
from skytasks.providers.registry import provider_for
from skytasks.wire import read_frame
from tests.harness.conformance_doors import StandInDoor, lease, round_trip


def slurm_agents(job_id: str) -> list:
    """The node agents running in a job's steps (on the SLURM test cluster's nodes, this machine)."""
    found = []
    for p in psutil.process_iter(["cmdline", "name"]):
        try:
            if ("skytasks.node.agent" in " ".join(p.info["cmdline"] or []) and p.info["name"] != "srun"
                    and p.environ().get("SLURM_JOB_ID") == job_id):
                found.append(p)
        except psutil.Error:
            pass
    return found


def alive(p) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_slurm_letting_a_stream_go_never_ends_the_agent_s_own_step_and_a_step_beside_it_reaches_the_door(cluster):
    provider = provider_for(GPUPool(provider="slurm", nodes=2, remote_python=sys.executable,
                                    ready_timeout_seconds=60).spec())
    links = provider.start()
    door = StandInDoor()
    try:
        assert [read_frame(link.inbound)["op"] for link in links] == [Op.HELLO] * 2
        name = provider.nodes[1].name
        agents = slurm_agents(provider.nodes[1].job_id)
        assert len(agents) == 2
        agent_step = provider._steps._agents[name]
        lease(links[1])  # from now on the agent outlives a break of its stream
        link = provider.reattach(1, door.path, timeout=30)
        # What the controller does with a broken stream, at once: let it go. The agent's own srun
        # is not signalled (its shepherd would cancel the agent's step): srun and agent live on.
        links[1].let_go_lost()
        time.sleep(3)
        assert agent_step.exit_code() is None and all(alive(a) for a in agents)
        assert provider._steps._agents[name] is agent_step and provider._steps._steps[name] is not agent_step
        round_trip(link)
        link.close()
    finally:
        door.close()
        provider.stop()
