"""The ``thaw`` subcommands that operate a running platform through its admin API.

``deploy`` (a job followed with a progress bar, or ``--no-wait``), ``deploys`` (the recent deploy
jobs, or one), ``delete``, ``list``, ``status``, ``scale``, ``drain``, ``undrain``, ``migrate``, ``tenants ...``
(``ls`` with each tenant's quota, ``create``, ``delete``, ``quota``) and ``keys ...`` each make one
or two calls with `AdminClient` and print a table (``--json``: the API's own JSON, for scripts).
Where the platform is and which key to use come from ``--url`` / ``--admin-key``, else
``$THAW_URL`` / ``$THAW_ADMIN_KEY``, else the files a running ``thaw serve`` keeps in its state
directory (``--state``, default ``$THAW_STATE_DIR`` or ``~/.thaw``).

Exit codes, as for every ``thaw`` command: 0 success; 2 bad input — a flag, a spec file, or a
value the server refused as invalid (HTTP 400); 1 anything else — the server refused (401, 403,
404, 409), failed (5xx), or could not be reached. Errors are one line naming the cause.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from infra.admin_client import AdminApiError, AdminClient, AdminUnreachable, resolve_endpoint
from infra.cli_errors import AdminCommandError, UsageError
from infra.platform_config import default_state_dir
from wire import DeployProgress


def _run(args: argparse.Namespace, action: Callable[[AdminClient], Coroutine[Any, Any, Any]]) -> Any:
    """Runs `action` with a client for the platform the flags point at."""
    url, key = resolve_endpoint(args.url, args.admin_key, Path(args.state).expanduser())

    async def main() -> Any:
        async with AdminClient(url, key, timeout_s=args.timeout) as client:
            return await action(client)

    try:
        return asyncio.run(main())
    except AdminApiError as exc:
        hint = ""
        if exc.status == 401 and key is None:
            hint = " (no admin key found: pass --admin-key, set THAW_ADMIN_KEY, or use --state of the platform)"
        raise AdminCommandError(f"{exc.message}{hint}", 2 if exc.status == 400 else 1) from None
    except AdminUnreachable as exc:
        raise AdminCommandError(str(exc), 1) from None


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], empty: str | None = None) -> None:
    """Left-aligned columns separated by two spaces; `empty` printed instead when no rows."""
    if not rows:
        if empty:
            print(empty)
        return
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip())
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"


def _rate(bytes_per_s: float | None) -> str:
    return "-" if not bytes_per_s else f"{bytes_per_s / 1e9:.2f} GB/s"


# ---- models ---------------------------------------------------------------------------------


def _specs_from_args(args: argparse.Namespace) -> list[dict[str, Any]]:
    from controller import SpecError, load_model_specs, model_spec_from_arguments

    try:
        if args.file is None:
            return [model_spec_from_arguments(args).to_dict()]
        specs = load_model_specs(args.file)
        if len(specs) > 1:
            if any(key.startswith("spec__") for key in vars(args)):
                raise UsageError("spec flags apply to a file with one model; this one has several")
            return [spec.to_dict() for spec in specs]
        return [model_spec_from_arguments(args, base=specs[0]).to_dict()]
    except SpecError as exc:
        raise UsageError(str(exc)) from None


def cmd_deploy(args: argparse.Namespace) -> int:
    """Starts each spec's deploy job and (unless --no-wait) follows it with a progress bar until it
    has finished; a failed one ends the command with its error (the ones before it stay deployed)."""
    from infra.deploy_watch import DeployLost, DeployProgressView, watch_deploy
    from infra.source_upload import ResumeRecords, wants_upload

    specs = _specs_from_args(args)
    verb = "update" if args.update else "deploy"
    records = ResumeRecords(Path(args.state).expanduser())

    async def action(client: AdminClient) -> list[dict[str, Any]]:
        done = []
        for spec in specs:
            model_id = f"{spec['tenant']}/{spec['name']}"
            start = time.perf_counter()
            local = Path(spec["source"]) if spec["source"].startswith("/") else None  # not s3:// nor upload:
            uploaded = local is not None and wants_upload(args.upload, client.url)
            if uploaded:
                spec = {**spec, "source": f"upload:{await _uploaded(client, local, records)}"}
            record = await client.start_deploy(spec, update=args.update)
            if args.no_wait:
                print(f"{verb} of {model_id} started as {record.deploy_id}; follow it with "
                      f"`thaw deploys {record.deploy_id}`", file=sys.stderr)
                done.append(record.to_dict())
                continue
            print(f"{verb}ing {model_id} ({record.deploy_id}) ...", file=sys.stderr)
            try:
                record = await watch_deploy(client, record, None if args.json else DeployProgressView())
            except DeployLost as exc:
                raise AdminCommandError(str(exc), 1) from None
            if record.error is not None:  # exit 2 where a synchronous call would have been a 400
                raise AdminCommandError(f"{verb} of {model_id} failed: {record.error}",
                                        2 if record.error_kind == "invalid" else 1)
            if uploaded:
                records.forget(local, client.url)  # deployed: the platform deleted the upload
            print(f"{model_id} {'updated' if args.update else 'deployed'} in {time.perf_counter() - start:.1f} s",
                  file=sys.stderr)
            done.append(record.spec or spec)
        return done

    results = _run(args, action)
    if args.json:
        _print_json(results)
    return 0


async def _uploaded(client: AdminClient, src: Path, records: Any) -> str:
    """Uploads the source directory `src` from this machine (`infra.source_upload`); its upload id."""
    from infra.source_upload import upload_directory

    if not src.is_dir():
        raise AdminCommandError(f"source: {src} is not a directory on this machine", 2)
    try:
        return await upload_directory(client, src, records)
    except AdminApiError as exc:
        if exc.status == 400:  # a file that arrived differently: the next run starts a new upload
            records.forget(src, client.url)
        raise
    except ValueError as exc:  # it names files outside itself (loader.UnsafeModelDirError)
        raise AdminCommandError(f"source: {exc}", 2) from None


def cmd_deploys(args: argparse.Namespace) -> int:
    """``thaw deploys [ID]``: the recent deploy jobs, or one (``--wait``: followed until it ends)."""
    from infra.deploy_watch import DeployProgressView, watch_deploy

    async def action(client: AdminClient) -> list[DeployProgress]:
        if args.deploy_id is None:
            return await client.list_deploys()
        record = await client.deploy_status(args.deploy_id)
        if args.wait:
            record = await watch_deploy(client, record, None if args.json else DeployProgressView())
        return [record]

    records = _run(args, action)
    if args.json:
        _print_json([r.to_dict() for r in records])
    else:
        print_deploys(records, "no deploy remembered (the controller keeps its recent ones until it restarts)")
    return 1 if any(r.error is not None for r in records) and args.deploy_id is not None else 0


def print_deploys(records: Sequence[DeployProgress], empty: str | None = None) -> None:
    print_table(("DEPLOY", "MODEL", "ACTION", "STATE", "STAGE", "PROGRESS", "RATE", "ETA S", "ERROR"),
                [(r.deploy_id, r.model_id, r.action, r.state.value, r.stage.value, _progress(r),
                  "-" if not r.bytes_per_s else f"{_size(int(r.bytes_per_s))}/s", "-" if r.eta_s is None else f"{r.eta_s:.0f}", r.error or "")
                 for r in records], empty)


def _progress(record: DeployProgress) -> str:
    if record.num_bytes_total <= 0:
        return "-"
    return (f"{_size(record.num_bytes_done)} / {_size(record.num_bytes_total)} "
            f"({100 * record.num_bytes_done / record.num_bytes_total:.0f}%)")


def cmd_delete(args: argparse.Namespace) -> int:
    result = _run(args, lambda client: client.delete(args.model))
    print(json.dumps(result) if args.json else f"deleted {args.model}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    async def action(client: AdminClient) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return await client.list_models(args.tenant), await client.status()

    specs, status = _run(args, action)
    if args.json:
        _print_json(specs)
        return 0
    counts = {m["model_id"]: m for m in status.get("models", [])}
    rows = []
    for spec in specs:
        model_id = f"{spec['tenant']}/{spec['name']}"
        state = counts.get(model_id, {})
        scaling = spec.get("autoscaling", {})
        rows.append((model_id, f"{state.get('num_ready_instances', 0)}/{state.get('num_desired_instances', 0)}",
                     f"{scaling.get('min_instances')}..{scaling.get('max_instances')}", spec.get("dtype"),
                     spec.get("source")))
    print_table(("MODEL", "READY/DESIRED", "MIN..MAX", "DTYPE", "SOURCE"), rows, "no models deployed")
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    if args.min is None and args.max is None:
        raise UsageError("give --min and/or --max")
    result = _run(args, lambda client: client.scale(args.model, args.min, args.max))
    if args.json:
        _print_json(result)
    else:
        scaling = result.get("autoscaling", {})
        print(f"{args.model}: min_instances={scaling.get('min_instances')} "
              f"max_instances={scaling.get('max_instances')}")
    return 0


# ---- the cluster ----------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    status = _run(args, lambda client: client.status())
    if args.json:
        _print_json(status)
    else:
        print_status(status)
    return 0


def print_status(status: dict[str, Any]) -> None:
    """``thaw status``: models, instances, nodes, where each checkpoint sits, placement estimates."""
    controller = status.get("controller") or {}
    where = f", controller on node {controller['node_id']}" if controller.get("node_id") else ""
    print(f"platform {status.get('platform_id')} (namespace {status.get('namespace')}), "
          f"{status.get('num_ticks')} reconcile ticks, routing version {status.get('routing_version')}{where}")
    errors = status.get("last_tick_errors") or []
    if errors:
        print(f"last tick errors: {'; '.join(errors)}")
    running = [DeployProgress.from_dict(d) for d in status.get("deploys", []) if d.get("state") in ("pending", "running")]
    if running:
        print("\nDEPLOYS IN PROGRESS")
        print_deploys(running)
    print("\nMODELS")
    print_table(("MODEL", "READY", "LOADING", "DESIRED", "ONGOING", "QUEUED", "LAST SCALE DECISION"),
                [(m["model_id"], m["num_ready_instances"], m["num_loading_instances"], m["num_desired_instances"],
                  m["num_ongoing_requests"], m["num_queued_requests"], m.get("scale_reason"))
                 for m in status.get("models", [])], "  no models deployed")
    print("\nINSTANCES")
    print_table(("INSTANCE", "MODEL", "NODE", "STATE", "WEIGHTS FROM", "ESTIMATE S", "LOAD S", "ONGOING"),
                [(i["instance_id"], i["model_id"], i["node_id"], i["state"], _weights_from(i), i.get("estimate_s"),
                  i.get("load_s"), i.get("num_ongoing_requests")) for i in status.get("instances", [])],
                "  no instances (every model is scaled to zero)")
    nodes = status.get("nodes", [])
    print("\nNODES")
    print_table(("NODE", "KIND", "FREE/SLOTS", "WORKER MEMORY", "DRAINING", "DRAM", "SSD", "RATES dram/ssd/repository",
                 "FETCHES WAITING"),
                [(n["node_id"], _node_kind(n), f"{n['num_free_slots']}/{n['num_slots']}", _worker_memory(n),
                  "yes" if n.get("draining") else "no", _tier_usage(n, "dram"), _tier_usage(n, "ssd"), _rates(n),
                  n.get("num_fetches_waiting", 0))
                 for n in nodes], "  no nodes")
    hosts = status.get("hosts") or []
    if hosts:
        print("\nSLOT HOSTS (warm worker processes holding several models; TOKENS: each model's share of the steps)")
        print_table(("HOST", "RAY NODE", "STATE", "MEMORY", "MODELS (state, tokens)"),
                    [(h["actor_name"], h["ray_node_id"][:12], "warm" if h["warm"] else "starting",
                      _size(h["memory_bytes"]), ", ".join(f"{i['model_id']} ({i['state']}, {i['num_generated_tokens']})"
                                                          for i in h["instances"]) or "-")
                     for h in hosts])
    rows = [(entry["model"], n["node_id"], tier["tier"], _size(entry.get("num_bytes")),
             "yes" if entry.get("pinned") else "no", "filling" if entry.get("filling") else "ready")
            for n in nodes for tier in n.get("tiers", []) for entry in tier.get("entries", [])]
    print("\nCHECKPOINTS (node tiers; every deployed model is also in the repository)")
    print_table(("CHECKPOINT", "NODE", "TIER", "SIZE", "PINNED", "STATE"), rows, "  no checkpoint cached on any node")
    latest: dict[str, dict[str, Any]] = {}
    for decision in status.get("recent_decisions", []):
        if decision.get("kind") == "placement":
            latest[decision["model_id"]] = decision
    print("\nLOAD ESTIMATES (latest placement per model: seconds until ready on each node)")
    print_table(("MODEL", "NODE", "FROM TIER", "LOAD S", "WAIT S", "READY S", "FREE SLOTS", "CHOSEN"),
                [(model_id, e["node_id"], e["tier"], e["load_s"], e["wait_s"], e["ready_s"], e["num_free_slots"],
                  "*" if e["node_id"] == d.get("node_id") else "")
                 for model_id, d in sorted(latest.items()) for e in d.get("estimates", [])],
                "  no placement decided yet")
    print("\nSLOT RECLAIMS (a full node emptied by live migration for a cold model that loads fastest there)")
    print_table(("MODEL", "NODE", "FROM TIER", "EMPTYING", "REQUESTS TO", "MOVES", "COST S", "READY S", "ELSE S"),
                [(r["model_id"], r["node_id"], r["tier"], f"{r['victim_instance_id']} ({r['victim_model_id']})",
                  r["destination_instance_id"], r["num_requests"], r["cost_s"], r["ready_s"],
                  "no room" if r.get("alternative_s") is None else r["alternative_s"])
                 for r in status.get("slot_reclaims", [])], "  none under way")
    sharing = status.get("slot_sharing") or {}
    print("\nSLOTS (who holds each worker slot; the lowest eviction score gives its slot first to a waiting model)")
    print_table(("NODE", "INSTANCE", "MODEL", "STATE", "ONGOING", "IDLE S", "EVICTION SCORE"),
                [(s["node_id"], s["instance_id"], s["model_id"], s["state"], s["num_ongoing_requests"],
                  "-" if s.get("idle_s") is None else f"{s['idle_s']:.1f}",
                  "-" if s.get("eviction_score") is None else f"{s['eviction_score']:.3g}")
                 for s in sharing.get("slots", [])], "  no slot is held")
    holds = sharing.get("holds", [])
    if holds:
        print("\nSLOTS BEING FREED")
        print_table(("FOR MODEL", "NODE", "BY", "VICTIM", "HELD S"),
                    [(h["model_id"], h["node_id"], h["kind"], f"{h['victim_instance_id']} ({h['victim_model_id']})",
                      f"{h['held_s']:.1f}") for h in holds])
    print("\nSUSPENDED REQUESTS (preempted; they resume when their model next gets a slot)")
    print_table(("MODEL", "REQUEST", "SUSPENDED S"),
                [(s["model_id"], s["request_id"], f"{s['suspended_s']:.1f}") for s in sharing.get("suspended", [])],
                "  none")
    counts = sharing.get("counts") or {}
    if counts:
        print("  counts: " + ", ".join(f"{name} {value}" for name, value in counts.items()))
    shared = [d for d in status.get("recent_decisions", [])
              if d.get("kind") in ("eviction", "preemption", "suspend", "resume", "slot_hold_abandoned")]
    print("\nSLOT DECISIONS (recent evictions, preemptions, suspensions and resumes, newest last)")
    print_table(("KIND", "FOR MODEL", "REASON"), [(d["kind"], d["model_id"], d.get("reason")) for d in shared[-10:]],
                "  none yet")


def _weights_from(instance: dict[str, Any]) -> str | None:
    """Where an instance's weights came from: its node's tier, or a peer's stream (still arriving or not)."""
    path = instance.get("load_path") or {}
    if path.get("kind") != "stream":
        return instance.get("tier")
    arriving = "" if instance.get("weights_resident", True) else ", arriving"
    return f"stream from {path.get('source_instance_id')}{arriving}"


def _node_kind(node: dict) -> str:
    """"cpu", or the node's GPUs: "1x H200", "8 GPUs" where Ray names no kind."""
    num_gpus = node.get("num_gpus") or 0
    if not num_gpus:
        return "cpu"
    return f"{num_gpus}x {node['accelerator']}" if node.get("accelerator") else f"{num_gpus} GPU{'s' * (num_gpus != 1)}"


def _tier_usage(node: dict[str, Any], name: str) -> str:
    for tier in node.get("tiers", []):
        if tier["tier"] == name:
            return f"{_size(tier['used_bytes'])} / {_size(tier['capacity_bytes'])}"
    return "-"


def _worker_memory(node: dict[str, Any]) -> str:
    """Used / budget of the node's worker memory, and how many instances share it, how many of them
    asleep ("-": no budget)."""
    memory = node.get("worker_memory")
    if not memory:
        return "-"
    asleep = sum(1 for i in memory["instances"] if i.get("state") == "asleep")
    return (f"{_size(memory['used_bytes'])} / {_size(memory['budget_bytes'])} ({len(memory['instances'])} inst."
            f"{f', {asleep} asleep' if asleep else ''})")


def _rates(node: dict[str, Any]) -> str:
    rates = node.get("placement_bytes_per_s") or {}
    return " / ".join(_rate(rates.get(f"{name}_bytes_per_s")) for name in ("dram", "ssd", "repository"))


def cmd_drain(args: argparse.Namespace) -> int:
    result = _run(args, lambda client: client.drain(args.node))
    if args.json:
        _print_json(result)
    else:
        stopping = result.get("stopping") or []
        print(f"node {args.node} draining; stopping {len(stopping)} instance(s){': ' if stopping else ''}"
              f"{', '.join(stopping)}")
    return 0


def cmd_undrain(args: argparse.Namespace) -> int:
    result = _run(args, lambda client: client.undrain(args.node))
    if args.json:
        _print_json(result)
    else:
        print(f"node {args.node} takes new instances again")
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    result = _run(args, lambda client: client.migrate(args.instance, args.request, to_node=args.to_node,
                                                      to_instance=args.to_instance, method=args.method))
    if args.json:
        _print_json(result.to_dict())
        return 0
    outcomes = result.outcomes
    print(f"{result.num_migrated}/{len(outcomes)} request(s) migrated from {result.source_id} to "
          f"{result.destination_id} (node {result.node_id}, {result.method.value})")
    print_table(("REQUEST", "STATUS", "STOP S", "TOTAL S", "ERROR"),
                [(o.request_id, o.status.value, f"{o.stop_s:.4f}", f"{o.total_s:.3f}", o.error or "")
                 for o in outcomes])
    return 0


# ---- tenants and keys -----------------------------------------------------------------------


def _quota_limit(text: str) -> int | None:
    """A quota flag's value: an integer (the server checks it is >= 1), or none/unlimited."""
    if text.strip().lower() in ("none", "unlimited"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none' (no limit), got {text!r}") from None


def _limit_cell(value: int | None) -> str:
    return "unlimited" if value is None else str(value)


def cmd_tenants(args: argparse.Namespace) -> int:
    action = args.tenants_command
    if action == "ls":
        tenants = _run(args, lambda client: client.list_tenants())
        if args.json:
            _print_json(tenants)
        else:
            print_table(("TENANT", "MAX INSTANCES", "MAX QUEUED REQUESTS"),
                        [(t["tenant"], _limit_cell(t.get("max_instances")), _limit_cell(t.get("max_queued_requests")))
                         for t in tenants], "no tenants")
    elif action == "quota":
        quota = {name: getattr(args, name) for name in ("max_instances", "max_queued_requests") if hasattr(args, name)}
        if not quota:
            raise UsageError("give --max-instances and/or --max-queued-requests (a number, or none for no limit)")
        result = _run(args, lambda client: client.set_tenant_quota(args.name, quota))
        if args.json:
            _print_json(result)
        else:
            print(f"tenant {result['tenant']}: max_instances={_limit_cell(result.get('max_instances'))} "
                  f"max_queued_requests={_limit_cell(result.get('max_queued_requests'))}")
    elif action == "create":
        result = _run(args, lambda client: client.create_tenant(args.name))
        print(json.dumps(result) if args.json else
              f"tenant {args.name} {'created' if result.get('created') else 'already exists'}")
    else:
        result = _run(args, lambda client: client.delete_tenant(args.name))
        print(json.dumps(result) if args.json else f"deleted tenant {args.name} and its keys")
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    action = args.keys_command
    if action == "ls":
        keys = _run(args, lambda client: client.list_keys(args.tenant))
        if args.json:
            _print_json(keys)
        else:
            print_table(("KEY ID", "TENANT", "CREATED (UTC)"),
                        [(k["key_id"], k["tenant"], time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(k["created_s"])))
                         for k in keys], "no API keys")
    elif action == "create":
        result = _run(args, lambda client: client.create_key(args.tenant))
        if args.json:
            _print_json(result)
        else:
            print(result["api_key"])
            print(f"(key {result['key_id']} for tenant {result['tenant']}: shown once, stored hashed)", file=sys.stderr)
    else:
        result = _run(args, lambda client: client.revoke_key(args.key_id))
        print(json.dumps(result) if args.json else f"revoked key {args.key_id} of tenant {result.get('tenant')}")
    return 0


# ---- the parser -----------------------------------------------------------------------------


def add_admin_commands(sub: argparse._SubParsersAction) -> None:
    """Registers the admin subcommands on the ``thaw`` parser."""
    from controller import add_model_spec_arguments

    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("platform")
    group.add_argument("--url", default=None, help="the gateway (default: $THAW_URL, the running platform's, "
                                                    "or http://127.0.0.1:8000)")
    group.add_argument("--admin-key", default=None, help="the admin key (default: $THAW_ADMIN_KEY or the state "
                                                          "directory's admin_key file)")
    group.add_argument("--state", default=str(default_state_dir()),
                       help="the platform's state directory, where its URL and admin key are found "
                            "(default: $THAW_STATE_DIR or ~/.thaw)")
    group.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for an answer")
    group.add_argument("--json", action="store_true", help="print the API's JSON instead of a table")

    deploy = sub.add_parser("deploy", parents=[common], help="deploy (or --update) a model from a spec file or flags")
    deploy.add_argument("file", nargs="?", default=None, help="spec file (YAML or JSON; one model or a list)")
    deploy.add_argument("--update", action="store_true", help="replace the spec of a deployed model")
    where = deploy.add_mutually_exclusive_group()
    where.add_argument("--upload", dest="upload", action="store_const", const="always", default="auto",
                       help="send --source's directory from this machine through the admin API (resumable; the "
                            "default when the platform is on another machine)")
    where.add_argument("--no-upload", dest="upload", action="store_const", const="never",
                       help="--source is a path on the controller's machine (the default when the platform runs here)")
    deploy.add_argument("--no-wait", action="store_true",
                        help="start the deploy job and exit at once, printing its id (follow it with `thaw deploys ID`)")
    add_model_spec_arguments(deploy)
    deploy.set_defaults(func=cmd_deploy)

    deploys = sub.add_parser("deploys", parents=[common], help="the recent deploy jobs, or one of them")
    deploys.add_argument("deploy_id", nargs="?", default=None, help="a deploy's id (as thaw deploy printed it)")
    deploys.add_argument("--wait", action="store_true", help="follow that deploy with a progress bar until it ends")
    deploys.set_defaults(func=cmd_deploys)

    delete = sub.add_parser("delete", parents=[common], help="delete a model and stop its instances")
    delete.add_argument("model", help="tenant/name")
    delete.set_defaults(func=cmd_delete)

    listing = sub.add_parser("list", parents=[common], help="list deployed models")
    listing.add_argument("--tenant", default=None)
    listing.set_defaults(func=cmd_list)

    status = sub.add_parser("status", parents=[common],
                            help="models, instances, nodes, cached checkpoints and placement estimates")
    status.set_defaults(func=cmd_status)

    scale = sub.add_parser("scale", parents=[common], help="change a model's instance bounds")
    scale.add_argument("model", help="tenant/name")
    scale.add_argument("--min", type=int, default=None, help="fewest instances (0 lets it scale to zero)")
    scale.add_argument("--max", type=int, default=None, help="most instances")
    scale.set_defaults(func=cmd_scale)

    drain = sub.add_parser("drain", parents=[common], help="stop placing on a node and move its instances away")
    drain.add_argument("node", help="node id (see thaw status)")
    drain.set_defaults(func=cmd_drain)

    undrain = sub.add_parser("undrain", parents=[common], help="let placement use a drained node again")
    undrain.add_argument("node", help="node id (see thaw status)")
    undrain.set_defaults(func=cmd_undrain)

    migrate = sub.add_parser("migrate", parents=[common],
                             help="live-migrate a request, or all of an instance's, to another instance")
    migrate.add_argument("instance", help="the instance the requests run on (see thaw status)")
    migrate.add_argument("--request", default=None, help="one request id (default: every request of the instance)")
    where = migrate.add_mutually_exclusive_group()
    where.add_argument("--to-node", default=None, help="to the least-loaded ready instance on this node")
    where.add_argument("--to-instance", default=None, help="to this instance (same model, ready)")
    migrate.add_argument("--method", choices=("kv", "tokens"), default="kv",
                         help="copy the KV blocks (default) or recompute them from the tokens")
    migrate.set_defaults(func=cmd_migrate)

    tenants = sub.add_parser("tenants", help="tenants: ls, create NAME, delete NAME, quota NAME")
    tenants_sub = tenants.add_subparsers(dest="tenants_command", required=True, metavar="SUBCOMMAND")
    tenants_sub.add_parser("ls", parents=[common], help="list tenants and their quotas").set_defaults(func=cmd_tenants)
    for name, text in (("create", "create a tenant"), ("delete", "delete a tenant (it must have no models)")):
        parser = tenants_sub.add_parser(name, parents=[common], help=text)
        parser.add_argument("name")
        parser.set_defaults(func=cmd_tenants)
    quota = tenants_sub.add_parser("quota", parents=[common],
                                   help="set a tenant's limits (the flags given; the others are kept)")
    quota.add_argument("name")
    quota.add_argument("--max-instances", type=_quota_limit, default=argparse.SUPPRESS,
                       help="instances loading or ready at once, over all its models (none: no limit)")
    quota.add_argument("--max-queued-requests", type=_quota_limit, default=argparse.SUPPRESS,
                       help="requests waiting for instances in a gateway, over all its models; past it "
                            "they get 429 (none: no limit)")
    quota.set_defaults(func=cmd_tenants)

    keys = sub.add_parser("keys", help="API keys: ls [--tenant], create TENANT, revoke KEY_ID")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="SUBCOMMAND")
    ls = keys_sub.add_parser("ls", parents=[common], help="list keys (ids only; keys are stored hashed)")
    ls.add_argument("--tenant", default=None)
    ls.set_defaults(func=cmd_keys)
    create = keys_sub.add_parser("create", parents=[common], help="make a key for a tenant (printed once)")
    create.add_argument("tenant")
    create.set_defaults(func=cmd_keys)
    revoke = keys_sub.add_parser("revoke", parents=[common], help="revoke a key by its id")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=cmd_keys)
