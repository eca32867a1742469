"""A kubernetes pool whose pods hold another Python than the controller's fails its start naming
k8s_image and both versions, before any rank, and leaves nothing in the cluster. On the real
test cluster (tests/harness/k8s/), its pods running this machine's Python 3.12."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest

from skytasks import PoolStartError
from tests.harness.kube import held, kube_pool

CONTROLLER = f"the controller runs Python {sys.version.split()[0]} with cloudpickle {cloudpickle.__version__}"


def test_a_pod_with_another_python_fails_the_start_naming_k8s_image_and_both_versions(k8s_cluster):
    found = sorted(glob.glob("/root/.pyenv/versions/3.12.*/bin/python3"))
    if not found:
        pytest.skip("no Python 3.12 under /root/.pyenv/versions here")
    python = found[-1]
    version = subprocess.run([python, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True,
                             text=True, check=True).stdout.strip()
    # The host template mounts the controller's Python; this one's prefix joins it, read-only.
    prefix = os.path.realpath(Path(python).parents[1])
    template = k8s_cluster.host_python_template()
    template["spec"]["volumes"].append({"name": "python-3-12", "hostPath": {"path": prefix, "type": "Directory"}})
    template["spec"]["containers"][0]["volumeMounts"].append(
        {"name": "python-3-12", "mountPath": prefix, "readOnly": True})
    started = time.monotonic()
    with pytest.raises(PoolStartError) as caught:
        with kube_pool(k8s_cluster, k8s_pod_template=template, remote_python=python):
            pass
    text = str(caught.value)
    assert re.match(rf"k8s_image: node \d \(pod [\w-]+\): {re.escape(CONTROLLER)}; node \d \(pod [\w-]+\) runs "
                    rf"Python {re.escape(version)} with no cloudpickle \(k8s_image={re.escape(repr(k8s_cluster.image))} "
                    rf"with remote_python={re.escape(repr(python))} ran {re.escape(python)}\): code travels as "
                    r"bytecode, which only the same Python minor version reads", text), text
    assert "set remote_python to such a Python in the image; no rank was started" in text, text
    assert time.monotonic() - started < 120
    deadline = time.monotonic() + 60
    while (left := held(k8s_cluster)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], f"left in the cluster: {left}"
