"""`llm-serving`: package, publish, serve, `up` (what `make up` runs), `rollout`, `rehearse` (`make rehearse`), `batch`.

Heavy imports (vLLM, torch) happen inside the commands that need them, so `llm-serving package` and `publish` run in
either virtual environment.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from rich.console import Console

from dev_packages.make_up import DEMO_ENGINE_ARGS, publish_for_up
from llm_serving.manifest import Backend, ParallelLayout, ServingMode
from llm_serving.package import PackageError, PackageSpec, build_package
from llm_serving.store import PublishError, open_store
from llm_serving.up_layout import ENV_BATCH_STORE, up_batch_store, up_cache

console = Console(stderr=True)
REPO_CACHE = up_cache()


def _engine_arg(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--engine-arg {text!r}: expected KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _model_id_from_dir(path: Path) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", path.resolve().name.lower()).strip("-")[:63].strip("-")
    return name or "model"


def _step(text: str) -> tuple[str, str]:
    model_id, sep, version = text.partition("=")
    if not sep or not model_id or not version:
        raise argparse.ArgumentTypeError(f"--step {text!r}: expected MODEL_ID=VERSION")
    return model_id, version


def cmd_package(args: argparse.Namespace) -> int:
    spec = PackageSpec(
        model_dir=args.model_dir,
        model_id=args.id,
        version=args.version,
        backend=Backend(args.backend),
        serving_mode=ServingMode(args.serving_mode),
        engine_args=dict(args.engine_arg or []),
        parallel=ParallelLayout(tensor=args.tensor_parallel, pipeline=args.pipeline_parallel,
                                data=args.data_parallel),
        plugins=tuple(args.plugin or ()),
        python_model=args.python_model,
        config_pbtxt=args.config_pbtxt,
        python_dependencies=tuple(args.python_dependency or ()),
        execution_env=args.execution_env,
        ensemble_config=args.ensemble_config,
        ensemble_steps=tuple(args.step or ()),
    )
    with console.status(f"packaging {args.id} {args.version}"):
        out = build_package(spec, args.out)
    console.print(f"[green]package[/] {out}")
    print(out)
    return 0


def cmd_publish(args: argparse.Namespace) -> int:
    from llm_serving_cli.warm_wait import check_regions, wait_resident

    store = open_store(args.store, args.model_cache, REPO_CACHE / "store")
    regions = list(dict.fromkeys(args.warm_region or []))
    s3_store = check_regions(store, regions, args.home_region) if regions else None
    with console.status(f"publishing {args.package}"):
        published = store.publish(args.package)
    state = "already published (identical)" if published.already_published else "published"
    console.print(f"[green]{state}[/] {published.model_id} {published.version}")
    console.print(f"  package:     {published.package_uri}\n  model cache: {published.model_cache_uri}")
    if s3_store is not None:
        console.print(f"  warm request: {s3_store.request_warm(published, regions)}")
        if args.wait_materialised:
            cold = wait_resident(s3_store, published, args.home_region, regions, args.wait_timeout, 15.0, console)
            if cold:
                console.print(f"[red]not resident after {args.wait_timeout:g} s[/] (rollouts there are refused "
                              f"until it is):\n  " + "\n  ".join(f"{r}: {why}" for r, why in cold.items()))
                print(json.dumps(published.__dict__))
                return 1
    print(json.dumps(published.__dict__))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from serving_image.startup import StartupConfig, run

    config = StartupConfig(package=args.package, workdir=args.workdir or REPO_CACHE / "run")
    return run(config, on_ready=_print_ready)


def _print_ready(started) -> None:
    info = started.served_model.info
    console.rule(f"[bold green]serving {info.name} {info.version}")
    openai_mode = started.package.manifest.serving_mode is ServingMode.OPENAI
    console.print(
        ("  OpenAI API     http://localhost:9000/v1   (models, completions, chat/completions)\n"
         "  readiness      http://localhost:9000/health/ready\n"
         "  metrics        http://localhost:8002/metrics   (Triton's nv_* + vLLM)\n"
         if openai_mode else
         f"  serving mode   standalone: NVIDIA's tritonserver "
         f"{getattr(started.served_model, 'server_version', '')} owns the KServe ports, no OpenAI front-end\n"
         "  metrics        http://localhost:8002/metrics   (Triton's nv_* + vLLM)\n") +
        "  KServe v2      http://localhost:8000/v2 (health, metadata, generate)   gRPC localhost:8001 "
        "(tritonclient; stream with ModelStreamInfer)\n"
    )
    for package in [started.package, *getattr(started, "companions", [])]:
        ident = package.manifest.model
        console.print(f"  model          {ident.id} {ident.version} ({ident.backend})", markup=False, highlight=False)
    example = json.dumps({"model": info.name, "messages": [{"role": "user", "content": "Say hello"}],
                          "max_tokens": 32, "response_format": {"type": "json_schema", "json_schema": {
                              "name": "greeting", "schema": {"type": "object", "properties": {
                                  "greeting": {"type": "string", "maxLength": 20}}, "required": ["greeting"]}}}})
    console.print("Try:", style="bold")
    if openai_mode:
        console.print(f"  curl -s http://localhost:9000/v1/chat/completions -H 'Content-Type: application/json' \\\n"
                      f"       -d '{example}'", markup=False, highlight=False, soft_wrap=True)
    kserve = json.dumps({"text_input": "Say hello", "parameters": {"max_tokens": 16}, "return_num_output_tokens": True})
    console.print(f"  curl -s http://localhost:8000/v2/models/{info.name}/generate -d '{kserve}'", markup=False,
                  highlight=False, soft_wrap=True)
    console.print("The demo model has random weights: expect schema-valid nonsense.  Ctrl-C stops everything.")


def cmd_up(args: argparse.Namespace) -> int:
    """Build (or take) a model, package it, publish it to the local store, then run the startup procedure."""
    cache = REPO_CACHE
    if args.model is None:
        from serving_image.demo_model import DEMO_MODEL_ID, ensure_demo_model

        with console.status("building the deterministic demo model"):
            model_dir = ensure_demo_model(cache / "models" / DEMO_MODEL_ID)
        model_id, engine_args = DEMO_MODEL_ID, dict(DEMO_ENGINE_ARGS)
    else:
        model_dir = Path(args.model).expanduser()
        if not (model_dir / "config.json").is_file():
            console.print(f"[red]{model_dir}: not a Hugging Face model directory (no config.json)")
            return 2
        model_id = _model_id_from_dir(model_dir)
        max_len = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", 2048)
        engine_args = {"max_model_len": min(int(max_len), 4096), "kv_cache_memory_bytes": 1 << 30}
    engine_args.update(dict(args.engine_arg or []))
    serving_mode = ServingMode(getattr(args, "serving_mode", "openai"))
    published = publish_for_up(cache, model_dir, model_id, engine_args, serving_mode,
                               with_companions=args.model is None)
    from serving_image.startup import StartupConfig, run

    config = StartupConfig(package=published.package, workdir=cache / "run", companions=list(published.companions))
    if serving_mode is not ServingMode.OPENAI:
        return run(config, on_ready=_print_ready)
    # The Batch API and its worker (docs/batch.md), as a pod and its worker Deployment run them, on a directory
    # store beside the model store; LLM_SERVING_BATCH_STORE set outside chooses another (an s3:// one too). The
    # rule is llm_serving/up_layout.py's, which a client's local discovery reads the result cache by.
    os.environ[ENV_BATCH_STORE] = up_batch_store()
    worker = BatchWorkerProcess(os.environ[ENV_BATCH_STORE])

    def on_ready(started) -> None:
        _print_ready(started)
        worker.start()

    try:
        return run(config, on_ready=on_ready)
    finally:
        worker.stop()


class BatchWorkerProcess:
    """`make up`'s batch worker (serving_image/batch/worker.py), a process of its own as in production, started
    once the OpenAI port serves and started again if it dies, as its Deployment would restart it (make check-batch
    kills it mid-batch). Its pid is in .cache/llm-serving/batch-worker.pid; Ctrl-C stops it with the server."""

    PID_FILE = REPO_CACHE / "batch-worker.pid"
    LOG_FILE = REPO_CACHE / "batch-worker.log"

    def __init__(self, store: str):
        self.store = store
        self.proc = None
        self._stopping = False

    def _spawn(self) -> None:
        import subprocess

        from llm_serving import pod_contract as pc

        keys = [k.strip() for k in os.environ.get("LLM_SERVING_API_KEYS", "").split(",") if k.strip()]
        env = dict(os.environ)
        if keys:
            env.setdefault("LLM_SERVING_BATCH_WORKER_API_KEY", keys[0])
        with open(self.LOG_FILE, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "serving_image.batch.worker", "--store", self.store,
                 "--endpoint", f"http://127.0.0.1:{pc.PORTS[pc.OPENAI_PORT_NAME]}"], env=env, stdout=log,
                stderr=subprocess.STDOUT)
        self.PID_FILE.write_text(str(self.proc.pid))

    def _supervise(self) -> None:
        import time

        while not self._stopping:
            # A worker that exits 0 was stopped (Ctrl-C reaches it with the server); any other exit is a death.
            if self.proc.poll() not in (None, 0) and not self._stopping:
                console.print(f"[yellow]batch worker exited ({self.proc.returncode}); starting it again[/]")
                self._spawn()
            time.sleep(0.5)

    def start(self) -> None:
        import threading

        self._spawn()
        threading.Thread(target=self._supervise, name="batch-worker-supervisor", daemon=True).start()
        console.print(f"  Batch API      http://localhost:9000/v1/files, /v1/batches   (store {self.store}; worker "
                      f"log {self.LOG_FILE})")

    def stop(self) -> None:
        self._stopping = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.PID_FILE.unlink(missing_ok=True)


def _rollout(args: argparse.Namespace) -> int:
    # Imported here, not at the top: the rollout CLI needs the Pulumi SDKs, which only .venv-infra has.
    from infra.rollout.cli import main as rollout_main

    # The policy pack gates each mock-runner update. Built here, above both planes, and handed down: infra never
    # imports policies (infra.rollout.runner.PolicyGate). policies.gate imports pulumi_policy only when called.
    from policies.gate import blocking_violations

    return rollout_main(args.args, policy_gate=blocking_violations)


def _rehearse(args: argparse.Namespace) -> int:
    from rehearsal import options

    chosen = options.parse(args.args)  # --help and refused options are answered from any install of the wheel
    try:
        from rehearsal.run import rehearse
    except ModuleNotFoundError as err:
        raise SystemExit(f"llm-serving rehearse: the rehearsal needs the packages of the repository's .venv-serving "
                         f"(`make rehearse` runs it from there): {err}") from None
    return rehearse(chosen)


def _image(args: argparse.Namespace) -> int:
    from image_build import build, check

    return {"build": build.main, "check": check.main}[args.action](args.args)


def _batch(args: argparse.Namespace) -> int:
    from llm_serving_cli.batch import main as batch_main

    return batch_main(args.args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-serving", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("package", help="build a model package (docs/architecture.md §3.4)")
    p.add_argument("model_dir", type=Path, nargs="?", help="Hugging Face model directory")
    p.add_argument("--id", required=True, help="model id (lowercase, digits, '-')")
    p.add_argument("--version", required=True)
    p.add_argument("--backend", choices=[b.value for b in Backend], default="vllm")
    p.add_argument("--serving-mode", choices=[m.value for m in ServingMode], default="openai")
    p.add_argument("--engine-arg", type=_engine_arg, action="append", metavar="KEY=VALUE",
                   help="vLLM engine argument (JSON value or string), repeatable")
    for axis in ("tensor", "pipeline", "data"):
        p.add_argument(f"--{axis}-parallel", type=int, default=1, metavar="N",
                       help=f"the engine's {axis}-parallel size ([engine.parallel]; GPUs per pod = the product)")
    p.add_argument("--plugin", type=Path, action="append", help="plugin wheel, repeatable")
    p.add_argument("--python-model", type=Path,
                   help="model.py, or a directory with model.py and its helper modules (python backend)")
    p.add_argument("--config-pbtxt", type=Path, help="config.pbtxt with explicit I/O (python backend)")
    p.add_argument("--python-dependency", action="append", metavar="REQUIREMENT",
                   help='what model.py imports, a PEP 508 requirement ("xgboost==3.0.5"), repeatable (python backend; '
                        "the image's stub must meet it, or --execution-env)")
    p.add_argument("--execution-env", type=Path,
                   help="a conda-pack / venv-pack .tar.gz for the stub's Python that meets --python-dependency")
    p.add_argument("--ensemble-config", type=Path,
                   help='the ensemble\'s config.pbtxt (platform "ensemble", explicit I/O; ensemble backend)')
    p.add_argument("--step", type=_step, action="append", metavar="MODEL_ID=VERSION",
                   help="a step model of the ensemble, by id and version, one per step (ensemble backend)")
    p.add_argument("--out", type=Path, required=True, help="output directory, or a path ending in .tar.gz")
    p.set_defaults(func=cmd_package)

    p = sub.add_parser("publish", help="publish a package to the model store (atomic)")
    p.add_argument("package", type=Path)
    p.add_argument("--warm-region", action="append", metavar="REGION",
                   help="a region whose model cache must hold the version resident before rollouts (repeatable: "
                        "the home region and each replica region; s3:// stores only)")
    p.add_argument("--home-region", help="the region of the store's bucket (with --warm-region)")
    p.add_argument("--no-wait", dest="wait_materialised", action="store_false",
                   help="write the warm request and return without waiting for the regions' markers")
    p.add_argument("--wait-timeout", type=float, default=3 * 3600.0, metavar="SECONDS",
                   help="how long to wait for every region's cache to hold the version (default 3 h)")
    p.add_argument("--store", default=None, help="directory or s3://bucket/prefix (default: .cache/llm-serving/store)")
    p.add_argument("--model-cache", type=Path, default=REPO_CACHE / "model-cache",
                   help="local model cache (directory stores only; on S3 it is the bucket's model-cache/ prefix)")
    p.set_defaults(func=cmd_publish)

    p = sub.add_parser("serve", help="run the startup procedure on a package and serve")
    p.add_argument("package", type=Path)
    p.add_argument("--workdir", type=Path)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("up", help="what `make up` runs: demo model (or --model DIR), package, publish, serve")
    p.add_argument("--model", default=None, help="a Hugging Face model directory instead of the demo model")
    p.add_argument("--engine-arg", type=_engine_arg, action="append", metavar="KEY=VALUE")
    p.add_argument("--serving-mode", choices=[m.value for m in ServingMode], default="openai",
                   help="openai: OpenAI + KServe front-ends; standalone: NVIDIA's tritonserver alone on the KServe "
                        "ports")
    p.set_defaults(func=cmd_up)

    # Rollouts live in the control plane (.venv-infra): imported only when run; its own parser reads every argument
    # (prefix_chars "\0" so that even --help reaches it).
    p = sub.add_parser("rollout", help="red-black/versioned rollouts as stack updates (.venv-infra; `rollout -h`)",
                       add_help=False, prefix_chars="\0")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_rollout)

    p = sub.add_parser("rehearse", help="what `make rehearse` runs: a stack's model pods on this machine as their "
                                        "rendered Deployments say (root; docs/rehearsal.md)",
                       add_help=False, prefix_chars="\0")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_rehearse)

    p = sub.add_parser("image", help="what `make image` and `make image-check` run: the serving image built on this "
                                     "machine FROM stand-in bases, then run as a pod runs it (docs/first-update.md)")
    p.add_argument("action", choices=("build", "check"))
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_image)

    p = sub.add_parser("batch", help="the Batch API: submit FILE --model M, status ID, results ID (docs/batch.md)",
                       add_help=False, prefix_chars="\0")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_batch)
    return parser


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        sys.exit(args.func(args))
    except (PackageError, PublishError) as exc:
        console.print(f"[red]error:[/] {exc}")
        sys.exit(2)


if __name__ == "__main__":
    main()
