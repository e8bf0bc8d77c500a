"""The platform on a real multi-node Ray cluster (issue 25).

Three Ray nodes started with ``ray start`` on this machine (`tests.infra.multinode_cluster`):
each its own raylet, object store, temp dir and CPUs, so each its own node store, SSD cache
directory and DRAM tier in the platform. The head offers the ``thaw_services`` resource, node
``b`` too, node ``c`` does not. ``thaw serve --address`` joins from the head as users run it:
``--head-only`` (models go to ``b`` and ``c``), ``--services-resource thaw_services`` (the
controller and the two gateway replicas go to the head and ``b``), ``--http-proxies head-only``
(one Serve proxy: the nodes share this machine's ports), the state in a real Redis
(``$THAW_STATE_STORE``), the admin key from a file (``--admin-key-file``, as a mounted secret). Clients
are the official ``openai`` client and the ``thaw`` CLI over HTTP; Ray-level steps run in a separate
driver process (`tests.infra.multinode_driver`), so this process never joins the cluster.

In order, on one cluster:
1. the gateway's two replicas run on two nodes, and a scrape of either shows both replicas'
   series (labelled with replica and node);
2. a model whose checkpoint sits in one node's DRAM starts on that node (from DRAM), though the
   other node has a free slot;
3. scale-out streams the weights from the instance on one node to a new one on the other;
4. ``thaw drain`` of a whole node moves its requests to the other node's instance, losing none;
5. the controller restarted on another node keeps its state (Redis) and adopts the workers (no
   duplicate), while requests stream on;
6. a node lost (its raylet killed): its instance's streams resume on the other node, the
   controller notices within `NODE_DEATH_BOUND_S`, and places the lost instance on a node that
   joined the running platform with ``thaw join``;
7. that node leaves with Ctrl-C to ``thaw join``: it is drained first (its requests move, none
   lost), then its Ray node stops and the platform drops it.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from controller import new_api_key
from tests.controller.redis_server import NOT_FOUND_HELP, RedisServer, find_redis_server
from tests.infra.multinode_cluster import NODE_DEATH_BOUND_S, MultiNodeCluster, multinode_cluster
from tests.infra.running_platform import THAW, RunningPlatform, free_port
from tests.infra.running_platform import wait_for as wait_until
from worker import DemoModelConfig, Engine, SamplingParams, write_demo_model

pytestmark = [pytest.mark.slow, pytest.mark.multinode]

SERVICES = "thaw_services"
DEADLINE_S = 180.0
MAX_TOKENS = 48
# Streams that must still be running when something is done to the platform: long enough that the
# controller sees them on their instance (it polls every second) before they end.
LONG_TOKENS = 384
# Large enough that a long stream lasts seconds on one thread: the controller, which polls its
# workers once a tick, must see it on its instance before it ends (a tiny model's streams ended
# between two polls in a CI run).
MODEL_CONFIG = DemoModelConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=512, max_position_embeddings=512, init_std=0.1, seed=31)
PROMPTS = [f"request {i}: the quick brown fox number {i} jumps over" for i in range(16)]


@dataclass
class Setup:
    cluster: MultiNodeCluster
    platform: RunningPlatform
    model_dir: Path
    engine: Engine  # the reference: the engine run directly, one request at a time
    want: dict[tuple[str, int], str]  # (prompt, max_tokens) -> greedy text
    joined: subprocess.Popen | None = None  # the `thaw join` of node d (test 6), left with SIGINT (test 7)

    def driver(self, *args: str) -> dict:
        result = subprocess.run([sys.executable, "-m", "tests.infra.multinode_driver", args[0],
                                 self.cluster.address, self.platform.namespace, *args[1:]],
                                capture_output=True, text=True, env=self.cluster.env, timeout=DEADLINE_S,
                                cwd=Path(__file__).resolve().parents[2])
        assert result.returncode == 0, result.stderr[-4000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    def instances(self, model: str, state: str = "ready") -> list[dict]:
        return [i for i in self.platform.status()["instances"] if i["model_id"] == model and i["state"] == state]

    def deploy(self, model: str, *flags: str) -> None:
        self.platform.thaw("deploy", "--name", model, "--source", str(self.model_dir), "--queue-timeout-s", "300",
                           "--max-queued-requests", "256", *flags)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("multinode")
    binary = find_redis_server()
    if binary is None:
        pytest.fail(NOT_FOUND_HELP)
    model_dir = write_demo_model(root / "model", MODEL_CONFIG)
    engine = Engine(model_dir)
    want = {(p, n): c.text for n in (MAX_TOKENS, LONG_TOKENS)
            for p, c in zip(PROMPTS, engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=n,
                                                                              ignore_eos=True)))}
    (root / "redis").mkdir()
    redis = RedisServer(binary, root / "redis")
    # One Serve proxy (on the head) routes to both gateway replicas: Serve's preference for a
    # replica on the proxy's own node would otherwise send every request to the head's replica.
    extra = {"RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0"}
    specs = [("head", 1, {SERVICES: 1}), ("b", 2, {SERVICES: 1}), ("c", 2, {})]
    try:
        with multinode_cluster(specs, port=free_port(), extra_env=extra) as cluster:
            state_dir, port, namespace = root / "state", free_port(), f"mn{uuid.uuid4().hex[:8]}"
            # As on Kubernetes: the admin key from a secret file, the state store from the environment.
            (root / "admin-key").write_text(new_api_key())
            env = {**cluster.env, "THAW_STATE_STORE": redis.url}
            process = subprocess.Popen(
                [THAW, "serve", "--address", cluster.address, "--head-only", "--services-resource", SERVICES,
                 "--http-proxies", "head-only", "--gateway-replicas", "2", "--state", str(state_dir),
                 "--admin-key-file", str(root / "admin-key"), "--namespace", namespace, "--port", str(port),
                 "--worker-slots", "2", "--spare-workers", "0", "--no-calibrate", "--ssd-capacity-gb", "1",
                 "--dram-capacity-gb", "0.25"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            platform = RunningPlatform(process, f"http://127.0.0.1:{port}", state_dir, namespace, env, model_dir)
            try:
                wait_until(lambda: any("Ctrl-C stops" in line for line in platform.output) or process.poll() is not None,
                           "thaw serve to start", DEADLINE_S)
                assert process.poll() is None, "thaw serve exited:\n" + "".join(platform.output)
                assert platform.admin_key == (root / "admin-key").read_text()  # imported, copied for the CLI
                assert platform.admin_key not in "".join(platform.output)  # never printed
                yield Setup(cluster, platform, model_dir, engine, want)
            finally:
                if process.poll() is None:
                    process.send_signal(2)  # SIGINT: stops the gateway, the controller and its workers
                    try:
                        process.wait(DEADLINE_S)
                    except subprocess.TimeoutExpired:
                        process.kill()
    finally:
        redis.stop()


def stream(setup: Setup, model: str, prompt: str, max_tokens: int = MAX_TOKENS) -> tuple[str, str | None]:
    """One greedy stream through the gateway; (text, finish reason)."""
    client = setup.platform.client(timeout_s=DEADLINE_S)
    text, finish = [], None
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True}):
        text.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def streams_during(setup: Setup, model: str, prompts: list[str], action, when) -> None:
    """Runs a long stream per prompt; once `when()` holds, does `action()`; every stream must end
    whole and equal the reference engine's output."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream, setup, model, p, LONG_TOKENS) for p in prompts]
        try:
            wait_until(when, "streams under way", DEADLINE_S)
        except AssertionError as exc:  # say where they went, for whoever reads the failure
            instances = [(i["instance_id"], i["node_id"], i["state"], i["num_ongoing_requests"])
                         for i in setup.platform.status()["instances"]]
            done = [f.result() if f.done() and f.exception() is None else f.exception() for f in futures if f.done()]
            raise AssertionError(f"{exc}; instances {instances}; {len(done)} streams already ended: {done[:3]}") \
                from None
        action()
        results = [f.result(timeout=DEADLINE_S * 2) for f in futures]
    for prompt, (text, finish) in zip(prompts, results):
        assert finish == "length" and text == setup.want[prompt, LONG_TOKENS], (prompt, text, finish)


def scrape(setup: Setup) -> list[str]:
    import urllib.request

    request = urllib.request.Request(f"{setup.platform.url}/metrics",
                                     headers={"Authorization": f"Bearer {setup.platform.admin_key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read().decode().splitlines()


def test_the_gateway_runs_on_two_nodes_and_one_scrape_covers_both_replicas(setup):
    model = "acme/spread"
    setup.deploy(model, "--min-instances", "1", "--max-instances", "1")
    wait_until(lambda: setup.instances(model), "an instance ready", DEADLINE_S)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: stream(setup, model, p), PROMPTS))
    assert [text for text, _ in results] == [setup.want[p, MAX_TOKENS] for p in PROMPTS]
    cluster = setup.cluster
    services_nodes = {cluster.nodes["head"].logical_id, cluster.nodes["b"].logical_id}

    def per_replica():
        counts: dict[tuple[str, str], float] = {}
        for line in scrape(setup):
            if line.startswith("thaw_gateway_requests_total{") and f'model="{model}"' in line \
                    and 'status="200"' in line:
                labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.index("}")].split(","))
                key = (labels["replica"].strip('"'), labels["node"].strip('"'))
                counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return counts if sum(counts.values()) == len(PROMPTS) and len(counts) == 2 else None

    counts = wait_until(per_replica, "both replicas' series in one scrape", 60)
    nodes = {node for _, node in counts}
    assert len(nodes) == 2 and nodes <= services_nodes, (counts, services_nodes)  # two nodes, both with the resource
    instance = setup.instances(model)[0]
    assert instance["node_id"] in {cluster.nodes["b"].logical_id, cluster.nodes["c"].logical_id}  # not the head
    assert any(line.startswith("thaw_engine_requests_running{") and f'node="{instance["node_id"]}"' in line
               for line in scrape(setup))
    setup.platform.thaw("scale", model, "--min", "0", "--max", "1")


def test_a_model_in_one_nodes_dram_starts_on_that_node(setup):
    model = "acme/dram"
    setup.deploy(model, "--min-instances", "1", "--max-instances", "1", "--keep-alive-s", "1",
                 "--downscale-delay-s", "0")
    [first] = wait_until(lambda: setup.instances(model), "the first instance", DEADLINE_S)
    home = first["node_id"]
    repo_name = model.replace("/", "--")

    def in_dram(node_id: str) -> bool:
        node = next(n for n in setup.platform.status()["nodes"] if n["node_id"] == node_id)
        return any(e["model"] == repo_name and not e["filling"] for t in node["tiers"] if t["tier"] == "dram"
                   for e in t["entries"])

    assert stream(setup, model, PROMPTS[0])[0] == setup.want[PROMPTS[0], MAX_TOKENS]
    wait_until(lambda: in_dram(home), "the checkpoint promoted into its node's DRAM", DEADLINE_S)
    setup.platform.thaw("scale", model, "--min", "0")
    wait_until(lambda: not [i for i in setup.platform.status()["instances"] if i["model_id"] == model],
               "scaled to zero", DEADLINE_S)
    other = next(n for n in setup.platform.status()["nodes"] if n["node_id"] != home)
    assert other["num_free_slots"] > 0 and not in_dram(other["node_id"])
    assert stream(setup, model, PROMPTS[1])[0] == setup.want[PROMPTS[1], MAX_TOKENS]  # a cold start from zero
    [second] = wait_until(lambda: setup.instances(model), "the second instance", DEADLINE_S)
    assert second["node_id"] == home and second["tier"] == "dram", second
    placement = [d for d in setup.platform.status()["recent_decisions"]
                 if d["kind"] == "placement" and d.get("instance_id") == second["instance_id"]][-1]
    rivals = [e for e in placement["estimates"] if e["node_id"] == other["node_id"]]
    assert rivals and rivals[0]["has_room"] and rivals[0]["tier"] != "dram", placement
    setup.platform.thaw("scale", model, "--max", "1")  # leave it at zero: keep-alive 1 s


def test_scale_out_streams_weights_from_one_node_to_the_other(setup):
    model = "acme/streamed"
    # Each instance takes both slots of a node, so the second one must go to the other node.
    setup.deploy(model, "--min-instances", "1", "--max-instances", "2", "--num-worker-slots", "2",
                 "--upscale-delay-s", "0", "--keep-alive-s", "600")
    wait_until(lambda: not [i for i in setup.platform.status()["instances"] if i["model_id"] != model],
               "the earlier models at zero", DEADLINE_S)
    [first] = wait_until(lambda: setup.instances(model), "the first instance", DEADLINE_S)
    setup.platform.thaw("scale", model, "--min", "2")

    def second():
        ready = [i for i in setup.instances(model) if i["instance_id"] != first["instance_id"]]
        return ready[0] if ready and ready[0]["weights_resident"] else None

    new = wait_until(second, "the second instance with every layer in", DEADLINE_S)
    assert new["node_id"] != first["node_id"]
    assert new["load_path"]["kind"] == "stream", new["load_path"]
    assert new["load_path"]["source_instance_id"] == first["instance_id"]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: stream(setup, model, p), PROMPTS))
    assert [text for text, _ in results] == [setup.want[p, MAX_TOKENS] for p in PROMPTS]


def test_draining_a_whole_node_moves_its_requests_and_loses_none(setup):
    model = "acme/streamed"
    instances = wait_until(lambda: (lambda ready: ready if len(ready) == 2 else None)(setup.instances(model)),
                           "two instances", DEADLINE_S)
    victim = instances[0]

    def busy() -> bool:
        return any(i["instance_id"] == victim["instance_id"] and i["num_ongoing_requests"] > 0
                   for i in setup.instances(model))

    streams_during(setup, model, PROMPTS, lambda: setup.platform.thaw("drain", victim["node_id"]), busy)
    status = setup.platform.status()
    assert not [i for i in status["instances"] if i["node_id"] == victim["node_id"]]
    assert next(n for n in status["nodes"] if n["node_id"] == victim["node_id"])["draining"]
    setup.platform.thaw("undrain", victim["node_id"])
    wait_until(lambda: len(setup.instances(model)) == 2 and all(i["weights_resident"] for i in setup.instances(model)),
               "the model back on both nodes", DEADLINE_S)


def test_the_controller_restarted_on_another_node_keeps_state_and_workers(setup):
    model = "acme/streamed"
    before = setup.platform.status()
    workers_before = sorted(i["actor_name"] for i in before["instances"])
    actors_before = setup.driver("actors")["actors"]
    here = setup.cluster.node_by_logical_id(before["controller"]["node_id"])
    there = setup.cluster.nodes["b" if here.name == "head" else "head"]
    moved: list[dict] = []

    def move() -> None:
        moved.append(setup.driver("move-controller", there.node_id, SERVICES))

    streams_during(setup, model, PROMPTS[:8], move, lambda: sum(i["num_ongoing_requests"]
                                                                for i in setup.instances(model)) > 0)
    print(f"\n[multinode] controller moved from node {here.name} to node {there.name} with 8 streams under way")
    assert moved == [{"old_ray_node_id": here.node_id, "new_ray_node_id": there.node_id}]
    after = wait_until(lambda: (lambda s: s if len([i for i in s["instances"] if i["state"] == "ready"]) == 2
                                else None)(setup.platform.status()), "the new controller's status", DEADLINE_S)
    assert after["controller"]["node_id"] == there.logical_id
    assert sorted(i["actor_name"] for i in after["instances"]) == workers_before  # adopted, none started
    assert setup.driver("actors")["actors"] == actors_before  # no duplicate worker or store
    assert {m["model_id"] for m in after["models"]} == {m["model_id"] for m in before["models"]}  # from Redis
    assert [text for text, _ in map(lambda p: stream(setup, model, p), PROMPTS[8:10])] == \
        [setup.want[p, MAX_TOKENS] for p in PROMPTS[8:10]]


def test_a_lost_node_s_requests_resume_on_the_other_node(setup):
    model = "acme/streamed"
    c = setup.cluster.nodes["c"]
    on_c = wait_until(lambda: next((i for i in setup.instances(model) if i["node_id"] == c.logical_id), None),
                      "an instance on node c", DEADLINE_S)
    # A new machine joins the running platform: `thaw join` (ray start --block, with the cluster's token),
    # with a disk and memory of its own (not the platform's 1 GB SSD and 0.25 GB DRAM caches).
    temp_dir = setup.cluster.head.temp_dir.parent / "d"
    ssd_dir = setup.cluster.head.temp_dir.parent / "d-nvme"
    setup.joined = subprocess.Popen(
        [THAW, "join", "--address", setup.cluster.address, "--num-cpus", "2", "--temp-dir", str(temp_dir),
         "--url", setup.platform.url, "--admin-key", setup.platform.admin_key, "--drain-timeout-s", "120",
         "--ssd-dir", str(ssd_dir), "--ssd-capacity-gb", "2", "--dram-capacity-gb", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=setup.platform.env)
    d = setup.cluster.track_node("d", temp_dir, 2)
    node_d = wait_until(lambda: next((n for n in setup.platform.status()["nodes"] if n["node_id"] == d.logical_id
                                      and n["store_connected"] and n["tiers"]), None),
                        "node d adopted by the platform", DEADLINE_S)
    assert {t["tier"]: t["capacity_bytes"] for t in node_d["tiers"]} == {"ssd": 2 << 30, "dram": 1 << 29}
    assert (ssd_dir / d.logical_id).is_dir() and (node_d["num_gpus"], node_d["accelerator"]) == (0, None)

    def noticed() -> bool:
        status = setup.platform.status()
        return c.logical_id not in {n["node_id"] for n in status["nodes"]} and \
            on_c["instance_id"] not in {i["instance_id"] for i in status["instances"]}

    # The notice is watched from the kill on, beside the streams: the streams resume on node d and
    # run to their end first, which on a loaded machine takes longer than the bound itself.
    watcher = concurrent.futures.ThreadPoolExecutor(1)
    watched: list[concurrent.futures.Future] = []

    def kill() -> None:
        setup.cluster.kill_raylet("c")
        killed_at = time.monotonic()
        watched.append(watcher.submit(
            lambda: (wait_until(noticed, "the controller to drop node c and its instance", NODE_DEATH_BOUND_S * 3),
                     time.monotonic() - killed_at)[1]))

    def busy_on_c() -> bool:
        return any(i["instance_id"] == on_c["instance_id"] and i["num_ongoing_requests"] > 0
                   for i in setup.instances(model))

    try:
        streams_during(setup, model, PROMPTS, kill, busy_on_c)
        noticed_after_s = watched[0].result()
    finally:
        watcher.shutdown(wait=False)
    print(f"\n[multinode] node c lost: the controller dropped it and its instance {noticed_after_s:.1f} s after the kill")
    assert noticed_after_s <= NODE_DEATH_BOUND_S
    assert [text for text, _ in map(lambda p: stream(setup, model, p), PROMPTS[:2])] == \
        [setup.want[p, MAX_TOKENS] for p in PROMPTS[:2]]
    replacement = wait_until(
        lambda: next((i for i in setup.instances(model) if i["node_id"] == d.logical_id and i["weights_resident"]),
                     None), "the lost instance placed again, on node d", DEADLINE_S)
    assert replacement["instance_id"] != on_c["instance_id"]


def test_a_node_leaving_with_thaw_join_is_drained_first(setup):
    model = "acme/streamed"
    d = setup.cluster.nodes["d"]
    on_d = wait_until(lambda: next((i for i in setup.instances(model) if i["node_id"] == d.logical_id), None),
                      "an instance on node d", DEADLINE_S)
    assert setup.joined is not None and setup.joined.poll() is None

    def busy_on_d() -> bool:
        return any(i["instance_id"] == on_d["instance_id"] and i["num_ongoing_requests"] > 0
                   for i in setup.instances(model))

    streams_during(setup, model, PROMPTS, lambda: setup.joined.send_signal(2), busy_on_d)  # SIGINT: Ctrl-C
    output, _ = setup.joined.communicate(timeout=DEADLINE_S)
    assert setup.joined.returncode == 0, output
    assert f"joined the cluster at {setup.cluster.address} as node {d.logical_id}" in output
    assert f"node {d.logical_id} drained: its requests moved to other nodes; stopping it" in output
    wait_until(lambda: d.logical_id not in {n["node_id"] for n in setup.platform.status()["nodes"]},
               "the platform to drop node d", NODE_DEATH_BOUND_S)
    assert d.raylet() is None

