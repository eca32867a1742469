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


def test_a_bad_selector_is_refused_at_decoration():
    with pytest.raises(TypeError, match="only="):
        stdout(only="heads")
