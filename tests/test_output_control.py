"""Output control happens on the rank: suppressed lines never leave it."""

from __future__ import annotations

import logging

import pytest

from skytasks import GPUPool, distributed_task, rank_info, silent, stderr, stdout


def speak() -> int:
    import sys

    r = rank_info().rank
    print(f"out-from-{r}")
    print(f"err-from-{r}", file=sys.stderr)
    logging.getLogger("user.code").warning("log-from-%s", r)
    return r


def run_and_capture(fn, capsys) -> tuple[str, str]:
    with GPUPool(nodes=3) as pool:
        assert distributed_task(fn, pool=pool, init_torch=False)() == [0, 1, 2]
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_every_rank_speaks_by_default_with_a_rank_prefix(capsys):
    out, err = run_and_capture(speak, capsys)
    for r in range(3):
        assert f"[rank {r}] out-from-{r}" in out
        assert f"[rank {r}] err-from-{r}" in err
        assert f"log-from-{r}" in err


@pytest.mark.parametrize(
    "only, expected",
    [("head", {0}), (2, {2}), ({0, 2}, {0, 2}), (lambda info: info.rank % 2 == 1, {1})],
    ids=["head", "one-rank", "collection", "predicate"],
)
def test_stdout_only_selected_ranks(capsys, only, expected):
    out, err = run_and_capture(stdout(only=only)(speak), capsys)
    assert {r for r in range(3) if f"out-from-{r}" in out} == expected
    assert all(f"err-from-{r}" in err for r in range(3))  # stderr untouched


def test_stderr_only_head(capsys):
    out, err = run_and_capture(stderr(only="head")(speak), capsys)
    assert {r for r in range(3) if f"err-from-{r}" in err} == {0}
    assert all(f"out-from-{r}" in out for r in range(3))


def test_silent_ranks_print_nothing(capsys):
    out, err = run_and_capture(silent(speak), capsys)
    assert "out-from" not in out and "err-from" not in err


def test_c_level_output_is_muted_too(capsys):
    def c_level() -> int:
        import os

        os.write(1, f"fd-write-{rank_info().rank}\n".encode())
        return rank_info().rank

    out, _ = run_and_capture(stdout(only="head")(c_level), capsys)
    assert "fd-write-0" in out and "fd-write-1" not in out and "fd-write-2" not in out


def c_burst() -> int:
    import os

    r = rank_info().rank
    os.write(1, "".join(f"burst-{r}-{i}\n" for i in range(2000)).encode())
    return r


def test_what_c_code_writes_before_return_is_printed_before_the_call_returns(capsys):
    """C code's fd 1 and the rank's result travel on two streams to the agent; every line written
    before `return` is printed by the time the call returns."""
    with GPUPool(nodes=2) as pool:
        task = distributed_task(c_burst, pool=pool, init_torch=False)
        for _ in range(3):
            assert task() == [0, 1]
            out = capsys.readouterr().out  # at once: nothing after the call may be waited for
            for r in (0, 1):
                assert sum(f"] burst-{r}-" in line for line in out.splitlines()) == 2000, r


def test_a_bad_selector_is_refused_at_decoration():
    with pytest.raises(TypeError, match="only="):
        stdout(only="heads")


# -- output at scale: the controller's backlog of lines is bounded, and what it drops is counted --


def test_lines_past_the_backlog_are_dropped_counted_per_rank_and_other_messages_always_pass():
    from skytasks.controller.backlog import NodeEvents
    from skytasks.protocol import Op

    events = NodeEvents(limit=3)
    for i in range(5):
        events.put((0, {"op": Op.OUTPUT, "rank": 1, "stream": "stdout", "line": f"a{i}"}))
    events.put((0, {"op": Op.LOG, "rank": 0, "level": 20, "line": "b"}))
    events.put((0, {"op": Op.RESULT, "rank": 1, "call": 1}))  # never dropped, however full
    kept = [events.get_nowait()[1] for _ in range(4)]
    assert [m.get("line") for m in kept] == ["a0", "a1", "a2", None] and kept[-1]["op"] == Op.RESULT
    assert events.take_dropped() == ((1, 2), (0, 1))  # most first
    assert events.take_dropped() == ()  # counted once


def chatter(lines: int) -> int:
    for i in range(lines):
        print(f"line {i}")
    return rank_info().rank


def test_a_flood_of_output_never_stalls_the_ranks_and_every_line_is_printed_or_counted(capsys, monkeypatch):
    monkeypatch.setenv("SKYTASKS_LINE_BACKLOG", "20")  # a record far slower than the ranks
    lines = 20_000
    with GPUPool(nodes=2) as pool:
        assert distributed_task(chatter, pool=pool, init_torch=False)(lines) == [0, 1]
    captured = capsys.readouterr()
    printed = {r: captured.out.count(f"[rank {r}] line ") for r in (0, 1)}
    notes = [line for line in captured.err.splitlines() if "output lines dropped" in line]
    assert notes, captured.err[-2000:]
    dropped = {0: 0, 1: 0}
    for note in notes:  # "[skytasks] 12,800 output lines dropped: ... (rank 1: 7,000; rank 0: 5,800); ..."
        for part in note.split("(", 1)[1].split(")", 1)[0].split("; "):
            rank, count = part.removeprefix("rank ").split(": ")
            dropped[int(rank)] += int(count.replace(",", ""))
    assert sum(dropped.values()) > 0
    assert {r: printed[r] + dropped[r] for r in (0, 1)} == {0: lines, 1: lines}  # nothing lost silently
    assert "SKYTASKS_LINE_BACKLOG" in notes[0]


def test_the_agent_drains_what_a_ranks_pipe_holds_and_no_more():
    """Before a rank's frames go on, the agent takes what its stdout pipe holds at that moment;
    what the rank writes after that is left for the agent's reader, in its turn, so a rank that
    never stops writing cannot hold the agent's one reader thread."""
    import os

    from skytasks.node.rank_process import _LineSplitter

    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    heard: list[str] = []

    class Rank:
        def relay_line(self, raw: bytes, name: str) -> None:
            heard.append(raw.decode())
            os.write(write_end, b"later\n")  # the rank goes on writing while the agent drains

        def stream_ended(self, why: str) -> None:
            pass

    with os.fdopen(read_end, "rb") as stream:
        lines = _LineSplitter(Rank(), "stdout", stream)
        os.write(write_end, b"one\ntwo\nthree\n")
        lines.drain()
        assert heard == ["one", "two", "three"]
        lines.end("the test is over")
    os.close(write_end)
