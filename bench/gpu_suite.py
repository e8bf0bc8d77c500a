"""Every GPU measurement in one command: the CUDA tests and the GPU benchmarks, for a lent GPU.

A GPU machine is lent only by chance and briefly (issue 26), so one command does it all within
``--budget-s`` (default 1100 s, ~18 min): it installs the loader peers' wheels carried in
``.whl/`` (``pip install --no-index --no-deps --target``, into the work dir, put on PYTHONPATH for
the steps), then runs each step of `STEPS` as a subprocess with its own timeout (never more than
the budget left), and writes under ``--out``:

* ``results.jsonl``: every JSON line a step printed, tagged with its ``step``, the suite's own
  record of each step (status, seconds, command) and one line per peer that cannot run there;
* ``suite.log``: every step's full stdout and stderr, one after another;
* ``summary.md``: the table `bench.gpu_summary.summary_table` builds (printed at the end too);
* ``pytest-cuda.xml``, ``pytest-cuda-files.xml``: pytest's JUnit reports.

Five files, no folder: the lent machine sends back at most 8 files. All are rewritten after each
step, so a run cut short still returns what it measured. The steps:

* ``pytest-cuda``: ``pytest -m cuda`` over tests/ (modules that cannot import there -- storage
  needs boto3, the controller Ray -- are counted as not collected, not as failures);
* ``pytest-cuda-files``: the unmarked tests of the files that run on CUDA when it is there
  (`CUDA_TEST_FILES`; their marked tests ran in ``pytest-cuda``);
* ``kernels``, ``loader_gpu``, ``engine_gpu``, ``coldstart_gpu``: the benchmarks of those names
  (decode attention vs HBM peak; loading to the GPU vs the peers; the engine vs transformers;
  cold start to the first token from DRAM and SSD vs the Serve replica's path);
* ``gpu_platform``: the platform itself on the GPU (`bench/gpu_platform.py`: five models in one
  slot host, the 8B's first token asleep, from DRAM and in a fresh host); it needs Ray, Serve and
  the openai client, which the machine lacks: ``../shared/gpu/pack_wheels.sh OUT openai`` packs
  them, and its install.sh puts them in /tmp/site, on PYTHONPATH for the steps (its quick mode
  runs tiny models on the GPU).

``--dry-run`` (any machine) lists the steps with their commands and checks that each step's
modules import -- those it names and those its script imports at top level -- and exits 1 with
the list of what does not (or of a step script that does not exist). Peers a step can do without are listed apart and never fail it.

    python bench/gpu_suite.py [--out DIR] [--only a,b] [--quick] [--budget-s S] [--work-dir DIR] [--dry-run]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
import zipfile
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import RAY_SERVE_NOT_RUN, ROOT, VLLM_NOT_RUN  # noqa: E402
from bench.gpu_summary import summary_table  # noqa: E402

DEFAULT_BUDGET_S = 1100.0
MIN_STEP_S = 30.0  # a step is not started with less budget than this left
INSTALL_TIMEOUT_S = 180.0
CUDA_TEST_FILES = ("tests/kernels/test_triton_attention.py", "tests/worker/engine/test_engine_vs_transformers.py",
                   "tests/worker/engine/test_engine.py")
PEERS_NOT_RUN = {"vllm-cuda": VLLM_NOT_RUN, "ray-serve": RAY_SERVE_NOT_RUN}


@dataclass(frozen=True)
class Step:
    """One subprocess of the suite: ``python <args>`` from the repository root. ``{out}`` and
    ``{work}`` in `args` become the output and work directories."""

    name: str
    args: tuple[str, ...]
    timeout_s: float
    modules: tuple[str, ...]  # must import, or the step cannot run
    quick_args: tuple[str, ...] = ()
    optional_modules: tuple[str, ...] = ()  # peers the step reports as skipped when absent
    script: str | None = None  # its benchmark file (its top-level imports are checked too)
    junit: str | None = None  # pytest's JUnit report, a file name under --out


STEPS: tuple[Step, ...] = (
    Step("pytest-cuda", ("-m", "pytest", "-q", "-m", "cuda", "--continue-on-collection-errors", "-p", "no:cacheprovider",
                         "--junitxml={out}/pytest-cuda.xml", "tests"), 300,
         ("pytest", "pytest_timeout", "torch", "triton", "kernels", "worker", "loader"), junit="pytest-cuda.xml"),
    Step("pytest-cuda-files", ("-m", "pytest", "-q", "-m", "not cuda", "-p", "no:cacheprovider",
                               "--junitxml={out}/pytest-cuda-files.xml", *CUDA_TEST_FILES), 300,
         ("pytest", "pytest_timeout", "torch", "triton", "transformers", "kernels", "worker"),
         junit="pytest-cuda-files.xml"),
    Step("kernels", ("bench/kernels.py",), 180, ("torch", "triton", "kernels"), ("--quick",),
         script="bench/kernels.py"),
    Step("loader_gpu", ("bench/loader_gpu.py",), 240, ("torch", "safetensors", "loader"), ("--quick",),
         optional_modules=("fastsafetensors", "runai_model_streamer"), script="bench/loader_gpu.py"),
    Step("engine_gpu", ("bench/engine_gpu.py", "--work-dir", "{work}"), 300,
         ("torch", "triton", "transformers", "worker", "kernels"), ("--quick",), script="bench/engine_gpu.py"),
    Step("coldstart_gpu", ("bench/coldstart_gpu.py", "--work-dir", "{work}"), 300,
         ("torch", "transformers", "worker", "loader"), ("--quick",), script="bench/coldstart_gpu.py"),
    # The platform itself: Ray, Serve and the openai client come from the packed wheels
    # (../shared/gpu/pack_wheels.sh OUT openai), installed into /tmp/site and put on PYTHONPATH.
    Step("gpu_platform", ("bench/gpu_platform.py",), 600,
         ("torch", "safetensors", "ray", "ray.serve", "openai", "aiohttp", "infra.cli", "infra.admin_client",
          "controller", "worker", "loader", "storage"), ("--quick", "--device", "cuda"),
         script="bench/gpu_platform.py"),
)
STEP_NAMES = tuple(step.name for step in STEPS)


def step_command(step: Step, out_dir: Path, work_dir: Path, quick: bool) -> list[str]:
    args = [a.format(out=out_dir, work=work_dir) for a in step.args]
    return [sys.executable, *args, *(step.quick_args if quick else ())]


def script_imports(path: Path) -> list[str]:
    """Modules a script imports at its top level, standard library left out."""
    modules = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.append(node.module)
    return [m for m in dict.fromkeys(modules)
            if m.split(".")[0] not in sys.stdlib_module_names and m != "__future__"]


def step_env(site_dir: Path | None) -> dict[str, str]:
    paths = [str(site_dir)] if site_dir is not None else []
    paths += [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


def import_errors(modules: list[str], env: dict[str, str]) -> dict[str, str]:
    """module -> why it does not import, checked in one fresh interpreter with the steps' env."""
    code = ("import importlib, json, sys\nerrors = {}\nfor name in json.loads(sys.argv[1]):\n"
            "    try:\n        importlib.import_module(name)\n"
            "    except BaseException as exc:\n        errors[name] = f'{type(exc).__name__}: {exc}'\n"
            "print(json.dumps(errors))\n")
    result = subprocess.run([sys.executable, "-c", code, json.dumps(modules)], capture_output=True, text=True,
                            env=env, cwd=ROOT, timeout=600)
    if result.returncode != 0:
        return {name: f"the import check crashed: {result.stderr.strip()[-300:]}" for name in modules}
    return json.loads(result.stdout.strip().splitlines()[-1])


def dry_run(steps: list[Step], out_dir: Path, quick: bool) -> int:
    """Lists the steps and checks their imports here; 0 when every step can start, else 1."""
    wheels = sorted(p.name for p in (ROOT / ".whl").glob("*.whl"))
    print(f"install: {', '.join(wheels) or 'no wheels in .whl/'} (pip install --no-index --no-deps --target "
          f"<work>/site, on PYTHONPATH for the steps)")
    for peer, reason in PEERS_NOT_RUN.items():
        print(f"peer {peer}: {reason}")
    problems: list[str] = []
    required = {}
    for step in steps:
        modules = list(step.modules)
        if step.script is not None:
            if (ROOT / step.script).is_file():
                modules += [m for m in script_imports(ROOT / step.script) if m not in modules]
            else:
                problems.append(f"{step.name}: its script {step.script} does not exist")
        required[step.name] = modules
    optional = sorted({m for step in steps for m in step.optional_modules})
    errors = import_errors(sorted({m for ms in required.values() for m in ms} | set(optional)), step_env(None))
    for step in steps:
        print(f"\nstep {step.name} (timeout {step.timeout_s:.0f} s):\n  "
              + shlex.join(step_command(step, out_dir, Path("<work>"), quick)))
        print("  needs: " + ", ".join(f"{m} {'MISSING' if m in errors else 'ok'}" for m in required[step.name]))
        problems += [f"{step.name}: {m} does not import ({errors[m]})" for m in required[step.name] if m in errors]
        for module in step.optional_modules:
            wheel = next((w for w in wheels if w.split("-")[0].replace("-", "_").lower() == module), None)
            state = "ok" if module not in errors else (f"missing here; .whl/{wheel} provides it" if wheel
                                                        else "missing; the step reports it skipped")
            print(f"  peer {module}: {state}")
    if problems:
        print(f"\n{len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))
        return 1
    print(f"\nall {len(steps)} steps can start: every module they need imports")
    return 0


# ---- running -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepRun:
    returncode: int | None  # None: killed at its timeout
    duration_s: float
    stdout: str
    stderr: str


def run_command(cmd: list[str], env: dict[str, str], timeout_s: float) -> StepRun:
    """Runs `cmd` in its own process group; at the timeout the whole group is killed and what it
    printed so far is kept."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        returncode: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
        returncode = None
    return StepRun(returncode, time.monotonic() - start, out, err)


def json_lines(text: str) -> list[dict]:
    lines = []
    for raw in text.splitlines():
        if raw.startswith("{"):
            try:
                value = json.loads(raw)
            except ValueError:
                continue
            if isinstance(value, dict):
                lines.append(value)
    return lines


def junit_counts(path: Path) -> dict:
    """passed / failed / errors / skipped / not collected (modules whose import failed), with the
    ids of what failed, from a pytest JUnit report."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "not_collected": 0}
    failed_ids, not_collected = [], []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        error = case.find("error")
        if case.find("failure") is not None:
            counts["failed"] += 1
            failed_ids.append(test_id)
        elif error is not None and error.get("message", "") == "collection failure":
            counts["not_collected"] += 1
            why = [line.removeprefix("E").strip() for line in (error.text or "").splitlines() if line.strip()]
            not_collected.append(f"{test_id} ({why[-1]})" if why else test_id)
        elif error is not None:
            counts["errors"] += 1
            failed_ids.append(test_id)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failed_ids": failed_ids[:50], "not_collected_modules": not_collected}


class SuiteOutput:
    """The files under --out, rewritten after each step (a run cut short still leaves them)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.records: list[dict] = []
        self.lines: list[dict] = []
        (out_dir / "suite.log").write_text("")

    def add(self, record: dict, lines: list[dict], log_text: str = "") -> None:
        self.records.append(record)
        self.lines += [{"step": record["step"], **line} for line in lines]
        with open(self.out_dir / "suite.log", "a", encoding="utf-8") as log:
            log.write(log_text)
        with open(self.out_dir / "results.jsonl", "w", encoding="utf-8") as results:
            for item in [*self.lines, *({"suite": "gpu_suite", **r} for r in self.records)]:
                results.write(json.dumps(item) + "\n")
        (self.out_dir / "summary.md").write_text(self.table())

    def table(self) -> str:
        return summary_table(self.records, self.lines)


def install_wheels(work_dir: Path, output: SuiteOutput) -> Path | None:
    """Installs .whl/*.whl into <work>/site; returns that dir, or None when there is nothing there."""
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if not wheels:
        output.add({"step": "install", "status": "nothing to install", "duration_s": 0.0, "detail": "no .whl/*.whl"}, [])
        return None
    site = work_dir / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--disable-pip-version-check", "-q",
           "--target", str(site), *map(str, wheels)]
    run = run_command(cmd, dict(os.environ), INSTALL_TIMEOUT_S)
    status = "ok" if run.returncode == 0 else "failed"
    detail = ", ".join(w.name.split("-")[0] for w in wheels)
    if run.returncode != 0 and "No module named pip" in run.stderr:
        # No pip there: a wheel is a zip whose top level is what --target would install.
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(site)
        status, detail = "ok", detail + " (unzipped: no pip)"
    output.add({"step": "install", "status": status, "duration_s": round(run.duration_s, 1), "detail": detail,
                "command": shlex.join(cmd)}, [], _log_block("install", cmd, run))
    return site if status == "ok" else None


def _log_block(name: str, cmd: list[str], run: StepRun) -> str:
    return (f"===== {name}: {shlex.join(cmd)}\n===== exit {run.returncode} after {run.duration_s:.1f} s\n"
            f"----- stdout\n{run.stdout}\n----- stderr\n{run.stderr}\n")


def run_step(step: Step, cmd: list[str], env: dict[str, str], timeout_s: float, output: SuiteOutput) -> None:
    run = run_command(cmd, env, timeout_s)
    lines = json_lines(run.stdout)
    if run.returncode is None:
        status = f"timeout after {timeout_s:.0f} s"
    else:
        status = "ok" if run.returncode == 0 else f"failed (exit {run.returncode})"
    detail = f"{len(lines)} JSON lines"
    junit = output.out_dir / step.junit if step.junit else None
    if junit is not None and junit.is_file():
        counts = junit_counts(junit)
        lines = [{"bench": "pytest", **counts}]
        detail = ", ".join(f"{counts[k]} {k.replace('_', ' ')}" for k in
                           ("passed", "failed", "errors", "skipped", "not_collected"))
        if run.returncode is not None:  # modules that cannot import there are not failures
            status = "ok" if counts["failed"] == counts["errors"] == 0 else "failed"
    elif run.returncode != 0:
        detail += "; " + (run.stderr.strip().splitlines() or ["no stderr"])[-1]
    record = {"step": step.name, "status": status, "duration_s": round(run.duration_s, 1), "detail": detail,
              "rc": run.returncode, "command": shlex.join(cmd)}
    output.add(record, lines, _log_block(step.name, cmd, run))
    print(f"[gpu_suite] {step.name}: {status} in {run.duration_s:.1f} s ({detail})", file=sys.stderr, flush=True)


def run_suite(steps: list[Step], out_dir: Path, work_dir: Path, quick: bool, budget_s: float) -> SuiteOutput:
    deadline = time.monotonic() + budget_s
    output = SuiteOutput(out_dir)
    output.add({"step": "peers", "status": "not run", "duration_s": None},
               [{"peer": peer, "skipped": reason} for peer, reason in PEERS_NOT_RUN.items()])
    env = step_env(install_wheels(work_dir, output))
    for step in steps:
        left_s = deadline - time.monotonic()
        if left_s < MIN_STEP_S:
            output.add({"step": step.name, "status": "skipped", "duration_s": None,
                        "detail": f"budget spent ({left_s:.0f} s left of {budget_s:.0f}); raise --budget-s or use --only"},
                       [])
            continue
        cmd = step_command(step, out_dir, work_dir, quick)
        print(f"[gpu_suite] {step.name}: {shlex.join(cmd)} (timeout {min(step.timeout_s, left_s):.0f} s)",
              file=sys.stderr, flush=True)
        run_step(step, cmd, env, min(step.timeout_s, left_s), output)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_suite_out"),
                        help="where results go (default: $OUT if set, else ./gpu_suite_out)")
    parser.add_argument("--only", default=None, help=f"comma-separated steps to run, of: {', '.join(STEP_NAMES)}")
    parser.add_argument("--quick", action="store_true", help="each benchmark's --quick mode")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="total seconds for all steps")
    parser.add_argument("--work-dir", type=Path, default=None, help="models and installed wheels (default: temp)")
    parser.add_argument("--dry-run", action="store_true", help="list the steps and check their imports; run nothing")
    args = parser.parse_args(argv)
    steps = list(STEPS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in STEP_NAMES]
        if unknown:
            parser.error(f"unknown step(s) {', '.join(unknown)}; choose from {', '.join(STEP_NAMES)}")
        steps = [s for s in STEPS if s.name in names]
    if args.budget_s < MIN_STEP_S:
        parser.error(f"--budget-s must be at least {MIN_STEP_S:.0f}")
    out_dir = args.out.resolve()
    if args.dry_run:
        return dry_run(steps, out_dir, args.quick)
    work_dir = args.work_dir.resolve() if args.work_dir else Path(tempfile.mkdtemp(prefix="thaw-gpu-suite-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        output = run_suite(steps, out_dir, work_dir, args.quick, args.budget_s)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)
    print(output.table(), end="")
    print(f"\nresults in {out_dir}: {', '.join(sorted(p.name for p in out_dir.iterdir()))}")
    return 0 if all(r["status"] in ("ok", "not run", "nothing to install") for r in output.records) else 1


if __name__ == "__main__":
    sys.exit(main())
