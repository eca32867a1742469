"""The test harness: real servers and clusters the tests, `benchmarks/` and `scripts/` start.

- `sshd`: a real OpenSSH server (`SSHServer`, `free_port`, `keygen`).
- `netns`: hosts in network namespaces, each with its own sshd.
- `ssh_pools`: `GPUPool(provider="ssh")` as a user writes it for an `SSHServer`.
- `slurm_cluster`: a real SLURM cluster (`SlurmCluster`).
- `k8s`: a real Kubernetes v1.20.2 (`K8sCluster`), `kube`: pools on it as a user makes them,
  `autoscaler_standin`: what Cluster Autoscaler or Karpenter says on a pending pod.
- `prefect_api`: a flow run's task runs and logs read back from the API.
- `workloads`: the training code the tests and the benchmarks both run.
- `warm`: a controller process's environment and `pools down`, for the warm pool tests.
- `slow_cpu`: a slow node or a small machine, made for real with a cgroup v1 cpu quota.
- `processes.end`: SIGTERM, then SIGKILL after a grace; `processes.stop_with_session`.
- `conformance*`: each provider's `Fleet` for the conformance contracts
  (tests/test_provider_conformance*.py): how to start, break and look at its nodes.
- `session_scope`: what one of several test sessions on the machine owns (its own pids cgroup;
  a cluster held by one session at a time); `xdist_groups`: which tests share an xdist worker.

Fixtures stay in tests/conftest.py (`sshd`, `login_node`, `cluster`, `k8s_cluster`, `k8s`,
`moto`, `pool_name`, `pools`); what they start is here.

Importable as `tests.harness` from the repository root (pytest's conftest puts the root on
`sys.path`; `python -m benchmarks.run` and `python -m scripts.x` run from there), so nothing
here edits `sys.path`.
"""
