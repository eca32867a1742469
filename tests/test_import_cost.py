"""A provider costs nothing until it is used: with every extra installed (this venv), `skytasks
run` on a local pool imports no provider's client, SDK or Prefect integration, and counts few
modules before its ranks start; a kubernetes pool made or loaded imports its client, and a saved
one still refers to its saved KubernetesCredentials block. Each count is taken in a fresh
interpreter: this one has imported everything by now."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

# Top-level packages no local pool needs: the kubernetes provider's (prefect-kubernetes brings its
# worker, kopf and both clients), aws's, ssh's, and the block's own prefect-aws (not on the path).
FOREIGN = ("kubernetes", "kubernetes_asyncio", "prefect_kubernetes", "kopf", "boto3", "botocore", "asyncssh",
           "prefect_aws")
KUBERNETES = ("kubernetes", "kubernetes_asyncio", "prefect_kubernetes", "kopf")
# Measured 2026-11-27 (a Prefect server configured, as here): 345 modules imported on the command's
# own thread before the pool's first process starts, and 1,340 in the whole command with its Prefect
# record; 2,681 and 2,775 while the registry imported prefect-kubernetes (over 1,200 modules alone;
# prefect-aws with boto3 is about 520). Headroom for Prefect's and pydantic's own releases.
BEFORE_RANKS_BOUND = 500
WHOLE_COMMAND_BOUND = 1800

# `skytasks run`, unchanged, in this interpreter; an audit hook notes each module the command's
# thread imports until the pool's first process (the fork server, or an agent) is started, then
# what the whole process had imported when the command ended.
PROBE = textwrap.dedent("""
    import json, sys, threading
    main_thread, seen = threading.main_thread(), {"before": [], "started": False}

    def hook(event, args):
        if seen["started"] or threading.current_thread() is not main_thread:
            return
        if event == "import":
            seen["before"].append(args[0])
        elif event == "subprocess.Popen" and any("skytasks.node." in str(a) for a in (args[1] or ())):
            seen["started"] = True

    sys.addaudithook(hook)
    from skytasks.cli import main
    code = main(sys.argv[1:])
    print("IMPORTS " + json.dumps({"code": code, "started": seen["started"], "before": seen["before"],
                                   "whole": sorted(sys.modules)}), flush=True)
""")


def _env() -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}


def _python(code: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def _tagged(out: str, tag: str) -> Any:
    (line,) = [line for line in out.splitlines() if line.startswith(tag + " ")]
    return json.loads(line.removeprefix(tag + " "))


def _of(modules: list[str], packages: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in packages)


def test_skytasks_run_on_a_local_pool_imports_no_providers_client(tmp_path):
    (tmp_path / "tiny.py").write_text("import os\nprint('hello from', os.environ['RANK'], flush=True)\n")
    done = _python(PROBE, "run", "--nodes", "2", "--procs-per-node", "2", "tiny.py", cwd=tmp_path)
    seen = _tagged(done.stdout, "IMPORTS")
    assert seen["code"] == 0 and seen["started"], done.stderr[-3000:]
    assert sorted(line for line in done.stdout.splitlines() if "hello from" in line) == [
        f"[rank {r}] hello from {r}" for r in range(4)]
    before, whole = seen["before"], seen["whole"]
    assert _of(before, FOREIGN) == [] and _of(whole, FOREIGN) == []
    # The ranks start while Prefect is imported on the recording thread, not after.
    assert _of(before, ("prefect",)) == []
    assert [m for m in before if m.startswith("skytasks.providers.") and m.endswith(".spec")] == []
    assert len(before) < BEFORE_RANKS_BOUND, f"{len(before)} modules before the ranks start"
    assert len(whole) < WHOLE_COMMAND_BOUND, f"{len(whole)} modules in the whole command"


def test_a_local_pool_costs_no_kubernetes_and_a_kubernetes_pool_imports_its_client():
    code = textwrap.dedent("""
        import json, sys
        kube = lambda: sorted(m for m in ("kubernetes", "kubernetes_asyncio", "prefect_kubernetes", "kopf")
                              if m in sys.modules)
        from skytasks import GPUPool
        pool = GPUPool(provider="local", nodes=2)
        pool.spec(), repr(pool), pool.model_dump()
        local = kube()
        GPUPool(provider="kubernetes", k8s_image="reg/train:1")
        made = kube()
        given = GPUPool(provider="kubernetes", k8s_image="reg/train:1", kubernetes_credentials={
            "cluster_config": {"config": {"clusters": []}, "context_name": "ctx"}}).kubernetes_credentials
        print("KUBE " + json.dumps({"local": local, "made": made, "given": type(given).__module__ + "."
                                    + type(given).__name__, "context": given.cluster_config.context_name}))
    """)
    seen = _tagged(_python(code).stdout, "KUBE")
    assert seen["local"] == []
    assert seen["made"] == sorted(KUBERNETES)
    assert seen["given"] == "prefect_kubernetes.credentials.KubernetesCredentials" and seen["context"] == "ctx"


def test_the_block_schema_names_the_credentials_block_as_its_real_type_does():
    from prefect_kubernetes.credentials import KubernetesCredentials
    from pydantic import BaseModel

    from skytasks.blocks.gpu_pool import GPUPool

    schema = GPUPool.model_json_schema()
    assert schema["block_schema_references"]["kubernetes_credentials"] == \
        KubernetesCredentials._to_block_schema_reference_dict()
    assert schema["definitions"]["KubernetesCredentials"]["block_type_slug"] == "kubernetes-credentials"
    assert set(schema["properties"]) == set(GPUPool.model_fields)  # what Prefect's own repr kept

    class Eager(BaseModel):  # the field as it read before its type was named lazily
        kubernetes_credentials: KubernetesCredentials | None = GPUPool.model_fields["kubernetes_credentials"]

    eager = Eager.model_json_schema(ref_template="#/definitions/{model}")["properties"]["kubernetes_credentials"]
    lazy = {k: v for k, v in schema["properties"]["kubernetes_credentials"].items() if k != "position"}
    assert lazy == eager
    assert GPUPool._to_block_schema().checksum == GPUPool._calculate_schema_checksum()


def test_a_saved_kubernetes_pool_loads_its_saved_credentials_block(prefect_api):
    from prefect.client.orchestration import get_client
    from prefect_kubernetes.credentials import KubernetesClusterConfig, KubernetesCredentials

    from skytasks import GPUPool

    tag = uuid.uuid4().hex[:8]
    creds = KubernetesCredentials(cluster_config=KubernetesClusterConfig(config={"clusters": []}, context_name="ctx"))
    creds_id = creds.save(f"creds-{tag}")
    GPUPool(provider="kubernetes", k8s_image="reg/train:1", kubernetes_credentials=creds).save(f"kube-{tag}")
    GPUPool(provider="local", nodes=2).save(f"local-{tag}")
    with get_client(sync_client=True) as client:
        saved = client.read_block_document_by_name(f"kube-{tag}", "gpu-pool")
    assert saved.block_document_references["kubernetes_credentials"]["block_document"]["id"] == str(creds_id)

    code = textwrap.dedent(f"""
        import json, sys
        from skytasks import GPUPool
        GPUPool.load("local-{tag}").spec()
        after_local = sorted(m for m in ("prefect_kubernetes", "kubernetes_asyncio") if m in sys.modules)
        creds = GPUPool.load("kube-{tag}").kubernetes_credentials
        print("LOADED " + json.dumps({{"after_local": after_local, "type": type(creds).__name__,
                                      "id": str(creds._block_document_id), "name": creds._block_document_name,
                                      "context": creds.cluster_config.context_name}}))
    """)
    loaded = _tagged(_python(code).stdout, "LOADED")
    assert loaded == {"after_local": [], "type": "KubernetesCredentials", "id": str(creds_id),
                      "name": f"creds-{tag}", "context": "ctx"}


def test_where_prefect_loads_every_collection_the_nested_block_types_are_defined_before_the_pool():
    # A Prefect server registers the block types it has in the order they were defined, and a
    # schema that refers to a block type not registered yet is refused: "GPU Pool" would be missing.
    code = textwrap.dedent("""
        import json
        from prefect.blocks.core import Block
        from prefect.plugins import load_prefect_collections
        from prefect.utilities.dispatch import get_registry_for_type
        load_prefect_collections()
        order = list(get_registry_for_type(Block))
        from skytasks.blocks.gpu_pool import GPUPool
        nested = sorted(ref["block_type_slug"] for ref in GPUPool.model_json_schema()["block_schema_references"].values())
        print("ORDER " + json.dumps({"nested": nested, "before": [
            slug for slug in nested if order.index(slug) < order.index("gpu-pool")]}))
    """)
    seen = _tagged(_python(code).stdout, "ORDER")
    assert seen == {"nested": ["aws-credentials", "kubernetes-credentials"],
                    "before": ["aws-credentials", "kubernetes-credentials"]}


def test_without_the_extra_the_block_still_makes_its_schema():
    code = textwrap.dedent("""
        import json, sys
        sys.modules["kubernetes"] = sys.modules["prefect_kubernetes"] = None
        from skytasks import GPUPool
        schema = GPUPool.model_json_schema()
        print("SCHEMA " + json.dumps({"refs": sorted(schema["block_schema_references"]),
                                      "field": "kubernetes_credentials" in schema["properties"],
                                      "local": GPUPool(provider="local").spec().provider}))
    """)
    assert _tagged(_python(code).stdout, "SCHEMA") == {"refs": ["aws_credentials"], "field": True, "local": "local"}


def test_a_fresh_local_pool_imports_no_aws_or_kubernetes_sdk_until_its_credentials_are_read():
    code = textwrap.dedent("""
        import json, sys
        sdks = lambda: sorted(m for m in ("prefect_aws", "boto3", "botocore", "kubernetes", "prefect_kubernetes")
                              if m in sys.modules)
        import skytasks
        from skytasks import GPUPool
        pool = GPUPool(provider="local", nodes=2)
        spec = pool.spec()
        made = sdks()
        copy = pool.reshaped(nodes=1)
        same = pool == GPUPool(provider="local", nodes=2)
        after = sdks()
        creds = pool.aws_credentials  # the contract's default, made when read
        print("SDKS " + json.dumps({"made": made, "after": after, "same": same, "env": sorted(spec.env),
                                    "type": type(creds).__module__ + "." + type(creds).__name__,
                                    "read": sdks()}))
    """)
    seen = _tagged(_python(code).stdout, "SDKS")
    assert seen["made"] == [] and seen["after"] == [] and seen["same"] is True and seen["env"] == []
    assert seen["type"] == "prefect_aws.credentials.AwsCredentials"
    assert {"prefect_aws", "boto3"} <= set(seen["read"])


def test_credentials_left_unset_stand_for_what_the_installed_prefect_aws_makes():
    # A saved default (every pool saved before holds one) loads without prefect-aws only while the
    # snapshot of its defaults matches the installed release's.
    from prefect_aws import AwsCredentials

    from skytasks.blocks.aws_credentials_field import _DEFAULTS, UNSET, _is_default

    dumped = AwsCredentials().model_dump(mode="json")
    dumped.pop("block_type_slug")
    assert dumped == _DEFAULTS
    assert UNSET == AwsCredentials() and AwsCredentials() == UNSET and UNSET != AwsCredentials(region_name="x")
    assert not _is_default({**dumped, "region_name": "eu-west-1"}, _DEFAULTS)
    assert not _is_default({**dumped, "aws_client_parameters": {"use_ssl": False}}, _DEFAULTS)


def test_a_saved_local_pool_loads_without_prefect_aws_and_keeps_saved_credentials(prefect_api):
    from prefect_aws import AwsCredentials

    from skytasks import GPUPool

    tag = uuid.uuid4().hex[:8]
    GPUPool(provider="local", nodes=2).save(f"plain-{tag}")
    GPUPool(provider="local", nodes=2, aws_credentials=AwsCredentials(region_name="eu-west-1")).save(f"s3-{tag}")
    code = textwrap.dedent(f"""
        import json, sys
        from skytasks import GPUPool
        GPUPool.load("plain-{tag}").spec()
        plain = sorted(m for m in ("prefect_aws", "boto3") if m in sys.modules)
        region = GPUPool.load("s3-{tag}").spec().env["AWS_DEFAULT_REGION"]
        print("LOADED " + json.dumps({{"plain": plain, "region": region}}))
    """)
    assert _tagged(_python(code).stdout, "LOADED") == {"plain": [], "region": "eu-west-1"}


def test_the_users_modules_are_told_from_libraries_by_where_they_lie_without_reading_every_distribution(tmp_path):
    # The project's folder (cwd), a plain folder on PYTHONPATH, and a `pip install --target`
    # folder (distribution metadata beside the package) on PYTHONPATH too.
    project, plain, target = tmp_path / "project", tmp_path / "plain", tmp_path / "target"
    for folder in (project, plain, target / "fakelib"):
        folder.mkdir(parents=True)
    (project / "own_helper.py").write_text("X = 1\n")
    (plain / "shared_helper.py").write_text("Y = 2\n")
    (target / "fakelib" / "__init__.py").write_text("Z = 3\n")
    meta = target / "fakelib-1.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: fakelib\nVersion: 1.0\n")
    (meta / "top_level.txt").write_text("fakelib\n")
    (meta / "RECORD").write_text("fakelib/__init__.py,,\n")
    code = textwrap.dedent("""
        import json, sys
        import torch, prefect  # libraries, and torch.ops ("_ops.py", no file) among them
        from skytasks.controller import project_modules as pm
        import own_helper, shared_helper
        first = sorted(m.__name__ for m in pm.project_modules())
        scanned = pm._distribution_names.cache_info().currsize
        import fakelib
        after = sorted(m.__name__ for m in pm.project_modules())
        print("KINDS " + json.dumps({"first": first, "scanned": scanned, "after": after,
                                     "scanned_after": pm._distribution_names.cache_info().currsize}))
    """)
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(plain), str(target)])}
    done = subprocess.run([sys.executable, "-c", code], cwd=project, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = _tagged(done.stdout, "KINDS")
    assert seen["first"] == ["own_helper", "shared_helper"] and seen["scanned"] == 0
    assert seen["after"] == ["own_helper", "shared_helper"] and seen["scanned_after"] == 1


def test_the_early_ephemeral_server_skips_importing_every_collection_to_register_block_types(monkeypatch):
    # Prefect's own settings, by the names skytasks gives its server (a rename would start
    # registering again, a second of CPU beside the ranks, and this says so).
    from prefect.settings import PREFECT_API_BLOCKS_REGISTER_ON_START, PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION
    from prefect.settings.models.root import Settings

    from skytasks.prefect_records.prefect_internals import SKIPPED_AT_START_ENV, ephemeral_server_command

    monkeypatch.delenv("PREFECT_API_BLOCKS_REGISTER_ON_START", raising=False)
    _, env = ephemeral_server_command(4242)
    for key, value in SKIPPED_AT_START_ENV.items():
        assert env[key] == value
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert PREFECT_API_BLOCKS_REGISTER_ON_START.value_from(settings) is False
    assert PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION.value_from(settings) is False
    monkeypatch.setenv("PREFECT_API_BLOCKS_REGISTER_ON_START", "true")  # the user's own word wins
    assert ephemeral_server_command(4242)[1]["PREFECT_API_BLOCKS_REGISTER_ON_START"] == "true"
