"""The ``fleetserve`` command line."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from fleetserve.platform.config import ConfigError, PlatformConfig, default_config, load_config
from fleetserve.cli.autoscale import autoscale_app
from fleetserve.cli.batch import batch
from fleetserve.cli.errors import print_error
from fleetserve.cli.router import router_app

if TYPE_CHECKING:
    from fleetserve.ops.gpus import GpuSpec
    from fleetserve.ops.planner import ModelPlan

app = typer.Typer(help="fleetserve: serve many LLMs behind one OpenAI-compatible endpoint.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
console = Console(stderr=True)


@app.callback()
def main() -> None:
    """fleetserve: serve many LLMs behind one OpenAI-compatible endpoint."""


def _load(config_path: Optional[Path]) -> PlatformConfig:
    try:
        return load_config(config_path) if config_path else default_config()
    except ConfigError as error:
        print_error(error)
        raise typer.Exit(2) from None


@app.command()
def serve(
    config_path: Annotated[Optional[Path], typer.Argument(metavar="[CONFIG]",
                                                          help="Platform config YAML; default: embedded SmolLM2.")] = None,
    host: Annotated[Optional[str], typer.Option(help="Listen address (overrides the config).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Listen port (overrides the config).")] = None,
    verbose: Annotated[bool, typer.Option(help="Stream Ray and vLLM logs to this terminal.")] = False,
    address: Annotated[Optional[str], typer.Option(
        help="Join this running Ray cluster (e.g. 10.0.0.1:6379, or auto) instead of starting one here.")] = None,
    placement_check: Annotated[bool, typer.Option(
        help="Refuse a config whose replicas fit no node (off for clusters that add nodes on demand).")] = True,
) -> None:
    """Serve the config's models until Ctrl-C, on a Ray cluster started here or joined with --address."""
    config = _load(config_path).listening_at(host, port)
    host, port = config.server.host, config.server.port

    from fleetserve.deployments.builders import build_app
    from fleetserve.deployments.local_run import AppStartError, ClusterError, start_ray
    from fleetserve.deployments.placement import PlacementError
    from fleetserve.deployments.serve_options import HAPROXY_PORT_ENV, job_runtime_env
    from fleetserve.platform.model_store import ModelSourceError
    from fleetserve.platform.ports import bindable
    from fleetserve.platform.shm import remove_orphaned_segments

    if address is None and not bindable(host, port):
        # Serve's proxy would fail to bind after Ray and every engine had started, with a long traceback.
        print_error(f"{host}:{port} is taken (another fleetserve, or another server); "
                    f"pick another with --port or server.port")
        raise typer.Exit(2)
    removed = remove_orphaned_segments()
    if removed:
        console.print(f"removed {len(removed)} orphaned vLLM shared-memory segments")
    try:
        # On a cluster started here, sources are resolved and converted once, here, with progress. A joined
        # cluster's nodes need not share this machine's files (nor should a laptop fetch a 70B model for them):
        # each replica resolves its source on its own node.
        application = build_app(config, resolve_locally=address is None)
    except ModelSourceError as error:
        print_error(error)
        raise typer.Exit(2) from None

    stop, started = threading.Event(), threading.Event()

    def on_signal(*_: object) -> None:
        if not started.is_set():
            raise KeyboardInterrupt  # abandons the start-up (minutes on a big model): start_ray stops what started
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    names = ", ".join(model.name for model in config.models)
    runtime_env = job_runtime_env(config.server, local_cluster=address is None)
    moved = {name: port for name, port in runtime_env.get("env_vars", {}).items() if name in HAPROXY_PORT_ENV}
    if moved:
        console.print("HAProxy's default ports are taken on this machine (another cluster?): "
                      + ", ".join(f"{name}={port}" for name, port in moved.items()))
    try:
        with start_ray(verbose, address, runtime_env) as session:
            if placement_check:
                _check_placement(config)
            try:
                with console.status(f"deploying {names} (engines take ~30-90 s to start on CPU)"):
                    session.deploy(application, host, port, config.server.proxy_location)
            except KeyboardInterrupt:
                console.print("stopping during start-up (Ctrl-C again: at once)...")
                raise
            started.set()
            console.print(f"[bold green]fleetserve ready[/] at http://{host}:{port}/v1  models: {names}")
            console.print("Ctrl-C to stop.")
            print(f"READY http://{host}:{port}/v1", flush=True)
            while not stop.wait(0.5):
                pass
            console.print("stopping...")
    except (ClusterError, PlacementError, AppStartError) as error:
        print_error(error)
        raise typer.Exit(2 if isinstance(error, PlacementError) else 1) from None
    except KeyboardInterrupt:
        console.print("[yellow]stopped before the platform was ready[/]")
        raise typer.Exit(130) from None
    finally:
        remove_orphaned_segments()
    console.print("[green]stopped cleanly[/]")


def _check_placement(config: PlatformConfig) -> None:
    """Raises PlacementError for replicas that fit no node; says which replicas will wait for resources."""
    from fleetserve.deployments.placement import require_placement

    report = require_placement(config)
    for line in [*report.pending, *report.warnings]:
        console.print(f"[yellow]warning:[/] {line}")


@app.command()
def apply(
    config_path: Annotated[Path, typer.Argument(metavar="CONFIG", help="The platform config to apply.")],
    address: Annotated[str, typer.Option(help="The Ray cluster to join (auto: the one on this machine).")] = "auto",
    dry_run: Annotated[bool, typer.Option(help="Print what would change, and change nothing.")] = False,
    placement_check: Annotated[bool, typer.Option(
        help="Refuse a config whose replicas fit no node (off for clusters that add nodes on demand).")] = True,
) -> None:
    """Change a running platform in place: add or remove models, change replicas or engine args, add adapters.

    Serve keeps the replicas of models that do not change, changes replica counts and autoscaling in place,
    and rolls the rest; admitted requests finish.
    """
    import time

    config = _load(config_path)

    from fleetserve.deployments.apply import AdapterSyncError, apply_config, plan_change
    from fleetserve.deployments.local_run import AppStartError, ClusterError, join_cluster
    from fleetserve.deployments.placement import PlacementError

    try:
        join_cluster(address)
    except ClusterError as error:
        print_error(error)
        raise typer.Exit(1) from None
    try:
        change = plan_change(config)
        if placement_check:
            _check_placement(config)
    except (ConfigError, PlacementError) as error:
        print_error(error)
        raise typer.Exit(2) from None
    if change.is_empty:
        console.print("nothing to change: the running platform already serves this config")
        return
    for line in change.describe():
        console.print(f"  {line}")
    if dry_run:
        return
    started = time.monotonic()
    try:
        with console.status("applying (new engines take ~30-90 s to start on CPU)"):
            apply_config(config)
    except (AppStartError, AdapterSyncError) as error:
        print_error(error)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        # Serve has the new config once apply sent it: it goes on rolling out whether anyone waits or not.
        console.print("stopped waiting. A change Serve had been sent goes on rolling out (Ctrl-C does not undo "
                      "it): `fleetserve status` shows the replicas, and applying the previous config undoes it.")
        raise typer.Exit(130) from None
    console.print(f"[bold green]applied[/] in {time.monotonic() - started:.0f} s: the platform serves "
                  f"{', '.join(model.name for model in config.models)}")


def _status_refusal(error, api_key: str | None) -> str:
    """What a refused /metrics scrape means to whoever ran ``fleetserve status``."""
    code = error.response.status_code
    if code == 401 and not api_key:
        return "401: auth is on; pass an admin key with --api-key or $FLEETSERVE_API_KEY"
    if code == 401:
        return "401: the key given is not one of the platform's"
    if code == 403:
        return "403: the key given is not an admin key, and /metrics needs one"
    return f"{code}: {error.response.text[:200]}"


@app.command()
def status(
    url: Annotated[str, typer.Option(help="The platform's base URL.")] = "http://127.0.0.1:8000",
    once: Annotated[bool, typer.Option(help="Print one snapshot and exit (for scripts and tests).")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes.")] = 1.0,
    k8s: Annotated[bool, typer.Option("--k8s", help="Show the RayService's status in Kubernetes instead.")] = False,
    name: Annotated[str, typer.Option(help="RayService name (with --k8s).")] = "fleetserve",
    namespace: Annotated[str, typer.Option(help="Namespace (with --k8s).")] = "default",
    kubeconfig: Annotated[Optional[str], typer.Option(help="Kubeconfig file (with --k8s; default ~/.kube/config).")] = None,
    context: Annotated[Optional[str], typer.Option(help="Kubeconfig context (with --k8s).")] = None,
    api_key: Annotated[Optional[str], typer.Option(envvar="FLEETSERVE_API_KEY", show_default=False,
                                                   help="An admin key, when auth is on (/metrics needs one).")] = None,
) -> None:
    """A live view of models, replicas, KV usage, queues and tokens/s (Ctrl-C to quit); --k8s: the RayService."""
    import time

    if k8s:
        _k8s_status(name, namespace, kubeconfig, context)
        return

    import httpx
    from rich.console import Console as RichConsole
    from rich.live import Live

    from fleetserve.ops.status import fetch, status_table

    out = RichConsole()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    with httpx.Client(headers=headers) as client:
        try:
            before = fetch(url, client, time.monotonic())
            time.sleep(interval)
            after = fetch(url, client, time.monotonic())
        except httpx.HTTPStatusError as error:
            print_error(f"cannot read {url.rstrip('/')}/metrics: {_status_refusal(error, api_key)}")
            raise typer.Exit(1) from None
        except httpx.HTTPError as error:
            print_error(f"cannot read {url.rstrip('/')}/metrics: {type(error).__name__}: {error}")
            raise typer.Exit(1) from None
        if once:
            table = status_table(before, after, url)
            if not out.is_terminal:  # rich would cut every cell to fit 80 columns, unreadable to a script
                out = RichConsole(width=RichConsole(width=1000).measure(table).maximum)
            out.print(table)
            return
        with Live(status_table(before, after, url), console=out, refresh_per_second=4) as live:
            try:
                while True:
                    time.sleep(interval)
                    before, after = after, fetch(url, client, time.monotonic())
                    live.update(status_table(before, after, url))
            except KeyboardInterrupt:
                pass
            except httpx.HTTPError as error:
                console.print(f"[red]lost contact with {url}:[/] {escape(str(error))}")
                raise typer.Exit(1) from None


def _k8s_status(name: str, namespace: str, kubeconfig: Optional[str], context: Optional[str]) -> None:
    from rich.table import Table

    from fleetserve.ops.kube import DeployError, rayservice_status

    try:
        status = rayservice_status(name, namespace, kubeconfig, context)
    except DeployError as error:
        print_error(error)
        raise typer.Exit(1) from None
    table = Table(title=f"RayService {namespace}/{name}")
    table.add_column("what")
    table.add_column("status")
    table.add_row("service", status.service_status or "(starting)")
    table.add_row("ready", "yes" if status.ready else "no")
    table.add_row("active cluster", status.active_cluster or "—")
    if status.upgrading or status.pending_cluster:
        table.add_row("upgrading to", status.pending_cluster or "(pending)")
    for application, state in status.applications.items():
        table.add_row(f"application {application}", state)
    for deployment, state in status.deployments.items():
        table.add_row(f"  {deployment}", state)
    Console(width=120).print(table)


@app.command()
def deploy(
    values: Annotated[list[Path], typer.Option("--values", "-f", help="Chart values file(s), e.g. from `fleetserve plan --emit-values`.")],
    config_path: Annotated[Optional[Path], typer.Option("--config", help="Platform config; replaces the values' platform.")] = None,
    name: Annotated[str, typer.Option(help="RayService (and release) name.")] = "fleetserve",
    namespace: Annotated[str, typer.Option(help="Namespace.")] = "default",
    chart: Annotated[Optional[Path], typer.Option(help="Chart folder (default: this checkout's helm/fleetserve).")] = None,
    kubeconfig: Annotated[Optional[str], typer.Option(help="Kubeconfig file (default ~/.kube/config).")] = None,
    context: Annotated[Optional[str], typer.Option(help="Kubeconfig context.")] = None,
    dry_run: Annotated[bool, typer.Option(help="Print the RayService instead of applying it.")] = False,
) -> None:
    """Renders the chart's RayService and creates it, or patches it when it exists."""
    import yaml

    from fleetserve.ops.kube import CHART, DeployError, apply_rayservice, check_placement, merge_values, \
        render_rayservice, unmounted_paths

    layers = []
    for path in values:
        try:
            layers.append(yaml.safe_load(path.read_text()) or {})
        except (OSError, yaml.YAMLError) as error:
            print_error(f"cannot read values file {path}: {error}")
            raise typer.Exit(2) from None
    if config_path is not None:
        layers.append({"platform": _load(config_path).model_dump(mode="json", exclude_defaults=True)})
    try:
        merged = merge_values(*layers)
        check_placement(merged)
        obj = render_rayservice(merged, name, namespace, chart or CHART)
        _warn_unmounted(unmounted_paths(obj))
        if dry_run:
            typer.echo(yaml.safe_dump(obj, sort_keys=False))
            return
        action = apply_rayservice(obj, kubeconfig, context)
    except DeployError as error:
        print_error(error)
        raise typer.Exit(1) from None
    console.print(f"RayService {namespace}/{name} {action}; watch it with "
                  f"`fleetserve status --k8s --name {name} --namespace {namespace}`")


def _warn_unmounted(paths) -> None:
    if paths:
        listed = "; ".join(f"{item.key}: {item.path}" for item in paths)
        console.print(f"warning: the pods mount no volume holding these paths from the platform config, so "
                          f"unless the image holds them its replicas will not find them: {listed}. Mount them "
                          f"with the values' extraVolumes and extraVolumeMounts (docs/kubernetes.md).",
                          style="yellow", markup=False)


def _warn_unmounted_in_values(values: dict) -> None:
    try:
        from fleetserve.ops.kube import DeployError, render_rayservice, unmounted_paths
    except ImportError:  # without the k8s extra there is no chart renderer; `fleetserve deploy` needs it anyway
        return
    try:
        _warn_unmounted(unmounted_paths(render_rayservice(values, "fleetserve", "default")))
    except DeployError as error:
        print_error(error)
        raise typer.Exit(1) from None


@app.command()
def plan(
    config_path: Annotated[Path, typer.Argument(metavar="CONFIG", help="Platform config YAML.")],
    gpu: Annotated[str, typer.Option(help="a100-80gb, h100-80gb, h200-141gb, l4-24gb or l40s-48gb.")] = "h100-80gb",
    mig: Annotated[bool, typer.Option(help="Place models on MIG slices (else whole GPUs).")] = False,
    shared: Annotated[bool, typer.Option(help="Place small models on 1/8, 1/4 or 1/2 of a GPU without MIG "
                                              "(Ray packs them onto shared GPUs).")] = False,
    context: Annotated[Optional[int], typer.Option(help="Tokens per sequence (default: each model's max_model_len).")] = None,
    concurrency: Annotated[Optional[int], typer.Option(help="Sequences per replica (default: each model's max_num_seqs, else 8).")] = None,
    price: Annotated[float, typer.Option(help="Dollars per whole-GPU hour.")] = 4.0,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the plan as JSON here ('-': stdout).")] = None,
    emit_values: Annotated[Optional[Path], typer.Option(help="Write Helm values for helm/fleetserve here.")] = None,
    emit_profiles: Annotated[Optional[Path], typer.Option(
        help="Write each model's replica profile (DIR/<model>.yaml) for `fleetserve autoscale simulate "
             "--profile`.")] = None,
) -> None:
    """Which GPU or MIG slice each model needs, what it can serve there, and how it packs onto GPUs."""
    import json

    import yaml

    from fleetserve.ops.gpus import gpu as gpu_spec
    from fleetserve.ops.plan_report import packing_table, plan_json, plan_table
    from fleetserve.ops.planner import Partitioning, PlanError, PlanInputs, chart_values, pack, plan_config

    if mig and shared:
        print_error("--mig and --shared are two ways to split a GPU: choose one")
        raise typer.Exit(2)
    partitioning = Partitioning.MIG if mig else Partitioning.SHARED if shared else Partitioning.WHOLE
    config = _load(config_path)
    try:
        spec = gpu_spec(gpu)
    except KeyError as error:
        print_error(error.args[0])
        raise typer.Exit(2) from None
    inputs = PlanInputs(price_per_gpu_hour=price)
    try:
        plans = plan_config(config, spec, partitioning, inputs, context_len=context, concurrency=concurrency)
        assignments = pack(plans, spec)
    except PlanError as error:
        print_error(error)
        raise typer.Exit(2) from None
    # With the JSON on stdout, the tables go to stderr so that stdout parses.
    out = Console(width=160, stderr=json_out is not None and str(json_out) == "-")
    out.print(plan_table(plans, spec.name, inputs))
    out.print(packing_table(assignments, partitioning))
    if json_out is not None:
        text = json.dumps(plan_json(plans, assignments, spec.name, partitioning, inputs), indent=2)
        typer.echo(text) if str(json_out) == "-" else json_out.write_text(text + "\n")
    if emit_values is not None:
        values = chart_values(config, plans, spec, partitioning)
        emit_values.write_text("# Written by `fleetserve plan`; pass to helm/fleetserve with -f.\n"
                               + yaml.safe_dump(values, sort_keys=False))
        console.print(f"chart values: {emit_values}")
        _warn_unmounted_in_values(values)
    if emit_profiles is not None:
        _write_profiles(emit_profiles, config, plans, spec)


def _write_profiles(folder: Path, config: PlatformConfig, plans: list[ModelPlan], spec: GpuSpec) -> None:
    """One replica profile per planned model, named after it."""
    from fleetserve.ops.replica_profile import profile_yaml, replica_profile

    folder.mkdir(parents=True, exist_ok=True)
    for plan in plans:
        path = folder / f"{plan.model}.yaml"
        path.write_text(profile_yaml(replica_profile(plan, config.model(plan.model), spec), plan, spec))
        console.print(f"replica profile: {path}")


app.command("batch")(batch)
app.add_typer(router_app, name="router")
app.add_typer(autoscale_app, name="autoscale")

auth_app = typer.Typer(help="API keys for the platform config's auth section.", no_args_is_help=True)
app.add_typer(auth_app, name="auth")


@auth_app.command("hash-key")
def auth_hash_key() -> None:
    """Print the sha256 of an API key (read from stdin) for auth.api_keys; the key is never stored."""
    import sys

    from fleetserve.deployments.ingress.security import hash_key

    key = sys.stdin.readline().strip() if not sys.stdin.isatty() else typer.prompt("API key", hide_input=True)
    if not key:
        console.print("[red]error:[/] no key given (pipe it in, or type it at the prompt)")
        raise typer.Exit(2)
    print(hash_key(key))


@auth_app.command("new-key")
def auth_new_key(
    tenant: Annotated[str, typer.Option(help="The tenant the key belongs to (a key of auth.tenants).")],
    admin: Annotated[bool, typer.Option("--admin", help="An admin key (/metrics, adapter loading).")] = False,
) -> None:
    """Mint a random API key: prints the key once (give it to the tenant) and the api_keys entry that holds
    only its hash (add it to the config or the keys file)."""
    import secrets

    import yaml

    from fleetserve.deployments.ingress.security import hash_key

    # 32 random bytes, URL-safe, with a prefix that secret scanners and people recognise.
    key = f"sk-fs-{secrets.token_urlsafe(32)}"
    entry = {"sha256": hash_key(key), "tenant": tenant, **({"admin": True} if admin else {})}
    print(f"key (shown once): {key}")
    print("api_keys entry:   " + yaml.safe_dump([entry], default_flow_style=None, sort_keys=False, width=1000).strip())

bench_app = typer.Typer(help="Load-test any OpenAI-compatible endpoint (fleetserve, vLLM, ...).",
                        pretty_exceptions_enable=False)
app.add_typer(bench_app, name="bench")


def _load_tokenizer(source: Optional[str]):
    if not source:
        return None
    from transformers import AutoTokenizer

    from fleetserve.platform.model_store import resolve_source

    return AutoTokenizer.from_pretrained(str(resolve_source(source)))


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter("expected a number, 'inf', or a comma-separated list of them") from None
    if not rates or any(rate <= 0 for rate in rates):
        raise typer.BadParameter("rates must be positive")
    return rates


@bench_app.callback(invoke_without_command=True)
def bench(
    ctx: typer.Context,
    base_url: Annotated[Optional[str], typer.Option(help="Server URL, e.g. http://127.0.0.1:8000 (/v1 optional).")] = None,
    model: Annotated[Optional[str], typer.Option(help="Model name to request; several, comma-separated, spread "
                                                      "the requests over them (e.g. a base's LoRA adapters).")] = None,
    model_zipf: Annotated[float, typer.Option(min=0, help="With several --model names: Zipf exponent of their "
                                                           "popularity, in the order given (0: uniform).")] = 0.0,
    api_key: Annotated[Optional[str], typer.Option(envvar="OPENAI_API_KEY", show_default=False,
                                                   help="Sent as a bearer token (never saved with results).")] = None,
    api: Annotated[str, typer.Option(help="chat, completions, messages (Anthropic's) or responses.")] = "completions",
    dataset_name: Annotated[str, typer.Option(help="random, shared-prefix, sharegpt, jsonl, or trace (a recorded "
                                                   "trace CSV: timestamp, prompt tokens, output tokens).")] = "random",
    dataset_path: Annotated[Optional[Path], typer.Option(help="File for sharegpt / jsonl / trace.")] = None,
    num_prompts: Annotated[int, typer.Option(min=1)] = 100,
    max_seconds: Annotated[Optional[float], typer.Option(help="Stop sending after this long.")] = None,
    request_rate: Annotated[str, typer.Option(help="Requests/s: a number, inf, or a sweep list like 1,2,4,inf.")] = "inf",
    burstiness: Annotated[float, typer.Option(help="Gamma shape of arrivals; 1.0 is Poisson, lower is burstier.")] = 1.0,
    max_concurrency: Annotated[Optional[int], typer.Option(min=1)] = None,
    seed: int = 0,
    num_warmups: Annotated[int, typer.Option(min=0)] = 0,
    random_input_len: int = 128,
    random_output_len: int = 64,
    random_range_ratio: float = 0.0,
    random_prefix_len: int = 0,
    shared_prefix_groups: int = 4,
    shared_prefix_len: int = 256,
    shared_suffix_len: int = 32,
    shared_output_len: int = 32,
    output_len: Annotated[Optional[int], typer.Option(help="Override output length for sharegpt/jsonl.")] = None,
    trace_start: Annotated[float, typer.Option(help="trace: where the replay starts, in the trace's seconds.")] = 0.0,
    trace_duration: Annotated[Optional[float], typer.Option(help="trace: seconds of the trace to replay (default: to its end).")] = None,
    rate_scale: Annotated[float, typer.Option(help="trace: play it this many times faster.")] = 1.0,
    trace_length_scale: Annotated[float, typer.Option(help="trace: multiply every token count (fit a small model).")] = 1.0,
    trace_max_len: Annotated[Optional[int], typer.Option(help="trace: cut prompts so prompt + output fit this context.")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Generate exactly max_tokens (vLLM's ignore_eos).")] = False,
    tokenizer: Annotated[Optional[str], typer.Option(help="HF folder or packaged id for exact prompt lengths.")] = None,
    metric_percentiles: str = "50,90,99",
    goodput: Annotated[Optional[list[str]], typer.Option(help="SLO as KEY:MS (ttft, tpot, e2el); repeatable.")] = None,
    save_result: Annotated[Optional[Path], typer.Option(help="Write results as JSON (schema in docs/bench.md).")] = None,
    save_detailed: Annotated[bool, typer.Option(help="Include per-request records in the JSON.")] = False,
    plot: Annotated[Optional[Path], typer.Option(help="Directory for PNG plots.")] = None,
    timeout: Annotated[float, typer.Option(help="Per-request timeout in seconds.")] = 600.0,
) -> None:
    """Run a benchmark: fleetserve bench --base-url URL --model NAME [options]."""
    if ctx.invoked_subcommand is not None:
        return
    if not base_url or not model:
        console.print("[red]error:[/] --base-url and --model are required (or use: fleetserve bench compare A.json B.json)")
        raise typer.Exit(2)
    import asyncio
    import random

    from fleetserve.loadtest import datasets
    from fleetserve.loadtest.client import API_PATHS, NO_IGNORE_EOS
    from fleetserve.loadtest.metrics import parse_goodput, parse_percentiles
    from fleetserve.loadtest.report import plot_run, plot_sweep, save_results, summary_table
    from fleetserve.loadtest.runner import BenchConfig, BenchError

    if api not in API_PATHS:
        raise typer.BadParameter(f"--api must be one of {', '.join(API_PATHS)}")
    if ignore_eos and api in NO_IGNORE_EOS:
        raise typer.BadParameter(f"--ignore-eos: the {api} API has no ignore_eos (vLLM's, for OpenAI's APIs)")
    try:
        _refuse_other_datasets_options(ctx, dataset_name)
        percentiles = parse_percentiles(metric_percentiles)
        slos = parse_goodput(goodput or [])
        maker = datasets.PromptMaker(_load_tokenizer(tokenizer), random.Random(seed))
        if dataset_name == "random":
            specs = datasets.random_dataset(num_prompts, random_input_len, random_output_len, random_range_ratio,
                                            random_prefix_len, maker)
        elif dataset_name == "shared-prefix":
            specs = datasets.shared_prefix_dataset(num_prompts, shared_prefix_groups, shared_prefix_len,
                                                   shared_suffix_len, shared_output_len, maker)
        elif dataset_name in ("sharegpt", "jsonl", "trace"):
            if dataset_path is None:
                raise datasets.DatasetError(f"--dataset-name {dataset_name} needs --dataset-path")
            if dataset_name == "trace":
                specs = _trace_specs(ctx, dataset_path, maker, trace_start, trace_duration, rate_scale,
                                     trace_length_scale, trace_max_len, num_prompts)
            elif dataset_name == "sharegpt":
                specs = datasets.sharegpt_dataset(dataset_path, num_prompts, maker, output_len)
            else:
                specs = datasets.jsonl_dataset(dataset_path, num_prompts, maker, output_len or random_output_len)
        else:
            raise datasets.DatasetError("--dataset-name must be random, shared-prefix, sharegpt, jsonl or trace")
    except ValueError as error:
        print_error(error)
        raise typer.Exit(2) from None
    described = {key: value for key, value in ctx.params.items()
                 if key.startswith(("dataset", "random_", "shared_", "trace_"))
                 or key in ("num_prompts", "output_len", "tokenizer", "rate_scale")}
    results = []
    for rate in _rates(request_rate):
        config = BenchConfig(base_url=base_url, model=model, model_zipf=model_zipf, api=api, request_rate=rate,
                             burstiness=burstiness,
                             max_concurrency=max_concurrency, num_warmups=num_warmups, max_seconds=max_seconds,
                             seed=seed, ignore_eos=ignore_eos, percentiles=percentiles, goodput=slos,
                             timeout_s=timeout, dataset={k: str(v) if isinstance(v, Path) else v
                                                         for k, v in described.items()}, api_key=api_key)
        try:
            result = asyncio.run(_run_with_progress(config, specs, maker.count if maker.tokenizer else None))
        except BenchError as error:
            print_error(error)
            raise typer.Exit(1) from None
        results.append(result)
        console.print(summary_table(result))
        if plot:
            name = "bench" if len(_rates(request_rate)) == 1 else f"rate-{rate:g}"
            for path in plot_run(result, plot, name):
                console.print(f"plot: {path}")
        if result.interrupted:
            break
    if plot and len(results) > 1:
        console.print(f"plot: {plot_sweep(results, plot)}")
    if save_result:
        save_results(save_result, results, save_detailed)
        console.print(f"saved {save_result}")
    if results and results[-1].interrupted:
        raise typer.Exit(130)


# The options that shape one kind of dataset: given with another, they would do nothing.
DATASET_OPTIONS = {
    "random": ("random_input_len", "random_output_len", "random_range_ratio", "random_prefix_len"),
    "shared-prefix": ("shared_prefix_groups", "shared_prefix_len", "shared_suffix_len", "shared_output_len"),
    "sharegpt": ("dataset_path", "output_len"),
    "jsonl": ("dataset_path", "output_len"),
    "trace": ("dataset_path", "trace_start", "trace_duration", "rate_scale", "trace_length_scale", "trace_max_len"),
}


def _given(ctx: typer.Context, name: str) -> bool:
    # Typer carries its own click: compare the source by name, not by click's enum.
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _option(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _refuse_other_datasets_options(ctx: typer.Context, dataset_name: str) -> None:
    """Refuses options of another dataset kind (say --rate-scale without a trace) rather than ignoring them."""
    from fleetserve.loadtest import datasets

    if dataset_name not in DATASET_OPTIONS:
        return
    own = DATASET_OPTIONS[dataset_name]
    stray = dict.fromkeys(name for names in DATASET_OPTIONS.values() for name in names
                          if name not in own and _given(ctx, name))
    if stray:
        named = [f"{_option(name)} (for {' / '.join(kind for kind, names in DATASET_OPTIONS.items() if name in names)})"
                 for name in stray]
        raise datasets.DatasetError(f"--dataset-name {dataset_name} does not read {', '.join(named)}: drop "
                                    f"{'it' if len(named) == 1 else 'them'}")


def _trace_specs(ctx: typer.Context, path: Path, maker, start_s: float, duration_s: float | None, rate_scale: float,
                 length_scale: float, max_len: int | None, num_prompts: int) -> list:
    """A recorded trace's window as requests with their send times; the options that set another
    schedule are refused rather than ignored."""
    from fleetserve.loadtest import datasets

    clashing = [_option(name) for name in ("request_rate", "burstiness") if _given(ctx, name)]
    if clashing:
        raise datasets.DatasetError(f"a trace brings its own arrival times: drop {', '.join(clashing)} "
                                    "(--rate-scale speeds it up)")
    specs = datasets.trace_dataset(path, maker, start_s, duration_s, rate_scale, length_scale, max_len)
    # --num-prompts, when given, takes the window's first N requests.
    return specs[:num_prompts] if _given(ctx, "num_prompts") else specs


async def _run_with_progress(config, specs, count_tokens):
    import asyncio
    import signal as signal_module

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fleetserve.loadtest.runner import run_benchmark

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal_module.SIGINT, stop.set)
    failures = 0
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task(f"{config.model} @ {config.schedule}", total=len(specs), failed=0)

        def done(record) -> None:
            nonlocal failures
            failures += not record.ok
            progress.update(task, advance=1, failed=failures)

        try:
            return await run_benchmark(config, specs, stop, done, count_tokens)
        finally:
            loop.remove_signal_handler(signal_module.SIGINT)


@bench_app.command("compare")
def bench_compare(files: Annotated[list[Path], typer.Argument(help="Result files from --save-result.")]) -> None:
    """Show results side by side, with ratios to the first."""
    from fleetserve.loadtest.report import compare_table

    try:
        console.print(compare_table(files))
    except ValueError as error:
        print_error(error)
        raise typer.Exit(2) from None

