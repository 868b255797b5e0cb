"""Overload: fleetserve's admission control against Ray Serve's default unbounded queueing, at 2x capacity;
and with --tenants, a light tenant beside a heavy one's flood, with fair shares of the queue on and off.

    .venv/bin/python benchmarks/overload.py [--seconds 60] [--factor 2]     # ~6 min
    .venv/bin/python benchmarks/overload.py --tenants [--seconds 45]        # ~10 min
                                            [--engine-cores 1 --front-door-cores 0 --load-tester-cores 1]
                                            [--max-num-seqs 4] [--setups SLUG ...] [--fast-path]
                                            [--reserved-slots N]
    .venv/bin/python benchmarks/overload.py --memory [--seconds 300] [--tracemalloc 8] [--memray] [--worker-env K=V ...]
                                            [--cpu-hog 60:60] [--ingress-max-ongoing N] [--rate R]
    .venv/bin/python benchmarks/overload.py --compare-memory RESULT.json ...

The tiny model on 2 replicas (one core each, max_num_seqs 16, eager), Ray started as `fleetserve serve` starts
it (Serve's proxy on the fast path when the default config has it). Capacity is measured first: a closed
burst of 96 requests (64 tokens in, 32 out) that fills both engines. Then each setup gets the
same open-loop Poisson load at ``factor`` x capacity for ``seconds``, through `fleetserve bench`'s runner:

  bounded    fleetserve's admission control: queue bound of 2 s of drain (max_queue_wait_s 2)
  unbounded  no admission bound (max_queue_wait_s and max_in_flight_per_replica off): Ray Serve's
             default, where every request queues until served or timed out

With --tenants: tenant B sends at 0.2x capacity alone, then beside tenant A at 3x capacity (--heavy-factor), once with
fair shares (limits.fair_share_from 0.5, equal weights), once without (fair_share_from 1.0), once with shares
on engines with vLLM's priority scheduling (where the ingress queues tenants fairly: a request's priority is
its start tag under fair queuing by weight), once with that and A as a batch tenant, and once with priority
engines and --reserved-slots engine slots (default 1) kept for requests on the fair schedule
(limits.num_reserved_slots), all five unless --setups names some (by slug: shares-off,
shares-on-priority-engines-slots-reserved). Reported:
B's goodput and p99 TTFT against B alone, what A got, how long A's refusals took (the front door's own
latency under the flood), and the cores each part of the stack used. --engine-cores puts one engine replica
on each core listed (default 0,1: one per core, sharing them with everything else); --front-door-cores pins
Ray and all it starts there, so that only the engines' vLLM workers leave those cores (a GPU node's split in
miniature), and --load-tester-cores moves the load tester off them.

With --memory: the bounded setup alone, for --seconds (default 300), sampling the ingress's resident memory
every second. After --warmup-s the ingress marks its heap; at the end it reports what the heap gained since:
live objects by type, and with --tracemalloc N the allocation sites (N frames each; tracing costs the
ingress CPU); with --memray, memray records its native allocations from the mark to the end and the
largest live at its peak and at the end are reported by call stack. --worker-env sets a variable in every Ray
worker (FLEETSERVE_TUNE_MALLOC=0: glibc untuned, as before the fix). Each second it also samples how many
requests Serve has handed to the ingress against how many it admitted; --cpu-hog START:SECONDS starves
the machine (one spinning process per core) for a while, --ingress-max-ongoing sets
limits.ingress_max_ongoing_requests, and --rate fixes the offered requests/s (so transports whose measured
capacity differs face the same load).
Results: results/overload/memory*.json and a plot of RSS over time, memory*.png; --compare-memory plots
such results together (memory-compared.png).

Reported per setup: completed, refused (503 with Retry-After), client timeouts (120 s), throughput,
TTFT/TPOT medians and p99s of completed requests, goodput (TTFT <= 5 s), peak requests in flight, and
peak memory of the ingress and engine processes. Results: results/overload/*.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from fleetserve.loadtest.datasets import RequestSpec
from fleetserve.loadtest.processes import resident_bytes
from fleetserve.loadtest.report import save_results
from fleetserve.loadtest.runner import BenchConfig, run_benchmark
from fleetserve.deployments.ingress.heap import MEMRAY_ENV, TRACEMALLOC_ENV
from fleetserve.deployments.serve_options import job_runtime_env
from fleetserve.platform.config import ServerConfig, parse_config

ROOT = Path(__file__).resolve().parents[1]
PORT = 8044
MODEL = "tiny"
SETUPS = {"bounded": {"max_queue_wait_s": 2.0, "min_queued_per_replica": 8},
          "unbounded": {"max_queue_wait_s": None, "max_in_flight_per_replica": None}}
# Goodput SLO (ms): a first token within 5 s.
SLO = {"ttft": 5000.0}


KEYS = {"heavy": "sk-overload-heavy", "light": "sk-overload-light"}
# (name, limits.fair_share_from, engines schedule by vLLM's priority, A is a batch tenant, --reserved-slots
# engine slots are kept for requests on the fair schedule). On priority engines the ingress queues tenants
# fairly by weight (docs/security.md).
TENANT_SETUPS = [("shares off", 1.0, False, False, False), ("shares on", 0.5, False, False, False),
                 ("shares on, priority engines", 0.5, True, False, False),
                 ("shares on, A batch", 0.5, True, True, False),
                 ("shares on, priority engines, slots reserved", 0.5, True, False, True)]
SEEDS = {"heavy": 2, "light": 1}
# Where the engines' vLLM workers run by default: one replica on each core, beside the front door.
ENGINE_CORES = ["0", "1"]


def slug(text: str) -> str:
    return re.sub(r"\W+", "-", text)


def tenants_config(fair_share_from: float, priority_engines: bool, heavy_batch: bool, num_reserved_slots: int = 0,
                   engine_cores: list[str] = ENGINE_CORES, max_num_seqs: int = 16, fast_path: bool = False) -> dict:
    from fleetserve.deployments.ingress.security import hash_key

    model = model_config(engine_cores, max_num_seqs)
    if priority_engines:
        # vLLM's priority scheduling: the engines run lower priorities first (the ingress sets them).
        model["engine_args"]["extra"]["scheduling_policy"] = "priority"
    return {"models": [model], "server": {"serve_fast_path": fast_path},
            "limits": {**SETUPS["bounded"], "fair_share_from": fair_share_from,
                       "num_reserved_slots": num_reserved_slots},
            "auth": {"tenants": {name: ({"priority": "batch"} if heavy_batch and name == "heavy" else {})
                                 for name in KEYS},
                     "api_keys": [{"sha256": hash_key(key), "tenant": name} for name, key in KEYS.items()]}}


def model_config(engine_cores: list[str] = ENGINE_CORES, max_num_seqs: int = 16) -> dict:
    """One engine replica per entry of engine_cores, its vLLM worker pinned there."""
    args = {"dtype": "float32", "max_model_len": 1024, "kv_cache_memory_bytes": 64 * 2**20,
            "max_num_seqs": max_num_seqs, "extra": {"enforce_eager": True}}
    return {"name": MODEL, "source": "tiny-random-llama", "replicas": len(engine_cores), "engine_args": args,
            "resources": {"num_cpus": 0.1, "cpu_binding": list(engine_cores)}}


def specs(num: int) -> list[RequestSpec]:
    return [RequestSpec(prompt=" ".join(f"w{(i + j) % 97}" for j in range(64)), prompt_len=64, max_tokens=32)
            for i in range(num)]


class MemorySampler(threading.Thread):
    """Resident memory of the ingress and of the engine replicas (with their vLLM processes) each second:
    (seconds since start, ingress bytes, engines bytes)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.points: list[tuple[float, int, int]] = []
        self.done = threading.Event()
        self.started_at = time.monotonic()

    @property
    def peaks(self) -> dict[str, int]:
        return {"ingress": max((p[1] for p in self.points), default=0),
                "engines": max((p[2] for p in self.points), default=0)}

    def run(self) -> None:
        while not self.done.wait(1.0):
            self.points.append((time.monotonic() - self.started_at,
                                resident_bytes("ServeReplica:fleetserve:ingress"),
                                resident_bytes(f"ServeReplica:fleetserve:engine-{MODEL}")))


class HeldSampler(threading.Thread):
    """Each second, how many requests Serve has handed to the ingress replica (its own ongoing count, which
    includes those the ingress's event loop has not reached yet) against how many the ingress has admitted
    (fleetserve_in_flight_requests): (seconds since start, held, admitted), -1 where the replica or its
    metrics did not answer within 5 s."""

    def __init__(self, base_url: str, started_at: float) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.points: list[tuple[float, int, float]] = []
        self.done = threading.Event()
        self.started_at = started_at

    def run(self) -> None:
        import httpx
        import ray
        from prometheus_client.parser import text_string_to_metric_families

        name = next(actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
                    if actor["name"].startswith("SERVE_REPLICA") and "#ingress#" in actor["name"])
        replica = ray.get_actor(name, namespace="serve")
        while not self.done.wait(1.0):
            now = time.monotonic() - self.started_at
            try:
                held = ray.get(replica.get_num_ongoing_requests.remote(), timeout=5)
            except ray.exceptions.GetTimeoutError:
                # The call waits for one of the replica's actor slots (Serve sets max_concurrency to
                # max_ongoing_requests): every slot holds a request.
                self.points.append((now, -1, -1.0))
                continue
            try:
                text = httpx.get(f"{self.base_url}/metrics", timeout=5).text
            except httpx.HTTPError:
                self.points.append((now, held, -1.0))
                continue
            admitted = sum(sample.value for family in text_string_to_metric_families(text)
                           for sample in family.samples if sample.name == "fleetserve_in_flight_requests")
            self.points.append((now, held, admitted))


def cpu_hog(start_s: float, seconds: float) -> None:
    """One spinning process per core from start_s for seconds: the CPU starvation a noisy neighbour causes,
    under which the ingress falls behind the requests Serve hands it."""
    time.sleep(start_s)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    time.sleep(seconds)
    for spinner in spinners:
        spinner.kill()
        spinner.wait()


def thread_cores() -> dict[str, dict[str, int]]:
    """Per part of the stack, how many of its processes' threads may run on each set of cores: shows where
    --front-door-cores and --engine-cores put things."""
    import psutil

    from serve_vs_vllm import _group

    counts: dict[str, Counter[str]] = {}
    for process in psutil.process_iter():
        group = _group(process)
        if group is None:
            continue
        try:
            counts.setdefault(group, Counter()).update(
                ",".join(map(str, sorted(os.sched_getaffinity(thread.id)))) for thread in process.threads())
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            continue
    return {group: dict(cores) for group, cores in counts.items()}


def peak_in_flight(records) -> int:
    """Most requests open at once, from the client's records (start to end, refusals included)."""
    events = sorted([(r.start, 1) for r in records] + [(r.start + (r.e2el or 0.0), -1) for r in records])
    peak = level = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def core_set(text: str) -> set[int]:
    """A comma-separated list of cores, for os.sched_setaffinity."""
    return {int(core) for core in text.split(",")}


def main() -> None:
    import ray
    from ray import serve

    from fleetserve.deployments.builders import build_app

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=None, help="of load per setup (60; --memory: 300)")
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--rate", type=float, default=None,
                        help="--memory: offer this many requests/s instead of --factor x the measured capacity")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "overload")
    parser.add_argument("--tenants", action="store_true", help="a light tenant beside a heavy one's flood")
    parser.add_argument("--heavy-factor", type=float, default=3.0, help="--tenants: A's rate over capacity")
    parser.add_argument("--memory", action="store_true", help="the ingress's memory through a long overload")
    parser.add_argument("--warmup-s", type=float, default=30.0, help="--memory: seconds before the heap mark")
    parser.add_argument("--tracemalloc", type=int, default=0, help="--memory: frames per traced allocation")
    parser.add_argument("--memray", action="store_true",
                        help="--memory: record the ingress's native allocations from the mark (needs memray)")
    parser.add_argument("--worker-env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for every Ray worker (repeatable)")
    parser.add_argument("--ingress-max-ongoing", type=int, default=None,
                        help="--memory: limits.ingress_max_ongoing_requests (fleetserve's default otherwise)")
    parser.add_argument("--cpu-hog", default=None, metavar="START:SECONDS",
                        help="--memory: one busy process per core from START s into the overload, for SECONDS")
    parser.add_argument("--engine-cores", type=lambda text: text.split(","), default=ENGINE_CORES, metavar="0,1",
                        help="--tenants: one engine replica per core listed, its vLLM worker pinned there")
    parser.add_argument("--front-door-cores", type=core_set, default=None, metavar="0",
                        help="--tenants: pin Ray and everything it starts (proxy, ingress, replicas' front ends), "
                             "and the load tester, to these cores; the engines' workers pin themselves")
    parser.add_argument("--load-tester-cores", type=core_set, default=None, metavar="1",
                        help="--tenants: move the load tester (this process's main thread) to these cores once "
                             "Ray has started, so that it does not take the front door's")
    parser.add_argument("--max-num-seqs", type=int, default=16,
                        help="--tenants: each engine's max_num_seqs (fewer: a capacity, and so a flood, small "
                             "enough for the front door to carry)")
    parser.add_argument("--fast-path", action="store_true",
                        help="--tenants: on Serve's fast path (server.serve_fast_path: gRPC, HAProxy in front)")
    parser.add_argument("--reserved-slots", type=int, default=1,
                        help="--tenants: limits.num_reserved_slots of the slots-reserved setup")
    parser.add_argument("--setups", nargs="+", choices=[slug(spec[0]) for spec in TENANT_SETUPS], default=None,
                        help="--tenants: run only these setups (default: all)")
    parser.add_argument("--compare-memory", nargs="+", type=Path, metavar="RESULT",
                        help="plot --memory results together, each labelled by its file name (no run)")
    args = parser.parse_args()
    if args.compare_memory:
        plot_memory_runs(args.compare_memory, args.out / "memory-compared.png")
        return
    args.seconds = args.seconds or (300.0 if args.memory else 60.0)
    args.out.mkdir(parents=True, exist_ok=True)
    # Ray's workers inherit this process's environment: set before ray.init.
    if args.tracemalloc:
        os.environ[TRACEMALLOC_ENV] = str(args.tracemalloc)
    if args.memray:
        capture = args.out / "memory-native.bin"
        capture.unlink(missing_ok=True)
        os.environ[MEMRAY_ENV] = str(capture.resolve())
    for assignment in args.worker_env:
        key, _, value = assignment.partition("=")
        os.environ[key] = value
    if args.front_door_cores:
        # Ray's processes inherit this affinity; vLLM's CPU worker then binds its own threads to
        # VLLM_CPU_OMP_THREADS_BIND, so only the engines leave these cores (a GPU node's split, in miniature).
        os.sched_setaffinity(0, args.front_door_cores)
    # As `fleetserve serve` starts its cluster: Serve's proxy on the fast path when the default config has it.
    ray.init(include_dashboard=False, log_to_driver=False,
             runtime_env=job_runtime_env(ServerConfig(serve_fast_path=args.fast_path)))
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    if args.load_tester_cores:
        # Ray's processes keep the affinity they started with; threads this one starts from now inherit it.
        os.sched_setaffinity(0, args.load_tester_cores)
    base_url = f"http://127.0.0.1:{PORT}"
    if args.tenants or args.memory:
        try:
            (tenants if args.tenants else memory)(base_url, args)
        finally:
            serve.shutdown()
            ray.shutdown()
        return
    rows, capacity = [], None
    try:
        for setup, limits in SETUPS.items():
            serve.run(build_app(parse_config({"models": [model_config()], "limits": limits})), name="fleetserve",
                      route_prefix="/")
            if capacity is None:
                probe = asyncio.run(run_benchmark(BenchConfig(base_url=base_url, model=MODEL, ignore_eos=True,
                                                              max_concurrency=32), specs(96)))
                capacity = probe.metrics["request_throughput"]
                print(f"capacity: {capacity:.2f} req/s; offering {args.factor * capacity:.2f} req/s "
                      f"for {args.seconds:g} s", flush=True)
            rate = args.factor * capacity
            sampler = MemorySampler()
            sampler.start()
            config = BenchConfig(base_url=base_url, model=MODEL, ignore_eos=True, request_rate=rate, seed=1,
                                 max_seconds=args.seconds, timeout_s=120.0, goodput=SLO)
            result = asyncio.run(run_benchmark(config, specs(int(rate * args.seconds) + 50)))
            sampler.done.set()
            sampler.join()
            save_results(args.out / f"{setup}.json", [result], detailed=True)
            rows.append((setup, result, sampler.peaks))
            serve.delete("fleetserve")
    finally:
        serve.shutdown()
        ray.shutdown()
    report(rows, capacity)


def memory(base_url: str, args: argparse.Namespace) -> None:
    """The bounded setup at --factor x capacity for --seconds, with the ingress's RSS sampled and its heap
    growth after --warmup-s reported."""
    from ray import serve

    from fleetserve.deployments.builders import build_app

    limits = {**SETUPS["bounded"], **({"ingress_max_ongoing_requests": args.ingress_max_ongoing}
                                       if args.ingress_max_ongoing else {})}
    app_config = parse_config({"models": [model_config()], "limits": limits})
    serve.run(build_app(app_config), name="fleetserve", route_prefix="/")
    ingress = serve.get_deployment_handle("ingress", "fleetserve")
    probe = asyncio.run(run_benchmark(BenchConfig(base_url=base_url, model=MODEL, ignore_eos=True,
                                                  max_concurrency=32), specs(96)))
    rate = args.rate or args.factor * probe.metrics["request_throughput"]
    print(f"capacity: {probe.metrics['request_throughput']:.2f} req/s; offering {rate:.2f} req/s for "
          f"{args.seconds:g} s; heap mark at {args.warmup_s:g} s", flush=True)
    config = BenchConfig(base_url=base_url, model=MODEL, ignore_eos=True, request_rate=rate, seed=1,
                         max_seconds=args.seconds, timeout_s=120.0, goodput=SLO)

    async def load_with_mark():
        bench = asyncio.ensure_future(run_benchmark(config, specs(int(rate * args.seconds) + 50)))
        if args.cpu_hog:
            asyncio.get_running_loop().run_in_executor(None, cpu_hog, *map(float, args.cpu_hog.split(":")))
        await asyncio.sleep(args.warmup_s)
        await ingress.heap_mark.remote()
        return await bench

    sampler = MemorySampler()
    held = HeldSampler(base_url, sampler.started_at)
    sampler.start()
    held.start()
    result = asyncio.run(load_with_mark())
    growth = ingress.heap_growth.remote(25).result()
    for thread in (sampler, held):
        thread.done.set()
        thread.join()
    points = [(t, ingress_rss) for t, ingress_rss, _ in sampler.points]
    warm = [rss for t, rss in points if t >= args.warmup_s]
    summary = {"capacity": probe.metrics["request_throughput"], "rate": rate, "seconds": args.seconds,
               "warmup_s": args.warmup_s, "tracemalloc": args.tracemalloc, "worker_env": args.worker_env,
               "memray": args.memray,
               "completed": result.metrics["completed"], "refused": result.metrics["refused"],
               "rss_points": points, "warm_rss": warm[0], "peak_rss_after_warmup": max(warm),
               "held_points": held.points, "ingress_max_ongoing": args.ingress_max_ongoing,
               "cpu_hog": args.cpu_hog,
               "object_gains": growth.object_gains, "site_gains": growth.site_gains,
               "traced_bytes": growth.traced_bytes}
    suffix = "".join(f"-{slug(part)}" for part in ([f"tracemalloc{args.tracemalloc}"] if args.tracemalloc else [])
                     + (["memray"] if args.memray else []) + args.worker_env
                     + ([f"ingress{args.ingress_max_ongoing}"] if args.ingress_max_ongoing else [])
                     + ([f"hog{args.cpu_hog}"] if args.cpu_hog else []))
    (args.out / f"memory{suffix}.json").write_text(json.dumps(summary, indent=1))
    plot_rss(points, held.points, app_config.limits.ingress_max_ongoing_requests, args.warmup_s,
             args.out / f"memory{suffix}.png")
    print(f"{result.metrics['completed']} completed, {result.metrics['refused']} refused; ingress RSS "
          f"{points[0][1] >> 20} MiB at start, {warm[0] >> 20} MiB warm, peak after warm-up "
          f"{max(warm) >> 20} MiB ({max(warm) / warm[0]:.2f}x warm); requests held by the ingress: peak "
          f"{max((h for _, h, _ in held.points), default=0)} ({sum(h < 0 for _, h, _ in held.points)} samples with "
          f"every slot taken), admitted peak {max((a for _, _, a in held.points), default=0):.0f}")
    print("objects gained since the mark:", growth.object_gains[:15])
    for site, num_bytes, num_blocks in growth.site_gains[:15]:
        print(f"{num_bytes / 2**10:9.1f} KiB {num_blocks:7d} blocks  {site}")
    if growth.native_capture:
        report_native(Path(growth.native_capture))


# CPython's own evaluation frames: every Python call has them, so they say nothing about the site.
INTERPRETER_FRAMES = ("_PyEval", "_PyObject_", "PyObject_", "_PyVectorcall", "_PyFunction", "method_vectorcall",
                      "cfunction_", "gen_send", "PyGen_am", "do_call_core", "slot_tp", "type_call", "PyIter_Send",
                      "task_step", "TaskStepMethWrapper")


def report_native(capture: Path, num_sites: int = 8, num_frames: int = 10) -> None:
    """What memray saw natively after the mark, by call stack: the allocations live at the peak, and those
    still live at the end."""
    import memray

    reader = memray.FileReader(capture)
    print(f"native, since the mark ({capture}): peak {reader.metadata.peak_memory / 2**20:.1f} MiB live")
    for title, records in (("live at the peak", reader.get_high_watermark_allocation_records(merge_threads=True)),
                           ("live at the end", reader.get_leaked_allocation_records(merge_threads=True))):
        sites: dict[str, list[int]] = {}
        for record in records:
            frames = [function for function, _, _ in record.native_stack_trace()
                      if not function.startswith(INTERPRETER_FRAMES)]
            totals = sites.setdefault(" <- ".join(frame[:60] for frame in frames[:num_frames]) or "?", [0, 0])
            totals[0] += record.size
            totals[1] += record.n_allocations
        print(f"{title}: {sum(size for size, _ in sites.values()) / 2**20:.1f} MiB")
        for stack, (size, num) in sorted(sites.items(), key=lambda item: -item[1][0])[:num_sites]:
            print(f"{size / 2**20:8.2f} MiB {num:7d}  {stack}")


def plot_rss(points: list[tuple[float, int]], held_points: list[tuple[float, int, float]], max_held: int,
             warmup_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 3.5))
    axis.plot([t for t, _ in points], [rss / 2**20 for _, rss in points], label="ingress RSS")
    axis.axvline(warmup_s, color="grey", linestyle="--", label="heap mark (warm)")
    axis.set_xlabel("seconds into the overload")
    axis.set_ylabel("MiB")
    axis.legend(loc="upper left")
    if held_points:
        counts = axis.twinx()
        counts.plot([t for t, h, _ in held_points if h >= 0], [h for _, h, _ in held_points if h >= 0],
                    color="tab:red", alpha=0.6, label="held by the ingress (Serve)")
        counts.plot([t for t, h, _ in held_points if h < 0], [max_held for _, h, _ in held_points if h < 0], "x",
                    color="tab:red", label=f"every slot taken ({max_held})")
        counts.plot([t for t, _, a in held_points if a >= 0], [a for _, _, a in held_points if a >= 0],
                    color="tab:green", alpha=0.6, label="admitted")
        counts.set_ylabel("requests")
        counts.legend(loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_memory_runs(paths: list[Path], out: Path) -> None:
    """The ingress's RSS over time in --memory runs, each labelled by its file name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 3.5))
    for path in paths:
        run = json.loads(path.read_text())
        label = path.stem.removeprefix("memory-")
        axis.plot([t for t, _ in run["rss_points"]], [rss / 2**20 for _, rss in run["rss_points"]],
                  label=f"{label}: peak/warm {run['peak_rss_after_warmup'] / run['warm_rss']:.2f}x")
    axis.axvline(run["warmup_s"], color="grey", linestyle="--", label="warm")
    axis.set_xlabel("seconds into the overload (2x capacity)")
    axis.set_ylabel("ingress RSS (MiB)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)
    print(f"wrote {out}")


def tenants(base_url: str, args: argparse.Namespace) -> None:
    """B alone at 0.2x capacity, then B beside A at --heavy-factor x, with fair shares on and off."""
    from ray import serve

    from serve_vs_vllm import cpu_seconds

    from fleetserve.deployments.builders import build_app

    def bench(tenant: str, rate: float) -> BenchConfig:
        return BenchConfig(base_url=base_url, model=MODEL, ignore_eos=True, request_rate=rate,
                           seed=SEEDS[tenant], max_seconds=args.seconds, timeout_s=120.0, goodput=SLO,
                           api_key=KEYS[tenant])

    async def together(configs: list[BenchConfig]) -> list:
        return await asyncio.gather(*[run_benchmark(config, specs(int(config.request_rate * args.seconds) + 50))
                                      for config in configs])

    rows: dict[str, dict] = {}
    # Per setup, the cores each part of the stack used while the tenants ran (user + system CPU / wall).
    cores: dict[str, dict[str, float]] = {}
    capacity = None
    chosen = [spec for spec in TENANT_SETUPS if args.setups is None or slug(spec[0]) in args.setups]
    for setup, fair_share_from, priority_engines, heavy_batch, reserve in chosen:
        config = tenants_config(fair_share_from, priority_engines, heavy_batch, args.reserved_slots if reserve else 0,
                                args.engine_cores, args.max_num_seqs, args.fast_path)
        serve.run(build_app(parse_config(config)), name="fleetserve", route_prefix="/")
        if capacity is None:
            probe = asyncio.run(run_benchmark(BenchConfig(base_url=base_url, model=MODEL, ignore_eos=True,
                                                          max_concurrency=32, api_key=KEYS["light"]), specs(96)))
            capacity = probe.metrics["request_throughput"]
            print("threads by part and cores:", dict(sorted(thread_cores().items())))
            print(f"capacity: {capacity:.2f} req/s; B at {0.2 * capacity:.2f} req/s, A at "
                  f"{args.heavy_factor * capacity:.2f} req/s", flush=True)
            (alone,) = asyncio.run(together([bench("light", 0.2 * capacity)]))
            rows["B alone"] = {"B": alone}
            save_results(args.out / "tenants-b-alone.json", [alone], detailed=True)
        before, started = cpu_seconds(), time.perf_counter()
        light, heavy = asyncio.run(together([bench("light", 0.2 * capacity),
                                             bench("heavy", args.heavy_factor * capacity)]))
        after, elapsed = cpu_seconds(), time.perf_counter() - started
        cores[setup] = {part: (after[part] - before.get(part, 0.0)) / elapsed for part in after}
        rows[setup] = {"B": light, "A": heavy}
        save_results(args.out / f"tenants-{slug(setup)}.json", [light, heavy], detailed=True)
        serve.delete("fleetserve")
    alone = rows["B alone"]["B"].metrics
    setups = [setup for setup, *_ in chosen]
    print(f"\n| figure | B alone | {' | '.join(f'B beside A, {setup}' for setup in setups)} |")
    print(f"|---|---|{'---|' * len(setups)}")
    for name, key, fmt in (("B goodput, TTFT <= 5 s (req/s)", "request_goodput", "{:.2f}"),
                           ("B median TTFT (ms)", "median_ttft_ms", "{:.0f}"),
                           ("B p99 TTFT (ms)", "p99_ttft_ms", "{:.0f}"), ("B completed", "completed", "{}"),
                           ("B refused", "refused", "{}")):
        cells = [fmt.format(rows[setup]["B"].metrics[key]) for setup in ("B alone", *setups)]
        print(f"| {name} | {' | '.join(cells)} |")
    # A's refusals show how long the front door itself takes under the flood, apart from the engines' queue.
    for name, key in (("A median TTFT (ms)", "median_ttft_ms"), ("A median time to refusal (ms)", "median_refusal_ms"),
                      ("A p99 time to refusal (ms)", "p99_refusal_ms")):
        cells = [f"{rows[setup]['A'].metrics[key]:.0f}" for setup in setups]
        print(f"| {name} | | {' | '.join(cells)} |")
    for part in sorted({part for used in cores.values() for part in used}):
        print(f"| cores: {part} | | {' | '.join(f'{cores[setup].get(part, 0.0):.2f}' for setup in setups)} |")
    for setup in setups:
        b, a = rows[setup]["B"].metrics, rows[setup]["A"].metrics
        print(f"{setup}: B goodput {b['request_goodput'] / alone['request_goodput']:.2f}x of alone, B p99 TTFT "
              f"{b['p99_ttft_ms'] / alone['p99_ttft_ms']:.2f}x; A completed {a['completed']}, refused {a['refused']}")
    print(f"\ncapacity {capacity:.2f} req/s (closed burst of 96)")


def report(rows, capacity: float) -> None:
    print(f"\n| figure | {' | '.join(setup for setup, _, _ in rows)} |")
    print(f"|---|{'---|' * len(rows)}")
    figures = [
        ("requests sent", lambda r, _: len(r.records)),
        ("completed", lambda r, _: r.metrics["completed"]),
        ("refused (503 + Retry-After)", lambda r, _: r.metrics["refused_with_retry_after"]),
        ("client timeouts (120 s)", lambda r, _: sum("Timeout" in (x.error or "") for x in r.records)),
        ("other failures", lambda r, _: r.metrics["failed"] - r.metrics["refused"]
         - sum("Timeout" in (x.error or "") for x in r.records)),
        ("throughput (req/s)", lambda r, _: f"{r.metrics['request_throughput']:.2f}"),
        ("goodput, TTFT <= 5 s (req/s)", lambda r, _: f"{r.metrics['request_goodput']:.2f}"),
        ("median TTFT (ms)", lambda r, _: f"{r.metrics['median_ttft_ms']:.0f}"),
        ("p99 TTFT (ms)", lambda r, _: f"{r.metrics['p99_ttft_ms']:.0f}"),
        ("median TPOT (ms)", lambda r, _: f"{r.metrics['median_tpot_ms']:.0f}"),
        ("p99 TPOT (ms)", lambda r, _: f"{r.metrics['p99_tpot_ms']:.0f}"),
        ("peak requests open (client)", lambda r, _: peak_in_flight(r.records)),
        ("peak ingress RSS (MiB)", lambda _, p: p["ingress"] >> 20),
        ("peak engine RSS (MiB)", lambda _, p: p["engines"] >> 20),
    ]
    for name, value in figures:
        print(f"| {name} | {' | '.join(str(value(result, peaks)) for _, result, peaks in rows)} |")
    print(f"\ncapacity {capacity:.2f} req/s (closed burst of 96)")


if __name__ == "__main__":
    main()
