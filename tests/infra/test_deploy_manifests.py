"""The deployment files under ``infra/deploy/`` hold together, checked offline.

Nothing here builds an image or talks to a cluster; each test reads the files and fails on
what would break a deployment:

- every Kubernetes object validates against Kubernetes' own OpenAPI schemas (the
  ``kubernetes-validate`` package bundles them), unknown fields included, at the oldest
  Kubernetes the manifests support and the newest the package knows; the RayCluster against
  KubeRay's CRD schema (``data/kuberay_raycluster_schema.json``, see ``data/README.md``), also
  with unknown fields refused, and its pod templates against Kubernetes' ``PodTemplate``;
- the ``thaw serve`` command of both the RayCluster's head and ``ray-cluster.yaml`` parses with
  the CLI's own parser and builds a real `PlatformConfig` (Redis state store, the repository,
  capacities), and the ``ray start`` options they use are ``ray start``'s;
- names agree across files: the image the Dockerfile builds is the one the RayCluster runs, the
  Ray it pins is the RayCluster's ``rayVersion``, its torch specs are ``infra/setup.sh``'s, the
  state store URL names the Redis Service and port, every Secret, ConfigMap and claim referenced
  exists with the key asked for;
- each node that hosts models has GPUs, an SSD volume at the state directory at least
  ``--ssd-capacity-gb`` large, and a ``/dev/shm`` tmpfs that holds ``--dram-capacity-gb`` plus
  Ray's object store, inside the pod's memory limit.
"""

from __future__ import annotations

import argparse
import copy
import json
import posixpath
import re
import shlex
import tomllib
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "infra" / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
KUBERAY_MANIFEST = DEPLOY / "kuberay-raycluster.yaml"
RAY_CLUSTER_CONFIG = DEPLOY / "ray-cluster.yaml"
KUBERAY_SCHEMA = Path(__file__).with_name("data") / "kuberay_raycluster_schema.json"

# The oldest Kubernetes the manifests are written for; also checked: the newest the package has.
MIN_KUBERNETES_VERSION = "1.29"
GIB = 1 << 30
# A model-hosting pod's memory beyond its /dev/shm: the worker processes (torch, a CUDA context,
# pinned staging buffers) and Ray's raylet. tmpfs pages count against the pod's memory limit.
MIN_PROCESS_MEMORY_BYTES = 8 * GIB
SHM_PATH = "/dev/shm"
GPU_RESOURCE = "nvidia.com/gpu"
EXPECTED_KINDS = {"Secret", "ConfigMap", "PersistentVolumeClaim", "Deployment", "Service", "NetworkPolicy",
                  "RayCluster"}
# Stand-ins for what only exists on a running node.
RAY_CLUSTER_SHELL_ENV = {"HEAD_IP": "10.0.0.1", "RAY_HEAD_IP": "10.0.0.1"}

_QUANTITY_RE = re.compile(r"([0-9.]+(?:[eE][0-9]+)?)([a-zA-Z]*)")
_QUANTITY_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
                   "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50}
_SHELL_OPERATOR_CHARS = set("();<>|&")
_SHELL_VAR_RE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


# ---- reading the files ------------------------------------------------------------------------

def quantity_bytes(value: str | int) -> int:
    """A Kubernetes quantity (``56Gi``, ``1e9``, ``4294967296``) as a number."""
    match = _QUANTITY_RE.fullmatch(str(value))
    assert match and match.group(2) in _QUANTITY_UNITS, f"not a byte quantity: {value!r}"
    return int(float(match.group(1)) * _QUANTITY_UNITS[match.group(2)])


def dockerfile_stages(text: str) -> tuple[dict[str, str], list[tuple[str, list[tuple[str, str]]]]]:
    """(global ARG defaults, [(stage name, [(INSTRUCTION, arguments)])]), continuation lines joined
    and comment lines dropped, as Docker reads them."""
    instructions, current = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or not stripped:
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        keyword, _, rest = (current + stripped).partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        current = ""
    global_args: dict[str, str] = {}
    stages: list[tuple[str, list[tuple[str, str]]]] = []
    for keyword, rest in instructions:
        if keyword == "FROM":
            words = rest.split()
            assert len(words) == 3 and words[1].upper() == "AS", f"every stage is named: FROM {rest}"
            stages.append((words[2], []))
        elif not stages:
            assert keyword == "ARG", f"only ARG may come before the first FROM, got {keyword}"
            name, _, default = rest.partition("=")
            global_args[name] = default
        else:
            stages[-1][1].append((keyword, rest))
    return global_args, stages


def stage_values(instructions: list[tuple[str, str]], keyword: str) -> dict[str, str]:
    """A stage's ``LABEL k=v ...`` or ``ARG NAME=default`` values (an ARG without one maps to "")."""
    values = {}
    for found, rest in instructions:
        if found == keyword:
            for word in shlex.split(rest):
                name, _, value = word.partition("=")
                values[name] = value
    return values


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a shell script, as their words (quotes removed, nothing expanded),
    split at newlines and at the operators ``; && || | & > >> <`` and the like."""
    commands = []
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for token in lexer:
            if set(token) <= _SHELL_OPERATOR_CHARS:
                commands.append(words)
                words = []
            else:
                words.append(token)
        commands.append(words)
    return [words for words in commands if words]


def expand(word: str, env: Mapping[str, str]) -> str:
    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        assert name in env, f"${name} is not defined for this command (env: {sorted(env)})"
        return env[name]

    return _SHELL_VAR_RE.sub(value, word)


def find_command(commands: list[list[str]], *program: str) -> tuple[int, list[str]]:
    """(index, argv after `program`) of the one command that runs `program` (after ``exec`` or
    ``nohup``; the program also by its path, e.g. ``~/thaw/.venv/bin/thaw``)."""
    found = []
    for index, words in enumerate(commands):
        while words and words[0] in ("exec", "nohup"):
            words = words[1:]
        head = [Path(words[0]).name if words else "", *words[1:len(program)]]
        if head == list(program):
            found.append((index, words[len(program):]))
    assert len(found) == 1, f"expected one `{' '.join(program)}` command, found {len(found)}"
    return found[0]


def parse_serve(argv: list[str], env: Mapping[str, str] | None = None):
    """`thaw serve`'s arguments as its own parser reads them, in the command's environment `env`
    (its ``THAW_*`` defaults), and the `PlatformConfig` they build. Flags must be spelt out: an
    abbreviation argparse accepts today turns ambiguous, and the command fails, the day a longer
    flag with the same start is added."""
    from unittest import mock

    from infra.cli import build_parser
    from infra.cli_serve import _config_from_args

    thaw_env = {k: v for k, v in (env or {}).items() if k.startswith("THAW_")}
    with mock.patch.dict("os.environ", thaw_env):
        parser = build_parser()
    (commands,) = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    commands.choices["serve"].allow_abbrev = False
    try:
        args = parser.parse_args(["serve", *argv])
    except SystemExit:  # argparse printed which flag it refused
        pytest.fail(f"`thaw serve` refuses {shlex.join(argv)}")
    return args, _config_from_args(args)


def parse_ray_start(argv: list[str]) -> dict[str, Any]:
    """`ray start`'s parameters from `argv`, parsed by Ray's own command (nothing runs)."""
    import click
    from ray.scripts.scripts import start

    try:
        return start.make_context("ray start", list(argv)).params
    except click.UsageError as exc:
        pytest.fail(f"`ray start` refuses {shlex.join(argv)}: {exc}")


def ray_start_params_argv(params: Mapping[str, str]) -> list[str]:
    """KubeRay's rendering of rayStartParams: ``--name=value``, or ``--name`` for "true"."""
    return [f"--{name}" if value.lower() == "true" else f"--{name}={value}" for name, value in sorted(params.items())]


def forbid_unknown_fields(schema: Any) -> Any:
    """A copy of an OpenAPI schema where an object with listed properties takes no others (as
    ``kubectl apply --validate=strict`` does; a CRD's schema leaves them to be pruned silently)."""
    if isinstance(schema, list):
        return [forbid_unknown_fields(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: forbid_unknown_fields(value) for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        strict["additionalProperties"] = False
    return strict


# ---- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(KUBERAY_MANIFEST.read_text()) if doc]


@pytest.fixture(scope="module")
def raycluster(objects) -> dict[str, Any]:
    (cluster,) = [obj for obj in objects if obj["kind"] == "RayCluster"]
    return cluster


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, list[tuple[str, str]]], str]:
    """(global ARGs, {stage: instructions}, the default target's name)."""
    global_args, stages = dockerfile_stages(DOCKERFILE.read_text())
    return global_args, dict(stages), stages[-1][0]


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def ray_cluster_config() -> dict[str, Any]:
    return yaml.safe_load(RAY_CLUSTER_CONFIG.read_text())


def find_object(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [obj for obj in objects if obj["kind"] == kind and obj["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name!r} is referenced but the manifest has {len(found)}"
    return found[0]


def ray_groups(cluster: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """("head" or the worker group's name, its group spec)."""
    yield "head", cluster["spec"]["headGroupSpec"]
    for group in cluster["spec"]["workerGroupSpecs"]:
        yield group["groupName"], group


def pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for obj in objects:
        if obj["kind"] == "Deployment":
            yield obj["metadata"]["name"], obj["spec"]["template"]["spec"]
        elif obj["kind"] == "RayCluster":
            for name, group in ray_groups(obj):
                yield f"{obj['metadata']['name']}/{name}", group["template"]["spec"]


def ray_container(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]["containers"][0]  # KubeRay's Ray container is the first


def container_env(container: dict[str, Any], objects: list[dict[str, Any]]) -> dict[str, str]:
    """A container's environment with Secret and ConfigMap references resolved from the manifest,
    and ``$(NAME)`` in a value replaced by an earlier variable, as the kubelet does."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            def earlier(match: re.Match) -> str:
                assert match.group(1) in env, f"env {var['name']} uses $({match.group(1)}) before it is defined"
                return env[match.group(1)]

            env[var["name"]] = re.sub(r"\$\((\w+)\)", earlier, var["value"])
            continue
        ref = var["valueFrom"]
        kind, ref = ("Secret", ref["secretKeyRef"]) if "secretKeyRef" in ref else ("ConfigMap", ref["configMapKeyRef"])
        data = find_object(objects, kind, ref["name"]).get("stringData" if kind == "Secret" else "data", {})
        assert ref["key"] in data, f"{kind} {ref['name']!r} has no key {ref['key']!r} (env {var['name']})"
        env[var["name"]] = data[ref["key"]]
    return env


def mounted_volume(group: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume the Ray container mounts at `path`."""
    (mount,) = [m for m in ray_container(group).get("volumeMounts", []) if m["mountPath"] == path]
    (volume,) = [v for v in group["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    return volume


def head_serve(objects, raycluster):
    """(index of the serve command in the head's script, the script's commands, args, PlatformConfig)."""
    container = ray_container(raycluster["spec"]["headGroupSpec"])
    assert container["command"] == ["/bin/bash", "-c", "--"]  # the script is the one argument
    script = "\n".join(container["args"])
    commands = shell_commands(script)
    index, argv = find_command(commands, "thaw", "serve")
    env = container_env(container, objects)
    args, config = parse_serve([expand(word, env) for word in argv], env)
    return index, commands, args, config


# ---- the Dockerfile -----------------------------------------------------------------------------

def test_the_image_the_dockerfile_builds_is_the_one_the_raycluster_runs(dockerfile, raycluster, pyproject):
    _, stages, _ = dockerfile
    labels = stage_values(stages["base"], "LABEL")
    image = f"{labels['org.opencontainers.image.title']}:{labels['org.opencontainers.image.version']}"
    assert labels["org.opencontainers.image.version"] == pyproject["project"]["version"]
    for name, group in ray_groups(raycluster):
        assert ray_container(group)["image"] == image, f"group {name}"


def test_the_raycluster_runs_the_ray_the_image_pins(dockerfile, raycluster, pyproject):
    from packaging.requirements import Requirement

    global_args, _, _ = dockerfile
    ray_version = global_args["RAY_VERSION"]
    assert raycluster["spec"]["rayVersion"] == ray_version
    (ray,) = [Requirement(dep) for dep in pyproject["project"]["dependencies"] if Requirement(dep).name == "ray"]
    assert ray.specifier.contains(ray_version), f"pyproject.toml asks for {ray}, the image pins {ray_version}"


def test_each_image_installs_its_torch_then_the_whole_project(dockerfile, pyproject):
    _, stages, default_target = dockerfile
    assert default_target == "cuda"  # `docker build` without --target: the GPU nodes' image
    setup_specs = re.findall(r'torch_spec="(torch==[^"$]+)"', (ROOT / "infra" / "setup.sh").read_text())
    cpu_spec = next(spec for spec in setup_specs if spec.endswith("+cpu"))
    gpu_spec = next(spec for spec in setup_specs if not spec.endswith("+cpu"))
    # Where the base stage copied the project, and what it copied.
    workdir, copied = "/", set()
    for keyword, rest in stages["base"]:
        if keyword == "WORKDIR":
            workdir = posixpath.join(workdir, rest)
        elif keyword == "COPY":
            *sources, raw_dest = rest.split()
            dest = posixpath.normpath(posixpath.join(workdir, raw_dest))
            for src in sources:
                if len(sources) == 1 and src.endswith("/"):  # a directory's contents, into dest
                    copied.add(dest)
                elif len(sources) > 1 or raw_dest.endswith(("/", ".")):  # into the directory dest
                    copied.add(posixpath.join(dest, posixpath.basename(src)))
                else:
                    copied.add(dest)
    (project_dir,) = {posixpath.dirname(path) for path in copied if path.endswith("/pyproject.toml")}
    assert f"{project_dir}/README.md" in copied  # pyproject.toml's readme: the build needs it
    packages = {pattern.rstrip("*") for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    missing = {f"{project_dir}/{package}" for package in packages} - copied
    assert not missing, f"packages pyproject.toml lists but the image does not copy: {sorted(missing)}"
    for stage, spec in (("cuda", gpu_spec), ("cpu", cpu_spec)):
        instructions = stages[stage]
        assert stage_values(instructions, "ARG")["TORCH_SPEC"] == spec, stage
        runs = [shlex.split(rest) for keyword, rest in instructions if keyword == "RUN"]
        torch_run = next(i for i, words in enumerate(runs) if words[:3] == ["pip", "install", "${TORCH_SPEC}"])
        project_run = next(i for i, words in enumerate(runs)
                           if words[:2] == ["pip", "install"] and project_dir in words)
        assert torch_run < project_run, f"{stage}: torch must be installed before the project"
        assert "ray[serve]==${RAY_VERSION}" in runs[project_run], f"{stage}: Ray is not pinned"
        assert "-e" not in runs[project_run], f"{stage}: an editable install would need the sources at run time"


def test_only_the_cpu_image_builds_the_cpu_kernels_for_every_level_by_default(dockerfile):
    _, stages, _ = dockerfile
    builds = {stage: any(keyword == "RUN" and "python -m kernels --all" in rest for keyword, rest in instructions)
              for stage, instructions in stages.items()}
    assert builds == {"base": False, "cpu": True, "cuda": False}
    assert stage_values(stages["cpu"], "ARG")["PREBUILD_CPU_KERNELS"] == "all"  # an image for any x86-64


# ---- the Kubernetes manifests ---------------------------------------------------------------------

@pytest.mark.parametrize("version", [MIN_KUBERNETES_VERSION, kubernetes_validate.latest_version()])
def test_every_kubernetes_object_validates_against_the_kubernetes_schema(objects, version):
    assert {obj["kind"] for obj in objects} == EXPECTED_KINDS
    for obj in objects:
        if obj["kind"] == "RayCluster":  # not Kubernetes' own; its pod templates are
            for name, group in ray_groups(obj):
                template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"thaw-{name}"},
                            "template": group["template"]}
                kubernetes_validate.validate(template, version, strict=True)
        else:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_raycluster_validates_against_kuberays_crd_schema(raycluster):
    data = json.loads(KUBERAY_SCHEMA.read_text())
    assert (data["source"]["kind"], data["source"]["apiVersion"]) == ("RayCluster", raycluster["apiVersion"])
    validator = jsonschema.Draft7Validator(forbid_unknown_fields(data["openAPIV3Schema"]))
    errors = [f"{'.'.join(map(str, error.absolute_path))}: {error.message}"
              for error in validator.iter_errors(raycluster)]
    assert errors == []
    misspelt = copy.deepcopy(raycluster)
    misspelt["spec"]["headGroupSpec"]["rayStartParam"] = misspelt["spec"]["headGroupSpec"].pop("rayStartParams")
    assert not validator.is_valid(misspelt)  # unknown fields are refused, not pruned


def test_every_secret_configmap_and_claim_referenced_exists(objects):
    for _, spec in pod_specs(objects):
        for container in spec["containers"]:
            container_env(container, objects)  # resolves every reference, or fails naming it
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                find_object(objects, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
            if "secret" in volume:
                secret = find_object(objects, "Secret", volume["secret"]["secretName"])
                for item in volume["secret"].get("items", []):
                    assert item["key"] in secret.get("stringData", {}), (volume["name"], item["key"])


def test_the_head_runs_thaw_serve_with_flags_it_accepts(objects, raycluster):
    index, commands, args, config = head_serve(objects, raycluster)
    assert raycluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    # Ray is started first, without KubeRay's --block (or `thaw serve` would never run).
    assert commands.index(["${KUBERAY_GEN_RAY_START_CMD/--block/}"]) < index
    assert commands[index][0] == "exec"  # so SIGTERM reaches it and it stops the platform cleanly
    assert (args.address, args.host, args.no_auth, args.demo) == ("auto", "0.0.0.0", False, False)
    assert config.state_location.startswith("redis://")
    assert config.effective_repository_uri.startswith("s3://")
    url = urllib.parse.urlsplit(args.state_store)
    redis = find_object(objects, "Service", url.hostname)
    assert url.port in [port["port"] for port in redis["spec"]["ports"]]
    # No secret on the command line: the state store's password comes in $THAW_STATE_STORE, the
    # admin key from a mounted Secret, the same on every start of the pod.
    assert "--state-store" not in commands[index] and url.password not in " ".join(commands[index])
    assert args.admin_key_file is not None and not args.reset_admin_key
    mount = next(m for m in ray_container(raycluster["spec"]["headGroupSpec"])["volumeMounts"]
                 if args.admin_key_file.startswith(m["mountPath"].rstrip("/") + "/"))
    (volume,) = [v for v in raycluster["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]
                 if v["name"] == mount["name"]]
    assert posixpath.relpath(args.admin_key_file, mount["mountPath"]) in [i["path"] for i in volume["secret"]["items"]]


def test_every_ray_node_mounts_the_state_dir_and_reads_the_repository(objects, raycluster):
    _, _, args, _ = head_serve(objects, raycluster)
    for name, group in ray_groups(raycluster):
        env = container_env(ray_container(group), objects)
        assert env["THAW_STATE_DIR"] == args.state, name  # the CLI in the pod finds the platform
        mounted_volume(group, args.state)
        assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"} <= set(env), name


def test_model_nodes_have_gpus_and_volumes_sized_for_their_caches(objects, raycluster):
    _, _, args, config = head_serve(objects, raycluster)
    groups = dict(ray_groups(raycluster))
    # With --head-only the head hosts no model: no node store, no cache, no GPU needed.
    model_groups = [name for name in groups if name != "head" or not args.head_only]
    assert any(name != "head" for name in model_groups)
    for name, group in groups.items():
        container = ray_container(group)
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        object_store = quantity_bytes(group["rayStartParams"]["object-store-memory"])
        shm = mounted_volume(group, SHM_PATH)["emptyDir"]
        assert shm["medium"] == "Memory", name
        cache_bytes = config.controller.dram_capacity_bytes if name in model_groups else 0
        assert quantity_bytes(shm["sizeLimit"]) >= cache_bytes + object_store, \
            f"{name}: /dev/shm must hold the DRAM cache (--dram-capacity-gb) and Ray's object store"
        assert quantity_bytes(limits["memory"]) >= quantity_bytes(shm["sizeLimit"]) + MIN_PROCESS_MEMORY_BYTES, \
            f"{name}: the memory limit must hold /dev/shm (tmpfs) and the processes"
        if name not in model_groups:
            continue
        # The controller gives a node one slot per GPU Ray reports, and GPU instances land there.
        assert int(limits.get(GPU_RESOURCE, 0)) >= 1 and requests.get(GPU_RESOURCE) == limits[GPU_RESOURCE], \
            f"{name}: a node that hosts models requests GPUs"
        state = mounted_volume(group, args.state)
        if "emptyDir" in state:  # on the kubelet's disk: the pod is evicted past its sizeLimit
            state_bytes = quantity_bytes(state["emptyDir"]["sizeLimit"])
            assert state_bytes >= config.controller.ssd_capacity_bytes, \
                f"{name}: the state volume must hold the SSD cache (--ssd-capacity-gb)"
            assert quantity_bytes(requests["ephemeral-storage"]) >= state_bytes, \
                f"{name}: the pod must be scheduled where its state volume fits"


def test_ray_start_params_are_ray_start_options(raycluster):
    for name, group in ray_groups(raycluster):
        argv = ray_start_params_argv(group["rayStartParams"])
        parse_ray_start([*argv, "--head"] if name == "head" else [*argv, "--address=thaw-head-svc:6379"])
        if name != "head":
            assert shell_commands(" ".join(ray_container(group)["args"]))[-1] == ["$KUBERAY_GEN_RAY_START_CMD"], name


def test_the_gateway_service_reaches_the_heads_serve_port(objects, raycluster):
    _, _, args, _ = head_serve(objects, raycluster)
    head = raycluster["spec"]["headGroupSpec"]
    gateway = find_object(objects, "Service", "thaw-gateway")
    assert gateway["spec"]["selector"].items() <= head["template"]["metadata"]["labels"].items()
    assert [port["targetPort"] for port in gateway["spec"]["ports"]] == [args.port]
    assert args.port in [port["containerPort"] for port in ray_container(head)["ports"]]
    assert ray_container(head)["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": args.port}


def test_redis_persists_and_takes_connections_from_the_ray_pods_only(objects, raycluster):
    _, _, args, _ = head_serve(objects, raycluster)
    url = urllib.parse.urlsplit(args.state_store)
    service = find_object(objects, "Service", url.hostname)
    deployment = next(obj for obj in objects if obj["kind"] == "Deployment"
                      and service["spec"]["selector"].items() <= obj["spec"]["template"]["metadata"]["labels"].items())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == url.port]
    assert port["targetPort"] in [p["containerPort"] for p in container["ports"]]
    assert container["args"][container["args"].index("--appendonly") + 1] == "yes"
    assert container["args"][container["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert url.password == container_env(container, objects)["REDIS_PASSWORD"]
    (policy,) = [obj for obj in objects if obj["kind"] == "NetworkPolicy"]
    redis_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= redis_labels.items()
    (rule,) = policy["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == [port["targetPort"]]
    (peer,) = rule["from"]
    for name, group in ray_groups(raycluster):
        assert peer["podSelector"]["matchLabels"].items() <= group["template"]["metadata"]["labels"].items(), name


# ---- ray-cluster.yaml (`ray up`) -------------------------------------------------------------------

def test_the_ray_cluster_config_validates_against_rays_schema(ray_cluster_config):
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(ray_cluster_config, schema)
    assert {"cluster_name", "provider", "auth", "available_node_types", "head_node_type", "setup_commands",
            "head_start_ray_commands", "worker_start_ray_commands"} <= set(ray_cluster_config)
    assert ray_cluster_config["head_node_type"] in ray_cluster_config["available_node_types"]


def test_the_ray_cluster_head_starts_ray_redis_and_thaw_serve(ray_cluster_config):
    commands = [words for command in ray_cluster_config["head_start_ray_commands"]
                for words in shell_commands(command)]
    _, ray_argv = find_command(commands, "ray", "start")
    head = parse_ray_start([expand(word, RAY_CLUSTER_SHELL_ENV) for word in ray_argv])
    assert head["head"] is True
    index, serve_argv = find_command(commands, "thaw", "serve")
    assert any(words[0].startswith("HEAD_IP=") for words in commands[:index])  # defined before its use
    args, config = parse_serve([expand(word, RAY_CLUSTER_SHELL_ENV) for word in serve_argv])
    assert (args.address, args.host, args.no_auth) == ("auto", "0.0.0.0", False)
    assert config.effective_repository_uri.startswith("s3://")
    url = urllib.parse.urlsplit(args.state_store)
    assert (url.scheme, url.hostname) == ("redis", RAY_CLUSTER_SHELL_ENV["HEAD_IP"])
    # Redis listens where the URL says, and not on the GCS port.
    redis_ports = re.findall(r"'port (\d+)'", " ".join(ray_cluster_config["head_setup_commands"]))
    assert [int(port) for port in redis_ports] == [url.port] and url.port != head["port"]
    for command in ray_cluster_config["worker_start_ray_commands"]:
        for words in shell_commands(command):
            if words[:2] == ["ray", "start"]:
                worker = parse_ray_start([expand(word, RAY_CLUSTER_SHELL_ENV) for word in words[2:]])
                assert worker["address"] == f"{RAY_CLUSTER_SHELL_ENV['RAY_HEAD_IP']}:{head['port']}"


def test_the_ray_cluster_workers_have_gpus(ray_cluster_config):
    commands = [words for command in ray_cluster_config["head_start_ray_commands"]
                for words in shell_commands(command)]
    args, _ = parse_serve([expand(word, RAY_CLUSTER_SHELL_ENV) for word in find_command(commands, "thaw", "serve")[1]])
    head_type = ray_cluster_config["head_node_type"]
    for name, node_type in ray_cluster_config["available_node_types"].items():
        if name == head_type and args.head_only:
            continue
        assert node_type["resources"].get("GPU", 0) >= 1, name
        assert node_type.get("max_workers", 0) >= node_type.get("min_workers", 0) >= (0 if name == head_type else 1)


def resources_json(value: str) -> dict[str, float]:
    """A ``--resources`` value as Ray reads it (KubeRay's rayStartParams quote it once more)."""
    text = value.strip()
    if text.startswith('"') and text.endswith('"'):
        text = json.loads(text)
    return json.loads(text)


def test_ray_token_auth_is_on_for_every_node_and_driver(raycluster, ray_cluster_config):
    # KubeRay makes the token's Secret and sets RAY_AUTH_MODE/RAY_AUTH_TOKEN in every Ray container
    # (Ray 2.52+ starts a head with token auth unless told otherwise; a worker without the token
    # cannot join).
    assert raycluster["spec"]["authOptions"]["mode"] == "token"
    # ray up: one token file, copied to every node, and the mode for every login shell's commands.
    assert ray_cluster_config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert any("export RAY_AUTH_MODE=token" in command and ".bashrc" in command
               for command in ray_cluster_config["setup_commands"])


def test_the_controller_and_gateway_run_only_where_the_services_resource_is(objects, raycluster, ray_cluster_config):
    _, _, args, config = head_serve(objects, raycluster)
    assert args.services_resource and config.num_gateway_replicas >= 2
    for name, group in ray_groups(raycluster):
        offered = resources_json(group["rayStartParams"].get("resources", '"{}"'))
        # the head, which never scales in; never a GPU group
        assert (args.services_resource in offered) == (name == "head"), name
    commands = [words for command in ray_cluster_config["head_start_ray_commands"]
                for words in shell_commands(command)]
    serve_args, _ = parse_serve([expand(word, RAY_CLUSTER_SHELL_ENV) for word in find_command(commands, "thaw",
                                                                                             "serve")[1]])
    head = parse_ray_start([expand(word, RAY_CLUSTER_SHELL_ENV) for word in find_command(commands, "ray", "start")[1]])
    assert serve_args.services_resource in resources_json(head["resources"])
    for command in ray_cluster_config["worker_start_ray_commands"]:
        for words in shell_commands(command):
            if words[:2] == ["ray", "start"]:
                worker = parse_ray_start(words[2:])
                assert serve_args.services_resource not in resources_json(worker["resources"] or "{}")
