"""Generation client benchmark against `eaglenest serve --echo` (the client is measured, not a model).

(a) latency 200 ms, concurrency 128: achieved requests/s as a share of the ideal 128 / 0.2 = 640.
(b) latency 0: requests/s and client CPU-ms per request for eaglenest and, in the same run, for the
    approach of popular regeneration scripts: the official openai client, one client per request,
    in a thread pool of the same width. Prints the ratio.

Usage: python bench/generate.py [--requests-a 3200] [--requests-b 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import platform
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eaglenest.client.endpoints import Endpoint
from eaglenest.common.config import validate_config
from eaglenest.demo.server_process import running_server
from eaglenest.settings.generate import GenerationClientSettings, RequestSettings
from eaglenest.stages.generate import GenerationSettings, generate_records

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


def run_eaglenest(url: str, n: int) -> dict:
    prompts = make_prompts(n)
    config = validate_config(
        {"target": {"model": MODEL}, "generation": {"concurrency": CONCURRENCY, "max_tokens": 64}}
    )
    request, client = (
        RequestSettings.from_config(config),
        GenerationClientSettings.from_config(config),
    )
    settings = GenerationSettings.from_parts(request, client, return_token_ids=True)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests-a", type=int, default=3200)
    parser.add_argument("--requests-b", type=int, default=2000)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    results: dict = {
        "machine": {"platform": platform.platform(), "python": platform.python_version()}
    }
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
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
