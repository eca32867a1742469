"""Failure reports grouped by place: the logic at small sizes (the large ones are in the
benchmark). A failure at 1,024 ranks reads as a few lines, not a thousand stacks."""

from __future__ import annotations

import os
import sysconfig

import pytest

from skytasks.controller.stack_groups import group_by_place, stack_lines
from skytasks.stacks import rank_ranges


def stack(func: str, line: int) -> str:
    return ("Current thread 0x1 (most recent call first):\n"
            f'  File "/usr/lib/python3/site-packages/torch/distributed/c10d.py", line 9 in {func}\n'
            f'  File "/home/me/train.py", line {line} in train_loop\n'
            '  File "/x/skytasks/node/worker.py", line 1 in _run_call\n')


@pytest.mark.parametrize("ranks, text", [
    ([], ""), ([3], "3"), ([0, 1, 2], "0-2"), ([5, 0, 1, 2, 7, 8], "0-2, 5, 7-8"), ([1, 1, 2], "1-2"),
])
def test_rank_ranges_read_like_a_person_writes_them(ranks, text):
    assert rank_ranges(ranks) == text


def test_ranks_in_one_place_share_one_line_the_most_crowded_first():
    places = {r: "in `all_reduce`" for r in range(1024) if r != 17}
    places[17] = "in `train_loop`"
    assert group_by_place(places) == [("in `all_reduce`", [r for r in range(1024) if r != 17]),
                                      ("in `train_loop`", [17])]


def test_a_thousand_stopped_ranks_are_one_line_and_a_lone_rank_keeps_its_own():
    stacks = {r: stack("all_reduce", 42) for r in range(1024) if r != 17}
    stacks[5] = stack("barrier", 50)
    lines = stack_lines(stacks, "stopped because rank 17 failed")
    assert lines == [
        "[1,022 ranks] were in `all_reduce` (c10d.py:9), called from train.py:42 in `train_loop` "
        "(stopped because rank 17 failed): ranks 0-4, 6-16, 18-1023",
        "[rank 5] was in `barrier` (c10d.py:9), called from train.py:50 in `train_loop` "
        "(stopped because rank 17 failed)",
    ]


THREADING = os.path.join(os.path.realpath(sysconfig.get_paths()["stdlib"]), "threading.py")  # this Python's own
CONTROL_THREAD = ("Thread 0x2 (most recent call first):\n"
                  '  File "/x/skytasks/node/control_channel.py", line 61 in serve_control_channel\n'
                  '  File "/x/skytasks/node/worker.py", line 180 in _take_notices\n')


@pytest.mark.parametrize("main_thread, said", [
    ('  File "/x/skytasks/wire.py", line 120 in read_exact\n'
     '  File "/x/skytasks/wire.py", line 140 in read_frame\n'
     '  File "/x/skytasks/node/worker.py", line 255 in main\n', "waiting for the call"),
    ('  File "<frozen os>", line 1031 in fdopen\n'
     '  File "/x/skytasks/node/worker.py", line 215 in main\n'
     '  File "/x/skytasks/node/rank_template.py", line 270 in _become_rank\n', "starting up, in `main` (worker.py:215)"),
    (f'  File "{THREADING}", line 327 in wait\n'
     f'  File "{THREADING}", line 629 in wait\n'
     f'  File "{THREADING}", line 964 in start\n'
     '  File "/x/skytasks/node/worker.py", line 220 in main\n'
     '  File "/x/skytasks/node/rank_template.py", line 270 in _become_rank\n', "starting up, in `main` (worker.py:220)"),
    ('  File "/home/me/train.py", line 8 in train\n'
     '  File "/x/skytasks/node/worker.py", line 129 in _run_call\n'
     '  File "/x/skytasks/node/worker.py", line 260 in main\n', "in `train` (train.py:8)"),
], ids=["before its call arrived", "still starting", "starting a thread", "in the user's code"])
def test_a_rank_is_named_by_its_main_thread_not_by_a_helper_thread_listed_first(main_thread, said):
    from skytasks.stacks import where

    stack = CONTROL_THREAD + "\nCurrent thread 0x1 (most recent call first):\n" + main_thread
    assert where(stack) == said
    assert stack_lines({r: stack for r in range(3)}, "stopped because rank 7 failed") == [
        f"[3 ranks] were {said} (stopped because rank 7 failed): ranks 0-2"]
