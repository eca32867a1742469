"""The test harness: real servers and clusters the tests, `benchmarks/` and `scripts/` start.

- `sshd`: a real OpenSSH server (`SSHServer`, `free_port`, `keygen`).
- `netns`: hosts in network namespaces, each with its own sshd.
- `ssh_pools`: `GPUPool(provider="ssh")` as a user writes it for an `SSHServer`.
- `slurm_cluster`: a real SLURM cluster (`SlurmCluster`).
- `k8s`: a real Kubernetes v1.20.2 (`K8sCluster`), `kube`: pools on it as a user makes them,
  `autoscaler_standin`: what Cluster Autoscaler or Karpenter says on a pending pod.
- `prefect_api`: a flow run's task runs and logs read back from the API.
- `workloads`: the training code the tests and the benchmarks both run.

Importable as `tests.harness` from the repository root (pytest's conftest puts the root on
`sys.path`; `python -m benchmarks.run` and `python -m scripts.x` run from there), so nothing
here edits `sys.path`.
"""
