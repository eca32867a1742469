"""How tests/data/gpu_pool_v1.json was made: pools saved by the flat GPUPool (the commit named in the
file, before the provider settings had models of their own) to a real Prefect API, and the
documents the API then held. Run with that commit's code first on the path:

    git worktree add /tmp/oldpool <commit>; ln -s ../blocks /tmp/oldpool/skytasks/blocks
    PYTHONPATH=/tmp/oldpool python tests/data/save_gpu_pool_v1.py OUT.json

(the `spec_repr` of each pool was added with that code too: repr(GPUPool(**kwargs).spec())).
Not a test: pytest does not collect it."""
import json
import subprocess
import sys
from prefect.testing.utilities import prefect_test_harness

KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nold-pool-key-material\n-----END OPENSSH PRIVATE KEY-----\n"
POOLS = {
    "local": dict(provider="local", nodes=3, procs_per_node=2, env={"OLD_TOKEN": "old-env-value-1"},
                  reattach_seconds=30, keep_warm_minutes=5),
    "ssh": dict(provider="ssh", nodes=2, hosts=["me@10.0.0.1:2222", "10.0.0.2"], ssh_user="me",
                ssh_private_key=KEY, known_hosts="10.0.0.1 ssh-ed25519 AAAA", remote_python="/opt/py/bin/python",
                pip_packages=["einops"], ready_timeout_seconds=120, env={"A": "1"}),
    "aws": dict(provider="aws", nodes=2, min_nodes=1, accelerator="A10G", instance_type="g5.xlarge",
                image_id="ami-123", subnet_id="subnet-1", security_group_ids=["sg-1"], key_name="mine",
                ssh_private_key=KEY, spot=True, root_volume_gb=200, tags={"team": "ml"},
                ssh_ingress_cidr="10.0.0.0/16", torch_version="2.5.1", idle_minutes=20, max_lifetime_minutes=600),
    "slurm": dict(provider="slurm", nodes=4, accelerator="H100", accelerators_per_node=8, procs_per_node=8,
                  slurm_partition="gpu", slurm_account="ml", slurm_qos="high", slurm_gres="gpu:h100:8",
                  slurm_extra_args=["--exclusive"], remote_python="python3.11", max_lifetime_minutes=240),
    "kubernetes": dict(provider="kubernetes", nodes=2, k8s_image="reg/train:1", k8s_namespace="ml",
                       k8s_node_selector={"pool": "gpu"}, k8s_tolerations=[{"key": "k", "operator": "Exists"}],
                       k8s_cpu="4", k8s_memory="16Gi", k8s_autoscaler="none", k8s_queue="q",
                       kubernetes_credentials={"cluster_config": {"config": {"clusters": []}, "context_name": "ctx"}}),
}

def main():
  with prefect_test_harness(server_startup_timeout=90):
        from prefect.client.orchestration import get_client
        from skytasks.blocks.gpu_pool import GPUPool
        out = {"saved_by": subprocess.run(["git", "-C", "/tmp/oldpool", "rev-parse", "HEAD"], capture_output=True,
                                          text=True).stdout.strip(), "pools": {}}
        for name, kwargs in POOLS.items():
            GPUPool(**kwargs).save(f"old-{name}")
            with get_client(sync_client=True) as client:
                doc = client.read_block_document_by_name(f"old-{name}", "gpu-pool", include_secrets=True)
            out["pools"][name] = {"kwargs": kwargs, "data": doc.data}
            out["schema"] = {"fields": doc.block_schema.fields, "checksum": doc.block_schema.checksum,
                             "version": doc.block_schema.version, "capabilities": doc.block_schema.capabilities}
        import prefect
        out["prefect"] = prefect.__version__
        json.dump(out, open(sys.argv[1], "w"), indent=1, sort_keys=True, default=str)
        print("saved", list(out["pools"]))

if __name__ == '__main__':
    main()
