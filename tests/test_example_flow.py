"""The example DDP training flow trains for real: the loss falls and the head checkpoints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from flows.ddp_train import ddp_train, summarize

ROOT = Path(__file__).resolve().parent.parent


def test_example_flow_loss_falls_and_head_saves_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = ddp_train(epochs=3, samples=384)
    assert [r["rank"] for r in results] == [0, 1]
    assert {r["device"] for r in results} == {"cpu"}  # no GPU here: the same code trains on the CPU
    losses = results[0]["epoch_losses"]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.3, losses
    assert results[1]["epoch_losses"] == losses  # all_reduce: every rank reports the global mean
    assert results[0]["param_checksum"] == results[1]["param_checksum"]  # DDP kept replicas equal
    assert results[0]["steps"] == results[1]["steps"] > 0
    ckpt = Path(results[0]["checkpoint"])
    assert ckpt.parent == tmp_path / "checkpoints" and results[1]["checkpoint"] is None
    saved = torch.load(ckpt)
    assert saved["epoch_losses"] == losses and "tok.weight" in saved["model"]
    assert "rank" in summarize(results)


def test_example_flow_on_one_node_trains_on_this_machines_device(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = ddp_train(epochs=2, nodes=1, samples=256)
    assert [r["rank"] for r in results] == [0]
    assert results[0]["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")
    losses = results[0]["epoch_losses"]
    assert losses[-1] < losses[0]


def test_example_flow_resumes_a_failed_attempt_from_its_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = ddp_train(epochs=3, nodes=2, samples=256, fail_once_at_epoch=2)
    assert [(r["attempt"], r["first_epoch"]) for r in results] == [(2, 3), (2, 3)]  # epochs 1-2 not redone
    losses = results[0]["epoch_losses"]
    assert len(losses) == 3 and losses[-1] < losses[0]  # the whole history, across both attempts
    assert results[0]["steps"] < results[0]["samples"]  # only the last epoch ran on attempt 2


def test_example_flow_runs_as_a_script():
    """`python flows/ddp_train.py` works from a clone: embedded Prefect, readable summary."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "flows" / "ddp_train.py")],
        capture_output=True, text=True, timeout=400, cwd=ROOT,
        env={**__import__("os").environ, "SKYTASKS_EXAMPLE_EPOCHS": "2", "SKYTASKS_EXAMPLE_SAMPLES": "256"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert output.count("per-rank summary") == 1  # the table once, not twice
    assert output.count("→") == 4  # the header and a row per rank, once, and the closing line
    assert "skytasks ddp_train: 2 rank(s), loss" in proc.stdout
