"""The ``fleetserve`` command line."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from fleetserve.platform.config import ConfigError, PlatformConfig, default_config, load_config

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
        console.print(f"[red]error:[/] {error}")
        raise typer.Exit(2) from None


@app.command()
def serve(
    config_path: Annotated[Optional[Path], typer.Argument(metavar="[CONFIG]",
                                                          help="Platform config YAML; default: embedded SmolLM2.")] = None,
    host: Annotated[Optional[str], typer.Option(help="Listen address (overrides the config).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Listen port (overrides the config).")] = None,
    verbose: Annotated[bool, typer.Option(help="Stream Ray and vLLM logs to this terminal.")] = False,
) -> None:
    """Start a local Ray cluster and serve the config's models until Ctrl-C."""
    config = _load(config_path)
    host = host or config.server.host
    port = port or config.server.port

    import ray
    from ray import serve as ray_serve

    from fleetserve.deployments.builders import build_app
    from fleetserve.platform.model_store import ModelSourceError
    from fleetserve.platform.shm import remove_orphaned_segments

    removed = remove_orphaned_segments()
    if removed:
        console.print(f"removed {len(removed)} orphaned vLLM shared-memory segments")
    try:
        application = build_app(config)  # resolves and converts model sources, with progress
    except ModelSourceError as error:
        console.print(f"[red]error:[/] {error}")
        raise typer.Exit(2) from None

    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    names = ", ".join(model.name for model in config.models)
    with console.status("starting Ray"):
        ray.init(include_dashboard=False, log_to_driver=verbose, configure_logging=verbose)
    try:
        ray_serve.start(http_options={"host": host, "port": port})
        with console.status(f"deploying {names} (engines take ~30-90 s to start on CPU)"):
            ray_serve.run(application, name="fleetserve", route_prefix="/")
        console.print(f"[bold green]fleetserve ready[/] at http://{host}:{port}/v1  models: {names}")
        console.print("Ctrl-C to stop.")
        print(f"READY http://{host}:{port}/v1", flush=True)
        while not stop.wait(0.5):
            pass
        console.print("stopping...")
    finally:
        ray_serve.shutdown()
        ray.shutdown()
        remove_orphaned_segments()
    console.print("[green]stopped cleanly[/]")


if __name__ == "__main__":
    app()
