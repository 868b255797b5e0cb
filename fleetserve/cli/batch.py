"""``fleetserve batch``: run a file of requests in OpenAI's batch format against an endpoint."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fleetserve.cli.errors import console, fail
from fleetserve.loadtest.batch import (
    BatchConfig,
    BatchFileError,
    BatchOutcome,
    BatchSummary,
    done_ids,
    read_batch,
    run_batch,
)


def batch(
    input_file: Annotated[Path, typer.Argument(help="JSONL, one request per line: {custom_id, method, url, body}.",
                                               exists=True, dir_okay=False, show_default=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="JSONL the results are appended to, one per line, "
                                                                "in OpenAI's batch output format.")],
    base_url: Annotated[str, typer.Option(help="Server URL, e.g. http://127.0.0.1:8000.")] = "http://127.0.0.1:8000",
    api_key: Annotated[Optional[str], typer.Option(envvar="OPENAI_API_KEY", show_default=False,
                                                   help="Sent as a bearer token (a batch tenant's key).")] = None,
    max_concurrency: Annotated[int, typer.Option(min=1, help="Requests in flight at once.")] = 16,
    max_retries: Annotated[int, typer.Option(min=0, help="Tries after the first for a request not answered, or "
                                                         "answered 429, 502, 503 or 504 without a Retry-After.")] = 5,
    max_wait: Annotated[float, typer.Option(min=0, help="Seconds a request's refusals for load with a Retry-After "
                                                        "are waited out, however many.")] = 3600.0,
    timeout: Annotated[float, typer.Option(min=0.001, help="Per-request timeout in seconds.")] = 600.0,
    resume: Annotated[bool, typer.Option(help="Skip the requests OUTPUT holds results for already.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Start OUTPUT afresh.")] = False,
) -> None:
    """Send every request of a batch file and write each answer as it arrives (Ctrl-C stops; --resume goes on).
    Exits 1 when any request's result in OUTPUT is no 2xx answer."""
    if resume and overwrite:
        raise fail("--resume and --overwrite exclude each other")
    try:
        lines = read_batch(input_file)
    except (BatchFileError, UnicodeDecodeError) as error:
        raise fail(f"{input_file}: {error}") from None
    if output.exists() and output.stat().st_size > 0 and not (resume or overwrite):
        raise fail(f"{output} exists: --resume to send only the requests it has no result for, --overwrite to "
                   f"start again")
    if overwrite:
        output.unlink(missing_ok=True)
    output.parent.mkdir(parents=True, exist_ok=True)
    config = BatchConfig(base_url, max_concurrency, max_retries, max_wait_s=max_wait, timeout_s=timeout,
                         api_key=api_key)
    summary = asyncio.run(_run_with_progress(config, lines, output, input_file.name))
    console.print(summary_table(summary, output))
    if summary.stopped:
        console.print(f"stopped: {summary.num_lines - summary.num_skipped - summary.num_done} requests have no "
                      f"result yet; run the same command with --resume to send them")
    if summary.stopped or summary.num_failed:
        raise typer.Exit(1)


async def _run_with_progress(config: BatchConfig, lines, output: Path, title: str) -> BatchSummary:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("ok {task.fields[ok]}, failed {task.fields[failed]}"), TimeElapsedColumn(),
                  console=console) as progress:
        done = done_ids(output)
        already = [done[line.custom_id] for line in lines if line.custom_id in done]
        counts = {"ok": already.count(True), "failed": already.count(False)}
        task = progress.add_task(title, total=len(lines), completed=len(already), **counts)

        def answered(outcome: BatchOutcome) -> None:
            counts["ok" if outcome.ok else "failed"] += 1
            progress.update(task, advance=1, **counts)

        try:
            summary = await run_batch(config, lines, output, answered, stop)
        finally:
            loop.remove_signal_handler(signal.SIGINT)
        return summary


def summary_table(summary: BatchSummary, output: Path) -> Table:
    """A run's totals: answers per status, retries, tokens and throughput."""
    table = Table(title=f"batch -> {output}", show_header=False)
    table.add_row("requests", str(summary.num_lines))
    if summary.num_skipped:
        table.add_row("already done (resumed)", f"{summary.num_skipped}, {summary.num_skipped_failed} without a 2xx")
    for status, count in sorted(summary.statuses.items(), key=lambda item: item[0] or 0):
        table.add_row(f"HTTP {status}" if status is not None else "no answer", str(count))
    table.add_row("retries", str(summary.num_retries))
    table.add_row("prompt / completion tokens", f"{summary.prompt_tokens} / {summary.completion_tokens}")
    table.add_row("seconds", f"{summary.seconds:.1f}")
    if summary.seconds > 0:
        table.add_row("completion tokens/s", f"{summary.completion_tokens / summary.seconds:.1f}")
    return table
