"""provider="kubernetes": one pod per node, made and deleted by the pool. `spec.py` (its fields and
spec), `provider.py` (pods up, agents started, lost pods replaced and re-attached, everything
deleted), `pods.py` (the manifests) and `gpu_types.py` (the GPU product a pod requires),
`pool_watch.py` (the pool's pods and their Events, watched; `api_retry.py`: which answers pass),
`pod_status.py` (a pod's status read, and when a pool may start), `pod_events.py` (what the Events
about a pod say: a node autoscaler's word), `pod_views.py` (the watch's pods read for the
provider), `cluster.py` (credentials and the API's refusals), `exec_stream.py` (a node's stream
through the API server), `node_agents.py` (the agent and commands in a pod), `teardown.py` and
`gc.py` (`skytasks gc --kubernetes`), `check.py` (`skytasks check`). The client is the `kubernetes`
extra: `pip install "skytasks[kubernetes]"`, imported when a kubernetes pool is made or loaded:
this `__init__` and `spec.py` import neither."""

from skytasks.providers import ProviderPlugin

# The credentials field's block type (spec.py's field names it lazily), imported on first use.
CREDENTIALS_BLOCK = "prefect_kubernetes.credentials:KubernetesCredentials"

PLUGIN = ProviderPlugin("kubernetes", "skytasks.providers.kubernetes.provider:KubernetesProvider",
                        settings="skytasks.providers.kubernetes.spec:KubernetesSettings",
                        credentials="kubernetes_credentials",
                        check="skytasks.providers.kubernetes.check:run",
                        gc="skytasks.providers.kubernetes.gc:command",
                        block_fields={"kubernetes_credentials": CREDENTIALS_BLOCK})
