"""The agent's holding clocks (node/holding.py), on a fake clock: who holds a warm node, when a
broken holder lets go, when an unheld node ends, and the order waiting processes are served in."""

from __future__ import annotations

from skytasks.node.holding import DETACHED, END, EXPIRE, EXPIRED, HELD, TICKET_SECONDS, UNHELD, UNHOLD, Holding


def leased(keep_warm: float = 60.0, window: float = 10.0, now: float = 100.0) -> Holding:
    h = Holding()
    h.lease("h1", "flow run 'a'", window, keep_warm, now)
    return h


def test_a_break_waits_its_window_then_a_warm_node_goes_unheld():
    h = leased()
    h.broke(110.0)
    assert h.state == DETACHED and not h.touches
    assert h.tick(119.9) == ""
    assert h.tick(120.0) == UNHOLD
    assert h.state == UNHELD and h.touches and h.holder == ""
    assert h.expires_in(130.0) == 50.0


def test_without_keep_warm_a_window_that_ends_is_the_controller_gone():
    h = leased(keep_warm=0.0)
    h.broke(110.0)
    assert h.tick(119.0) == ""
    assert h.tick(121.0) == END
    assert h.state == EXPIRED


def test_a_resume_within_the_window_keeps_the_holder():
    h = leased()
    h.broke(110.0)
    h.resumed(115.0)
    assert h.state == HELD and h.holder == "h1"
    assert h.tick(500.0) == ""  # a held node never expires


def test_an_unheld_node_expires_after_keep_warm_and_not_before():
    h = leased(keep_warm=30.0)
    h.released(200.0)
    assert h.state == UNHELD
    assert h.tick(229.0) == ""
    assert h.tick(230.0) == EXPIRE
    assert h.state == EXPIRED and not h.touches
    assert h.ask_hold("h2", "b", 231.0) is not None  # nobody takes an ending node


def test_release_with_keep_warm_zero_expires_at_the_next_tick():
    h = leased(keep_warm=0.0)
    h.released(200.0)
    assert h.tick(200.0) == EXPIRE


def test_a_hold_is_refused_naming_the_holder_while_held_or_detached():
    h = leased()
    assert h.ask_hold("h2", "flow run 'b'", 101.0) == ("flow run 'a'", 100.0)
    h.broke(102.0)
    assert h.ask_hold("h2", "flow run 'b'", 103.0) == ("flow run 'a'", 100.0)


def test_waiters_are_served_in_the_order_they_came():
    h = leased()
    assert h.ask_hold("hb", "b", 101.0) is not None
    assert h.ask_hold("hc", "c", 101.5) is not None
    h.released(102.0)
    refusal = h.ask_hold("hc", "c", 102.2)  # c asks first after the release, but b came first
    assert refusal == ("b (waiting in line before you)", 101.0)
    assert h.ask_hold("hb", "b", 102.4) is None
    assert h.state == HELD and h.holder == "hb" and h.who == "b" and h.held_since == 102.4
    assert h.ask_hold("hc", "c", 102.6) == ("b", 102.4)  # now held by b; c is next
    h.released(110.0)
    assert h.ask_hold("hc", "c", 110.1) is None


def test_a_waiter_that_stopped_asking_leaves_the_line():
    h = leased()
    h.ask_hold("hb", "b", 101.0)
    h.released(102.0)
    later = 101.0 + TICKET_SECONDS + 0.1
    assert h.ask_hold("hc", "c", later) is None  # b never came back


def test_a_lease_after_a_hold_keeps_when_the_holder_took_it_and_its_words():
    h = leased()
    h.released(102.0)
    assert h.ask_hold("hb", "flow run 'b'", 103.0) is None
    h.lease("hb", "", 10.0, 60.0, 103.5)
    assert (h.who, h.held_since) == ("flow run 'b'", 103.0)
    h.lease("hb", "flow run 'b', pid 7", 10.0, 60.0, 104.0)
    assert h.who == "flow run 'b', pid 7"


def test_a_lease_without_words_never_says_the_holders_id():
    h = Holding()
    h.lease("abc", "", 10.0, 60.0, 1.0)
    assert h.ask_hold("x", "x", 2.0) == ("another controller", 1.0)  # the id lets its owner resume: kept in


def test_describe_gives_epoch_times():
    h = leased(keep_warm=60.0)
    held = h.describe(105.0, 1_000_005.0)
    assert held == {"holding": HELD, "holder": "flow run 'a'", "held_since": 1_000_000.0}
    h.released(110.0)
    unheld = h.describe(120.0, 2_000_000.0)
    assert unheld["holding"] == UNHELD and unheld["holder"] == ""
    assert unheld["unheld_since"] == 1_999_990.0 and unheld["expires_at"] == 2_000_050.0


# -- the watchdogs read a heartbeat file's mtime of 1 as "end now" ------------------------------

def test_the_aws_watchdog_ends_a_node_whose_agent_set_mtime_1_at_once():
    from skytasks.providers.aws.watchdog import verdict

    assert verdict(1000.0, 900.0, 990.0, 600.0, None) is None  # heard 10 s ago: wanted
    assert "keep_warm" in (verdict(1000.0, 900.0, 1.0, 600.0, None) or "")


def test_the_slurm_batch_script_ends_the_allocation_when_the_beat_says_1(tmp_path):
    import os
    import subprocess
    import time

    from skytasks.providers.slurm.job import batch_script, heartbeat_folders

    job = f"holding{os.getpid()}"
    script = tmp_path / "batch.sh"
    script.write_text(batch_script(10.0))  # idle 10 minutes: only the mtime ends it
    proc = subprocess.Popen(["bash", str(script)], env={**os.environ, "SLURM_JOB_ID": job}, stderr=subprocess.PIPE,
                            text=True)
    folder = heartbeat_folders(job) + "own"  # the job's own 0700 folder, as the agent's bootstrap makes it
    os.mkdir(folder, 0o700)
    beat = f"{folder}/beat"
    try:
        time.sleep(0.5)
        assert proc.poll() is None
        with open(beat, "w"):
            pass
        os.utime(beat, (1, 1))
        _, said = proc.communicate(timeout=60)
    finally:
        proc.kill()
        if os.path.exists(beat):
            os.unlink(beat)
        if os.path.isdir(folder):
            os.rmdir(folder)
    assert proc.returncode == 0 and "keep_warm_minutes" in said
