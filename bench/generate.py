"""Generation client benchmark against `eaglenest serve --echo` (the client is measured, not a model).

(a) latency 200 ms, concurrency 128: achieved requests/s as a share of the ideal 128 / 0.2 = 640.
(b) latency 0: requests/s and client CPU-ms per request for eaglenest and, in the same run, for the
    approach of popular regeneration scripts: the official openai client, one client per request,
    in a thread pool of the same width. Prints the ratio.
(c) several shards, one cap: 6 shards x 500 prompts against one endpoint capped at 128, whose
    latency is lognormal (median 1 s, sigma 1, like reasoning lengths). Each shard is a separate
    job process (as Snakemake runs them), --shard-jobs at a time, sharing the cap through the
    slot locks. Prints the endpoint's utilisation (busy slot-seconds / (cap x wall)), the most
    requests the server saw at once, and the wall time against the ideal (sum of latencies / cap)
    and against the best a first-come dispatcher can do with these latencies (simulated).
    Goal: utilisation >= 0.9, never above the cap.
(d) streaming cost: client CPU per request, streamed (one chunk per token) against plain.

Usage: python bench/generate.py [--requests-a 3200] [--requests-b 2000] [--shards 6]
                                [--shard-size 500] [--shard-jobs 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import heapq
import json
import math
import platform
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import polars as pl

from eaglenest.client.endpoints import Endpoint
from eaglenest.common.config import validate_config
from eaglenest.common.io import write_json
from eaglenest.demo.server_process import running_server
from eaglenest.settings.generate import GenerationClientSettings, RequestSettings
from eaglenest.stages.generate.generate import generate_records
from eaglenest.stages.generate.request import GenerationSettings, sample_seed

MODEL = "echo-model"
CONCURRENCY = 128


def make_prompts(n: int) -> list[dict]:
    prompts = []
    for i in range(n):
        messages = [{"role": "user", "content": f"bench question {i}"}]
        digest = hashlib.sha256(json.dumps(messages).encode()).hexdigest()[:16]
        prompts.append({"id": digest, "messages": messages})
    return prompts


def measure(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads) of fn()."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def figures(n: int, wall: float, cpu: float, **extra: int) -> dict:
    """What every client run reports: throughput and client CPU per request."""
    return {
        "requests": n,
        "wall_s": wall,
        "rps": n / wall,
        "cpu_ms_per_request": 1000 * cpu / n,
        **extra,
    }


def run_eaglenest(url: str, n: int, stream: bool = False, prompt_chars: int = 0) -> dict:
    prompts = make_prompts(n)
    for prompt in prompts:
        prompt["messages"][0]["content"] += " x" * (prompt_chars // 2)
    config = validate_config(
        {"target": {"model": MODEL}, "generation": {"concurrency": CONCURRENCY, "max_tokens": 4096}}
    )
    request, client = (
        RequestSettings.from_config(config),
        GenerationClientSettings.from_config(config),
    )
    settings = GenerationSettings.from_parts(request, client, return_token_ids=True, layout="vllm")
    settings = dataclasses.replace(settings, stream=stream)
    with tempfile.TemporaryDirectory() as tmp:
        journal = Path(tmp) / "journal.jsonl"
        records: dict = {}

        def go() -> None:
            records.update(
                asyncio.run(generate_records(prompts, [Endpoint(url)], settings, journal))
            )

        wall, cpu = measure(go)
    captured = sum(1 for r in records.values() if r["reasoning"].strip())
    return figures(n, wall, cpu, reasoning_captured=captured)


def run_bare_aiohttp(url: str, n: int) -> dict:
    """The floor any Python client can reach here: a bare aiohttp loop, no journal, no retries.

    Server and client share this machine's 2 cores, and 128 requests that start together come
    back together, so each wave queues for a few ms in both event loops; this reference shows how
    much of the gap to the ideal is that, not the client."""
    import aiohttp

    async def go_async() -> None:
        queue = list(range(n))
        connector = aiohttp.TCPConnector(limit=CONCURRENCY)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def worker() -> None:
                while queue:
                    i = queue.pop()
                    body = {"model": MODEL, "messages": [{"role": "user", "content": f"q {i}"}]}
                    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                        await response.text()

            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))

    wall, cpu = measure(lambda: asyncio.run(go_async()))
    return figures(n, wall, cpu)


def run_openai_baseline(url: str, n: int) -> dict:
    from openai import OpenAI

    def one(i: int) -> str | None:
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=5)
        response = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"bench question {i}"}],
            max_tokens=64,
        )
        # What those scripts read: reasoning_content (absent when the server says `reasoning`).
        return getattr(response.choices[0].message, "reasoning_content", None)

    results: list = []

    def go() -> None:
        with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
            results.extend(pool.map(one, range(n)))

    wall, cpu = measure(go)
    return figures(n, wall, cpu, reasoning_captured=sum(1 for r in results if r))


# One shard job, as Snakemake's generate_responses runs it: a process of its own.
SHARD_JOB = """
import sys
from eaglenest.common.config import validate_config
from eaglenest.settings.generate import GenerationClientSettings, RequestSettings
from eaglenest.stages.generate.generate import generate_shard
prompts, url, slots, out = sys.argv[1:5]
config = validate_config({
    "target": {"model": "echo-model"},
    "endpoints": [{"url": url, "max_concurrency": 128}],
    "generation": {"concurrency": 128, "slots_dir": slots, "max_tokens": 4096},
})
generate_shard(
    prompts, out + "/probe.json", out + "/" + prompts.rsplit("/", 1)[-1].replace(".", ".raw."),
    RequestSettings.from_config(config), GenerationClientSettings.from_config(config),
    prompts + ".journal", activity=prompts + ".activity.json",
)
"""


def greedy_wall_s(latencies: list[float], cap: int) -> float:
    """Wall time of dispatching requests in order to the first free of `cap` slots: the best any
    scheduler that does not know latencies in advance does here."""
    slots = [0.0] * cap
    for latency in latencies:
        heapq.heappush(slots, heapq.heappop(slots) + latency)
    return max(slots)


def echo_latencies(ids: list[str], median_s: float, sigma: float) -> list[float]:
    """The latency the echo server draws for each request (EchoBackend.latency: the request's
    seed, which derives from the run seed 0 and the sample id)."""
    return [
        median_s * math.exp(sigma * random.Random(sample_seed(0, i)).gauss(0.0, 1.0)) for i in ids
    ]


def run_shard_jobs(url: str, work: Path, shards: int, shard_size: int, jobs: int) -> dict:
    """`shards` shard jobs, `jobs` at a time, against `url`; figures from their activity files."""
    write_json(work / "probe.json", {"token_ids": {"supported": True, "layout": "vllm"}})
    paths, prompts = [], make_prompts(shards * shard_size)
    for shard in range(shards):
        rows = prompts[shard * shard_size : (shard + 1) * shard_size]
        paths.append(work / f"{shard:05d}.parquet")
        pl.DataFrame(rows).write_parquet(paths[-1])
    slots = str(work / "slots")
    waiting, running = list(paths), []
    while waiting or running:
        running = [job for job in running if job.poll() is None]
        while waiting and len(running) < jobs:
            command = [sys.executable, "-c", SHARD_JOB, str(waiting.pop(0)), url, slots, str(work)]
            running.append(subprocess.Popen(command, stderr=subprocess.DEVNULL))
        time.sleep(0.05)
    activities = [json.loads(Path(f"{p}.activity.json").read_text()) for p in paths]
    wall_s = max(a["finished_at"] for a in activities) - min(a["started_at"] for a in activities)
    busy_s = sum(a["endpoints"][0]["busy_s"] for a in activities)
    raw = pl.concat([pl.read_parquet(str(p).replace(".parquet", ".raw.parquet")) for p in paths])
    return {"ids": raw["id"].to_list(), "errors": raw["error_kind"].drop_nulls().len()} | {
        "shards": shards,
        "shard_size": shard_size,
        "shard_jobs_at_once": jobs,
        "wall_s": wall_s,
        "utilisation": busy_s / (CONCURRENCY * wall_s),
    }


def multi_shard(args: argparse.Namespace) -> dict:
    results = {}
    for jobs in sorted(set(args.shard_jobs)):
        with (
            running_server(
                model_name=MODEL,
                echo=True,
                echo_latency_s=args.median_latency_s,
                echo_latency_sigma=args.latency_sigma,
                max_batch_size=CONCURRENCY,
            ) as url,
            tempfile.TemporaryDirectory() as tmp,
        ):
            figures_ = run_shard_jobs(url, Path(tmp), args.shards, args.shard_size, jobs)
            figures_["max_in_flight"] = httpx.get(f"{url}/stats").json()["max_in_flight"]
        latencies = echo_latencies(figures_.pop("ids"), args.median_latency_s, args.latency_sigma)
        figures_["ideal_s"] = sum(latencies) / CONCURRENCY
        figures_["first_come_s"] = greedy_wall_s(latencies, CONCURRENCY)
        results[f"jobs_{jobs}"] = figures_
        print(
            f"(c) {args.shards} shards x {args.shard_size}, cap {CONCURRENCY}, latency lognormal "
            f"(median {args.median_latency_s} s, sigma {args.latency_sigma}), {jobs} shard job(s) "
            f"at once: wall {figures_['wall_s']:.1f} s, utilisation "
            f"{figures_['utilisation']:.3f} (goal >= 0.9), most in flight "
            f"{figures_['max_in_flight']} (cap {CONCURRENCY}); ideal {figures_['ideal_s']:.1f} s "
            f"(ratio {figures_['wall_s'] / figures_['ideal_s']:.2f}), first-come bound "
            f"{figures_['first_come_s']:.1f} s (ratio "
            f"{figures_['wall_s'] / figures_['first_come_s']:.2f}); errors {figures_['errors']}"
        )
    return results


def streaming_cost(n: int) -> dict:
    """Client CPU per request of ~1,000-token answers, streamed against plain."""
    with running_server(model_name=MODEL, echo=True) as url:
        run_eaglenest(url, 64, stream=True, prompt_chars=2000)
        streamed = run_eaglenest(url, n, stream=True, prompt_chars=2000)
        plain = run_eaglenest(url, n, stream=False, prompt_chars=2000)
    ratio = streamed["cpu_ms_per_request"] / plain["cpu_ms_per_request"]
    print(
        f"(d) ~1,000-token answers: streamed {streamed['cpu_ms_per_request']:.2f} CPU-ms/request "
        f"({streamed['rps']:.0f} req/s), plain {plain['cpu_ms_per_request']:.2f} "
        f"({plain['rps']:.0f} req/s): streaming costs {ratio:.1f}x the client CPU"
    )
    return {"streamed": streamed, "plain": plain, "cpu_ratio": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests-a", type=int, default=3200)
    parser.add_argument("--requests-b", type=int, default=2000)
    parser.add_argument("--shards", type=int, default=6)
    parser.add_argument("--shard-size", type=int, default=500)
    parser.add_argument(
        "--shard-jobs",
        type=int,
        nargs="+",
        default=[1, 4],
        help="shard jobs at once in (c), one run each (1: a shard at a time, as before)",
    )
    parser.add_argument("--median-latency-s", type=float, default=1.0)
    parser.add_argument("--latency-sigma", type=float, default=1.0)
    parser.add_argument("--stream-requests", type=int, default=500)
    parser.add_argument("--only-multi-shard", action="store_true", help="run (c) and (d) only")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    results: dict = {
        "machine": {"platform": platform.platform(), "python": platform.python_version()}
    }
    results["c_multi_shard"] = multi_shard(args)
    results["d_streaming"] = streaming_cost(args.stream_requests)
    if not args.only_multi_shard:
        client_figures(args, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def client_figures(args: argparse.Namespace, results: dict) -> None:
    """(a) and (b)."""

    with running_server(model_name=MODEL, echo=True, echo_latency_s=0.2) as url:
        run_eaglenest(url, 256)  # warm-up: connections, imports
        a = run_eaglenest(url, args.requests_a)
        bare = run_bare_aiohttp(url, args.requests_a)
    ideal = CONCURRENCY / 0.2
    a["share_of_ideal"] = a["rps"] / ideal
    a["bare_aiohttp_rps"] = bare["rps"]
    a["share_of_bare_aiohttp"] = a["rps"] / bare["rps"]
    results["a_latency_200ms"] = a
    print(
        f"(a) latency 200 ms, concurrency {CONCURRENCY}: {a['rps']:.0f} req/s = "
        f"{a['share_of_ideal']:.3f} of ideal {ideal:.0f} (goal >= 0.95); "
        f"client CPU {a['cpu_ms_per_request']:.2f} ms/request"
    )
    print(
        f"    bare aiohttp loop, same server: {bare['rps']:.0f} req/s; eaglenest reaches "
        f"{a['share_of_bare_aiohttp']:.3f} of it (the rest is server and client sharing 2 cores)"
    )

    with running_server(model_name=MODEL, echo=True, echo_latency_s=0.0) as url:
        run_eaglenest(url, 256)
        ours = run_eaglenest(url, args.requests_b)
        base = run_openai_baseline(url, args.requests_b)
    ratio = ours["rps"] / base["rps"]
    results["b_latency_0"] = {
        "eaglenest": ours,
        "openai_threadpool": base,
        "rps_ratio": ratio,
        "cpu_ratio": base["cpu_ms_per_request"] / ours["cpu_ms_per_request"],
    }
    print(
        f"(b) latency 0: eaglenest {ours['rps']:.0f} req/s at {ours['cpu_ms_per_request']:.2f} "
        f"CPU-ms/request, reasoning captured {ours['reasoning_captured']}/{ours['requests']}"
    )
    print(
        f"    openai client + {CONCURRENCY} threads: {base['rps']:.0f} req/s at "
        f"{base['cpu_ms_per_request']:.2f} CPU-ms/request, reasoning captured "
        f"{base['reasoning_captured']}/{base['requests']}"
    )
    print(
        f"    ratio: {ratio:.2f}x requests/s (goal >= 2), "
        f"{results['b_latency_0']['cpu_ratio']:.1f}x less CPU per request"
    )


if __name__ == "__main__":
    main()
