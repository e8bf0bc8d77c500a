"""The ``thaw`` command line.

Each subcommand is a small function over the public APIs of the other folders; argument
errors exit with status 2 and a message naming the flag, runtime failures with status 1 and
a one-line ``error:`` message (the traceback only with ``--debug``), so scripts can rely on
exit codes and humans get something actionable.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from infra.cli_errors import AdminCommandError, UsageError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def _cmd_demo_model(args: argparse.Namespace) -> int:
    from worker import DemoModelConfig, write_demo_model

    out_dir = Path(args.dir)
    if args.exist_ok and (out_dir / "config.json").is_file() and (out_dir / "model.safetensors").is_file():
        print(f"demo model already present in {out_dir}", file=sys.stderr)
        return EXIT_OK
    try:
        config = DemoModelConfig(
            hidden_size=args.hidden_size, num_hidden_layers=args.layers, seed=args.seed, dtype=args.dtype
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    start = time.perf_counter()
    try:
        path = write_demo_model(out_dir, config, overwrite=args.overwrite)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    print(
        f"wrote a demo Llama model to {path} in {time.perf_counter() - start:.1f} s\n"
        "note: its weights are random, so it produces gibberish; it exists to exercise the platform "
        "without downloading anything.",
        file=sys.stderr,
    )
    return EXIT_OK


def _cmd_generate(args: argparse.Namespace) -> int:
    from worker import Engine, EngineConfig, InvalidRequestError, SamplingParams
    from worker.loading.host_allocator import tune_host_allocator

    tune_host_allocator()  # this process runs one engine and exits

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            seed=args.seed, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos,
        )
        config = EngineConfig(dtype=args.dtype, device=args.device)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if not args.prompt:
        raise UsageError("prompt must not be empty")
    engine = Engine(args.model_dir, config)
    print(f"[thaw] loaded {Path(args.model_dir).name} in {engine.load_s:.2f} s ({engine.load_report})", file=sys.stderr)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    try:
        request_id = engine.add_request(prompt, params)
    except InvalidRequestError as exc:
        raise UsageError(str(exc)) from exc
    start = time.perf_counter()
    first_token_s = None
    num_tokens, finish_reason, text_parts = 0, None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if first_token_s is None and out.new_token_ids:
                first_token_s = time.perf_counter() - start
            num_tokens = out.num_output_tokens
            text_parts.append(out.new_text)
            if not args.json:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            if out.finished:
                finish_reason = out.finish_reason
    elapsed = time.perf_counter() - start
    if args.json:
        print(json.dumps({"text": "".join(text_parts), "num_output_tokens": num_tokens,
                          "finish_reason": finish_reason, "elapsed_s": round(elapsed, 4)}))
    else:
        sys.stdout.write("\n")
        rate = num_tokens / elapsed if elapsed > 0 else 0.0
        print(f"[thaw] {num_tokens} tokens, finish_reason={finish_reason}, first token "
              f"{(first_token_s or 0) * 1000:.0f} ms, {rate:.1f} tokens/s", file=sys.stderr)
    return EXIT_OK


def _cmd_convert(args: argparse.Namespace) -> int:
    from loader import convert_checkpoint

    src, dst = Path(args.hf_dir), Path(args.out_dir)
    if not src.is_dir():
        raise UsageError(f"source model directory not found: {src}")
    start = time.perf_counter()
    try:
        index = convert_checkpoint(src, dst, dtype=args.dtype, overwrite=args.overwrite, progress=not args.quiet)
    except FileExistsError as exc:
        raise UsageError(f"{dst} exists and is not empty; pass --overwrite to replace it") from exc
    except (ValueError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from exc
    total = sum(p.size for p in index.partitions)
    print(f"converted {src} -> {dst}: {len(index.tensors)} tensors, {total / 1e9:.2f} GB in "
          f"{len(index.partitions)} partition(s), {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return EXIT_OK


def _open_models_repository(args: argparse.Namespace):
    """The repository at ``args.uri`` (a directory or s3://bucket/prefix); bad input is a UsageError."""
    from storage import RepositoryConfig, open_repository

    try:
        config = RepositoryConfig(uri=args.uri, endpoint_url=args.endpoint_url)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    return open_repository(config)


def _cmd_models_push(args: argparse.Namespace) -> int:
    from storage import InvalidModelNameError, ModelExistsError

    src = Path(args.src)
    if not src.is_dir():
        raise UsageError(f"source model directory not found: {src}")
    name = args.name or src.resolve().name
    repository = _open_models_repository(args)
    start = time.perf_counter()
    try:
        manifest = repository.push(src, name, overwrite=args.overwrite)
    except InvalidModelNameError as exc:
        raise UsageError(f"{exc}{'' if args.name else ' (taken from the directory name; pass --name)'}") from exc
    except ModelExistsError as exc:
        raise UsageError(f"model {name!r} already exists in {repository.uri}; pass --overwrite to replace it") from exc
    except ValueError as exc:  # neither a thaw checkpoint nor a Hugging Face safetensors dir
        raise UsageError(str(exc)) from exc
    print(f"pushed {name} ({manifest.kind}, {len(manifest.files)} files, {manifest.total_bytes / 1e6:,.1f} MB) "
          f"to {repository.uri} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return EXIT_OK


def _cmd_models_ls(args: argparse.Namespace) -> int:
    manifests = _open_models_repository(args).list_models()
    if args.json:
        print(json.dumps([{"model": m.model, "kind": m.kind, "num_files": len(m.files), "total_bytes": m.total_bytes,
                           "pushed_at": m.pushed_at} for m in manifests]))
        return EXIT_OK
    if not manifests:
        print(f"no models in {args.uri}", file=sys.stderr)
        return EXIT_OK
    width = max(len("MODEL"), *(len(m.model) for m in manifests))
    print(f"{'MODEL':<{width}}  KIND  FILES  {'SIZE (MB)':>12}  PUSHED (UTC)")
    for m in manifests:
        pushed = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(m.pushed_at))
        print(f"{m.model:<{width}}  {m.kind:<4}  {len(m.files):>5}  {m.total_bytes / 1e6:>12,.1f}  {pushed}")
    return EXIT_OK


def _cmd_keygen(args: argparse.Namespace) -> int:
    """A fresh key in the platform's form, for `thaw serve --admin-key-file` (kept in a secret store)."""
    from controller import new_api_key

    print(new_api_key())
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="thaw", description="Thaw: serverless multi-model LLM serving")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo-model", help="write a small random-weight Llama model (Hugging Face format)")
    demo.add_argument("dir", help="output directory (must be empty or absent)")
    demo.add_argument("--overwrite", action="store_true", help="replace a non-empty directory")
    demo.add_argument("--exist-ok", action="store_true", help="do nothing if a model is already there")
    demo.add_argument("--hidden-size", type=int, default=256)
    demo.add_argument("--layers", type=int, default=4)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    demo.set_defaults(func=_cmd_demo_model)

    conv = sub.add_parser("convert", help="convert a Hugging Face safetensors model to the thaw loading format")
    conv.add_argument("hf_dir", help="Hugging Face model directory (model.safetensors or sharded with an index)")
    conv.add_argument("out_dir", help="output directory (created atomically: it appears only when complete)")
    conv.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                      help="cast floating-point weights (default: keep the source dtype)")
    conv.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    conv.add_argument("--quiet", action="store_true", help="no progress output")
    conv.set_defaults(func=_cmd_convert)

    gen = sub.add_parser("generate", help="generate text from a model directory, streamed to the terminal")
    gen.add_argument("model_dir", help="model directory: Hugging Face (safetensors) or thaw format (thaw convert)")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    gen.set_defaults(func=_cmd_generate)

    models = sub.add_parser("models", help="the model repository (a directory or s3://bucket/prefix)")
    models_sub = models.add_subparsers(dest="models_command", required=True, metavar="SUBCOMMAND")
    endpoint_help = ("S3-compatible endpoint, e.g. http://localhost:9000 (default: AWS_ENDPOINT_URL or AWS); "
                     "credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or a profile")
    push = models_sub.add_parser("push", help="upload a Hugging Face or thaw-format model dir to a repository")
    push.add_argument("src", help="model directory: Hugging Face (safetensors) or thaw format")
    push.add_argument("uri", help="repository: a directory path or s3://bucket/prefix")
    push.add_argument("--name", default=None, help="model name in the repository (default: the directory's name)")
    push.add_argument("--overwrite", action="store_true", help="replace a model of that name")
    push.add_argument("--endpoint-url", default=None, help=endpoint_help)
    push.set_defaults(func=_cmd_models_push)
    ls = models_sub.add_parser("ls", help="list the complete models in a repository")
    ls.add_argument("uri", help="repository: a directory path or s3://bucket/prefix")
    ls.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    ls.add_argument("--endpoint-url", default=None, help=endpoint_help)
    ls.set_defaults(func=_cmd_models_ls)

    keygen = sub.add_parser("keygen", help="print a new API key (for thaw serve --admin-key-file, e.g. a Kubernetes "
                                           "Secret); nothing is stored")
    keygen.set_defaults(func=_cmd_keygen)

    # Running and operating a platform (infra/cli_serve.py, infra/cli_admin.py).
    from infra.cli_admin import add_admin_commands
    from infra.cli_join import add_join_command
    from infra.cli_serve import add_serve_command

    add_serve_command(sub)
    add_join_command(sub)
    add_admin_commands(sub)
    from sim import add_simulate_command  # the trace-driven simulator (sim/)

    add_simulate_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"thaw {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except AdminCommandError as exc:
        print(f"thaw {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI's last line of defence
        if args.debug:
            raise
        print(f"thaw {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
