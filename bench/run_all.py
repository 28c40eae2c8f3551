"""Run every benchmark in bench/ and merge their figures into one JSON file with the machine's facts.

Each `bench/<name>.py` (not this file, not `_*.py` helpers) runs in its own process with
`--json <tmpfile>`; its figures land under `benches.<name>.figures` with its wall time, exit status
and, when it failed, the tail of its output. A failing bench is recorded and the others still run;
the exit status is 1 when any failed. `--quick` passes small sizes (QUICK_ARGS) to the benches that
take size flags, for CI; by default every bench runs at its normal size. A bench of NEEDS_GPU is
recorded as skipped, not failed, on a machine whose nvidia-smi lists no GPU.

Usage: python bench/run_all.py [--out bench/results.json] [--only generate ...] [--quick]
                               [--timeout-s 3600] [--bench-dir DIR]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
# Sizes for a CI-size run (`--quick`); a bench not listed runs at its defaults.
QUICK_ARGS = {
    "dag": ["--shards", "100", "500"],
    "drafter_window": ["--lengths", "512", "--windows", "128"],
    "generate": [
        "--requests-a",
        "320",
        "--requests-b",
        "200",
        "--shards",
        "3",
        "--shard-size",
        "100",
        "--median-latency-s",
        "0.2",
        "--stream-requests",
        "100",
    ],
    "tokenization": ["--samples", "300", "--reasoning-repeat", "1", "4", "--runs", "1"],
    "gpu_check": ["--small"],
    "hidden_states": ["--samples", "24", "--max-len", "256", "--rounds", "1", "--shards", "2"],
    "train": ["--quick"],
    "families": ["--quick"],
    "capture_waiting": ["--quick"],
}
# Benches that test CUDA paths only: skipped where nvidia-smi lists no GPU.
NEEDS_GPU = {"gpu_check"}
LIBRARIES = (
    "eaglenest", "torch", "transformers", "tokenizers", "safetensors", "numpy", "polars",
    "pandera", "snakemake", "aiohttp", "httpx", "openai", "matplotlib", "vllm", "sglang",
)  # fmt: skip
OUTPUT_TAIL_LINES = 40


def discover(bench_dir: Path) -> list[Path]:
    """The bench scripts of a folder: every .py but this runner and `_`-prefixed helpers."""
    return sorted(
        p
        for p in bench_dir.glob("*.py")
        if p.name != Path(__file__).name and not p.name.startswith("_")
    )


def _command_output(command: list[str], cwd: Path | None = None) -> str | None:
    if shutil.which(command[0]) is None:
        return None
    try:
        result = subprocess.run(
            command, cwd=cwd, capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def gpu_names() -> list[str]:
    names = _command_output(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    return [n.strip() for n in names.splitlines() if n.strip()] if names else []


def machine_info() -> dict:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    commit = _command_output(["git", "rev-parse", "HEAD"], cwd=REPO)
    dirty = _command_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO)
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "versions": versions,
        "git_commit": commit,
        "git_dirty": bool(dirty) if commit else None,
        "gpus": gpu_names(),
    }


def run_bench(script: Path, args: list[str], timeout_s: float) -> dict:
    """Run one bench with --json, echoing its output; its record for results.json."""
    with tempfile.TemporaryDirectory() as tmp:
        json_path = Path(tmp) / "figures.json"
        command = [sys.executable, str(script), *args, "--json", str(json_path)]
        print(f"==> {script.stem}: {shlex.join(command[1:])}", flush=True)
        tail: collections.deque[str] = collections.deque(maxlen=OUTPUT_TAIL_LINES)
        started = time.perf_counter()
        # Its own session: on a timeout the whole group goes (a bench may start a server).
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
        reader = threading.Thread(target=_echo, args=(process.stdout, tail), daemon=True)
        reader.start()
        status, returncode = "ok", None
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            status = "timeout"
            tail.append(f"run_all: killed after {timeout_s:.0f} s")
        reader.join(timeout=10)
        wall_s = time.perf_counter() - started
        figures = None
        if status == "ok" and returncode != 0:
            status = "failed"
        elif status == "ok":
            try:
                figures = json.loads(json_path.read_text())
            except (OSError, json.JSONDecodeError) as err:
                status = "failed"
                tail.append(f"run_all: exit status 0 but no readable --json output ({err})")
    record = {
        "status": status,
        "returncode": returncode,
        "wall_s": round(wall_s, 2),
        "args": args,
        "figures": figures,
    }
    if status != "ok":
        record["output_tail"] = list(tail)
    print(f"<== {script.stem}: {status} in {wall_s:.1f} s", flush=True)
    return record


def skipped(script: Path, args: list[str], reason: str) -> dict:
    print(f"<== {script.stem}: skipped: {reason}", flush=True)
    return {"status": "skipped", "reason": reason, "returncode": None, "wall_s": 0.0,
            "args": args, "figures": None}  # fmt: skip


def _echo(stream, tail: collections.deque) -> None:
    for line in stream:
        print(f"    {line}", end="", flush=True)
        tail.append(line.rstrip("\n"))


def write_results(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(results, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results.json")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these benches")
    parser.add_argument("--quick", action="store_true", help="CI sizes (QUICK_ARGS)")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per bench")
    parser.add_argument("--bench-dir", type=Path, default=BENCH_DIR)
    args = parser.parse_args(argv)

    scripts = discover(args.bench_dir)
    if args.only:
        unknown = sorted(set(args.only) - {s.stem for s in scripts})
        if unknown:
            parser.error(f"no bench named {unknown}; found {[s.stem for s in scripts]}")
        scripts = [s for s in scripts if s.stem in args.only]
    started = time.perf_counter()
    results = {
        "machine": machine_info(),
        "mode": "quick" if args.quick else "normal",
        "benches": {},
    }
    for script in scripts:
        bench_args = QUICK_ARGS.get(script.stem, []) if args.quick else []
        if script.stem in NEEDS_GPU and not results["machine"]["gpus"]:
            results["benches"][script.stem] = skipped(script, bench_args, "no GPU (nvidia-smi)")
        else:
            results["benches"][script.stem] = run_bench(script, bench_args, args.timeout_s)
        results["wall_s"] = round(time.perf_counter() - started, 2)
        results["failed"] = [
            n for n, r in results["benches"].items() if r["status"] not in ("ok", "skipped")
        ]
        write_results(args.out, results)  # after every bench: a killed run keeps what it has
    if not scripts:
        results["wall_s"], results["failed"] = 0.0, []
        write_results(args.out, results)
    summary = ", ".join(
        f"{n} {r['status']} ({r['wall_s']:.0f} s)" for n, r in results["benches"].items()
    )
    print(f"wrote {args.out}: {summary or 'no benches'}")
    if results["failed"]:
        print(f"failed: {', '.join(results['failed'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
