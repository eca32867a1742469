"""`skytasks check` for a kubernetes pool: the questions its start would answer the hard way.

Asked without making anything: whether the API server answers with the pool's credentials, what
the pool's identity may do in its namespace (`SelfSubjectAccessReview`, one per verb the provider
uses: exactly those of `deployments/kubernetes/rbac.yaml`), whether the namespace, the service
account and the image pull Secrets exist, and whether enough nodes have the GPUs, CPU and memory
each pod asks for. What the identity may not read (nodes and Secrets are often not granted) is
skipped with the reason, never failed.
"""

from __future__ import annotations

from typing import Any, Iterator

from skytasks.pool_spec import PoolSpec
from skytasks.providers.checks import Check
from skytasks.providers.kubernetes import cluster, gpu_types, pods
from skytasks.providers.kubernetes.spec import KubernetesSettings

# Every (verb, resource, subresource) the provider uses in the pool's namespace.
NEEDED = (
    ("create", "configmaps", ""), ("get", "configmaps", ""), ("delete", "configmaps", ""), ("list", "configmaps", ""),
    ("patch", "configmaps", ""),  # get: a warm pool's next holder reads the owner back (adopt)
    ("create", "pods", ""), ("get", "pods", ""), ("list", "pods", ""), ("watch", "pods", ""), ("delete", "pods", ""),
    ("deletecollection", "pods", ""), ("create", "pods", "exec"), ("get", "pods", "exec"),
    ("list", "events", ""), ("watch", "events", ""), ("get", "serviceaccounts", ""),
)


def _may(auth: Any, namespace: str, verb: str, resource: str, subresource: str = "") -> tuple[bool, str]:
    from kubernetes import client

    review = client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec(
        resource_attributes=client.V1ResourceAttributes(namespace=namespace, verb=verb, resource=resource,
                                                        subresource=subresource or None)))
    status = auth.create_self_subject_access_review(review).status
    return bool(status.allowed), status.reason or ""


def _quantity(text: Any) -> float:
    from kubernetes.utils import parse_quantity

    return float(parse_quantity(str(text)))


def run(spec: PoolSpec) -> Iterator[Check]:
    from kubernetes import client

    k8s = spec.own(KubernetesSettings)
    ns = k8s.k8s_namespace
    try:
        cfg = cluster.configuration(spec.credentials)
        api = cluster.api_client(cfg)
        version = client.VersionApi(api).get_code(_request_timeout=15)
    except Exception as exc:  # noqa: BLE001 - the verdict is the check
        yield Check("the API server answers with the pool's credentials", False, cluster.api_message(exc)[:400])
        return
    yield Check("the API server answers with the pool's credentials", True, f"{cfg.host}, Kubernetes {version.git_version}")
    auth, core = client.AuthorizationV1Api(api), client.CoreV1Api(api)
    missing = []
    for verb, resource, sub in NEEDED:
        allowed, _ = _may(auth, ns, verb, resource, sub)
        if not allowed:
            missing.append(f"{verb} {resource}{'/' + sub if sub else ''}")
    yield Check(f"may do what a pool does in namespace {ns!r}", not missing,
                f"missing: {', '.join(missing)} ({cluster.RBAC_FILE} grants them)" if missing else
                f"{len(NEEDED)} permissions")
    yield from _exists(core, ns, k8s)
    yield _capacity(core, spec, k8s)


def _exists(core: Any, ns: str, k8s: KubernetesSettings) -> Iterator[Check]:
    for kind, name, read in (("namespace", ns, lambda: core.read_namespaced_service_account("default", ns)),
                             *((("service account", k8s.k8s_service_account,
                                 lambda: core.read_namespaced_service_account(k8s.k8s_service_account, ns)),)
                               if k8s.k8s_service_account else ()),
                             *(("image pull Secret", s, lambda s=s: core.read_namespaced_secret(s, ns))
                               for s in k8s.k8s_image_pull_secrets)):
        try:
            read()
            yield Check(f"{kind} {name!r} exists", True)
        except Exception as exc:  # noqa: BLE001
            status = getattr(exc, "status", None)
            if status == 404:
                yield Check(f"{kind} {name!r} exists", False, "not found" + (f" in namespace {ns!r}" if kind != "namespace"
                                                                           else ""))
            else:
                yield Check(f"{kind} {name!r} exists", None, f"cannot ask: {cluster.api_message(exc)[:200]}")


def _capacity(core: Any, spec: PoolSpec, k8s: KubernetesSettings) -> Check:
    want = f"{spec.fewest} node(s) with room for a pod"
    try:
        nodes = core.list_node(_request_timeout=30).items
    except Exception as exc:  # noqa: BLE001 - nodes are cluster-wide: a pool need not read them
        return Check(want, None, f"cannot read nodes: {cluster.api_message(exc)[:200]}")
    # The same node affinity the pods get: the product's known values and those seen on these nodes.
    terms = gpu_types.node_terms(spec.accelerator, [n.metadata.labels or {} for n in nodes], k8s.k8s_gpu_label) \
        if spec.accelerator else None
    asks = {"cpu": k8s.k8s_cpu, "memory": k8s.k8s_memory, pods.GPU_RESOURCE: k8s.gpus_for(spec) or None}
    fit = []
    for n in nodes:
        labels = n.metadata.labels or {}
        if any(labels.get(k) != v for k, v in k8s.k8s_node_selector.items()):
            continue
        if terms is not None and not gpu_types.node_matches(terms, labels):
            continue
        room = n.status.allocatable or {}
        if all(v is None or _quantity(room.get(k, 0)) >= _quantity(v) for k, v in asks.items()):
            fit.append(n.metadata.name)
    asked = ", ".join(f"{k}={v}" for k, v in asks.items() if v) or "no resources"
    product = f" and carry a label naming {spec.accelerator!r}" if terms is not None else ""
    return Check(want, len(fit) >= spec.fewest,
                 f"{len(fit)} of {len(nodes)} nodes match the selector{product} and can hold {asked} "
                 f"(allocatable, before other pods){': ' + ', '.join(fit[:8]) if fit else ''}")
