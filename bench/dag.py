"""DAG benchmark: wall time and peak memory of a dry run (`snakemake -n`) as the shards grow.

Shard ids come from the config at parse time (ceil(prompts.max_samples / prompts.shard_size)) and a
dry run reads no data, so each run is the workflow in an empty temp workdir with `shard_size: 1`
and `max_samples` = shards: every per-shard job of every stage is planned (generate with its
prompt slice, prepare_samples = validate + tokenize, hidden states: 3 per shard) plus the
once-per-run jobs. Four measurements per size:

- listing: `snakemake -n`, output to a file, as a user sees it (every job printed), with the
  default config (the demo: its target is built by the workflow, so every shard's samples and
  hidden-state jobs also depend on that directory, and the embedded server logs per shard). The
  goal, <= 30 s at 5,000 shards on 2 cores with time linear in shards, is checked on this one.
- real target: the same listing with `--real-config` (default config/examples/qwen3-8b.yaml, an
  external endpoint and a target on disk), what a run of thousands of shards plans: about 5%
  less work for Snakemake than the demo's (Python calls), so the listing is the stricter check.
- plan: `snakemake -n -q` with the default config, the plan with only the job counts printed;
  what a real run pays before its first job (it prints each job when it starts).
- floor: `snakemake -n` over a bare workflow with the same jobs per shard (one input, output and
  log each, `script:`), i.e. Snakemake's own cost for that many jobs on this machine. The ratio
  listing / floor is what the workflow adds, and holds when the machine is slower or faster.

Peak memory is the max RSS of the snakemake process (wait4), printed for each of the four;
`eaglenest plan` states a run's planning cost from the plan's CPU seconds and peak RSS at 1,000
and 10,000 shards (eaglenest.run.planning_cost). Timings on a shared machine drift by
tens of percent over minutes: take the best of `--repeat` runs, and compare the ratios.

Usage: python bench/dag.py [--shards 100 1000 5000] [--repeat 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The same copy of the workflow the workflow tests make (tests/support/workflow.py).
sys.path.insert(0, str(REPO / "tests"))
from support.stand_in_vllm import stand_in_vllm_folder
from support.workflow import copy_workflow

GOAL_S_AT_5000 = 30.0


def dry_run(
    workdir: Path,
    shards: int,
    quiet: bool = False,
    config: Path | None = None,
    code_versions: str | None = None,
) -> dict:
    """One `snakemake -n` over `shards` shards: wall time, peak RSS and the jobs it planned;
    `code_versions`: the code versions' cache directory (EAGLENEST_CACHE_DIR; `off`: none)."""
    override = workdir / f"shards-{shards}.yaml"
    override.write_text(json.dumps({"prompts": {"max_samples": shards, "shard_size": 1}}))
    # A real target's config alone, else the embedded demo (read only without --configfile).
    command = [sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--configfile"]
    demo = workdir / "config" / "config.yaml"  # the floor workflow has none: its override only
    command += [str(config)] if config else ["config/config.yaml"] if demo.exists() else []
    command += [str(override)]
    command += ["--quiet"] if quiet else []
    out_path = workdir / f"dry-run-{shards}.log"
    with out_path.open("w") as out:
        start = time.perf_counter()
        env = {**os.environ, "EAGLENEST_CACHE_DIR": code_versions} if code_versions else None
        process = subprocess.Popen(
            command, cwd=workdir, stdout=out, stderr=subprocess.STDOUT, env=env
        )
        _, status, usage = os.wait4(process.pid, 0)
        wall_s = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    output = out_path.read_text()
    if process.returncode != 0:
        raise RuntimeError(f"dry run of {shards} shards failed:\n{output[-3000:]}")
    total = re.search(r"^total\s+(\d+)$", output, flags=re.MULTILINE)
    return {
        "shards": shards,
        "jobs": int(total.group(1)) if total else None,
        "wall_s": round(wall_s, 3),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),  # Linux: KiB
        "output_mib": round(out_path.stat().st_size / 2**20, 2),
    }


JOBS_PER_SHARD = 3  # generate_responses, prepare_samples, extract_hidden_states


def write_floor_workflow(workdir: Path) -> None:
    """A bare workflow with JOBS_PER_SHARD chained jobs per shard, read by the same override file
    (prompts.max_samples = shards): Snakemake's own cost for that many jobs."""
    rules = []
    for step in range(JOBS_PER_SHARD):
        source = f'\n    input:\n        "r/{step - 1}/{{shard}}"' if step else ""
        rules.append(
            f'rule step_{step}:{source}\n    output:\n        "r/{step}/{{shard}}"\n'
            f'    log:\n        "l/{step}/{{shard}}"\n    script:\n        "s.py"\n'
        )
    last = JOBS_PER_SHARD - 1
    shards = '[f"{i:05d}" for i in range(config["prompts"]["max_samples"])]'
    (workdir / "Snakefile").write_text(
        f'rule all:\n    input:\n        expand("r/{last}/{{shard}}", shard={shards})\n\n\n'
        + "\n\n".join(rules)
    )
    (workdir / "s.py").write_text("")


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = intercept + slope * x."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var_x = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var_x if var_x else 0.0
    return mean_y - slope * mean_x, slope


def growth(runs: list[dict]) -> dict:
    """How time and memory grow: per step, the time ratio against the shard ratio (1.0 = linear,
    on the time above the fixed start-up cost), and a linear fit of time and memory."""
    xs = [r["shards"] for r in runs]
    intercept_s, slope_s = linear_fit(xs, [r["wall_s"] for r in runs])
    mem_intercept, mem_slope = linear_fit(xs, [r["peak_rss_mib"] for r in runs])
    # CPU time: the figure to compare on a shared machine, where wall time depends on the load.
    cpu_intercept, cpu_slope = linear_fit(xs, [r["cpu_s"] for r in runs])
    steps = []
    for small, large in itertools.pairwise(runs):
        shard_ratio = large["shards"] / small["shards"]
        time_ratio = large["wall_s"] / small["wall_s"]
        # Undefined when the smaller run is within noise of the fitted start-up cost.
        small_above = small["wall_s"] - intercept_s
        above_start = (large["wall_s"] - intercept_s) / small_above if small_above > 0.2 else None
        steps.append(
            {
                "shards": [small["shards"], large["shards"]],
                "shard_ratio": round(shard_ratio, 2),
                "time_ratio": round(time_ratio, 2),
                "cpu_ratio": round(large["cpu_s"] / small["cpu_s"], 2),
                "time_above_startup_ratio_per_shard_ratio": (
                    round(above_start / shard_ratio, 2) if above_start is not None else None
                ),
                "peak_rss_ratio": round(large["peak_rss_mib"] / small["peak_rss_mib"], 2),
            }
        )
    return {
        "startup_s": round(intercept_s, 2),
        "ms_per_shard": round(slope_s * 1000, 3),
        "cpu_startup_s": round(cpu_intercept, 2),
        "cpu_ms_per_shard": round(cpu_slope * 1000, 3),
        "startup_mib": round(mem_intercept, 1),
        "kib_per_shard": round(mem_slope * 1024, 1),
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[100, 1000, 5000])
    parser.add_argument("--repeat", type=int, default=1, help="best of this many dry runs")
    parser.add_argument("--json", type=Path, help="write the figures here as one JSON object")
    parser.add_argument(
        "--real-config",
        default="config/examples/qwen3-8b.yaml",
        help="config of a real target, relative to the repository (also timed at each size)",
    )
    args = parser.parse_args()
    real_config = REPO / args.real_config

    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-dag-") as tmp:
        workdir, floor_dir = Path(tmp) / "workflow", Path(tmp) / "floor"
        copy_workflow(workdir)
        stand_in_vllm_folder(workdir)  # the real target's vllm.python (evaluate.engine vllm)
        floor_dir.mkdir()
        write_floor_workflow(floor_dir)
        for directory in (workdir, floor_dir):
            dry_run(directory, 10)  # warm the page cache and Python's bytecode caches
        # What every snakemake command pays to read the workflow: the rules' code versions parse
        # the package's modules, unless an earlier command's parses are at hand (docs/README.md).
        cache = str(Path(tmp) / "code-versions")
        dry_run(workdir, 10, code_versions=cache)
        startup = {}
        for _ in range(max(3, args.repeat)):
            for name in ("off", cache):
                cpu_s = dry_run(workdir, 10, code_versions=name)["cpu_s"]
                startup[name] = min(startup.get(name, cpu_s), cpu_s)
        startup_figures = {
            "cpu_s_without_cache": startup["off"],
            "cpu_s_with_cache": startup[cache],
        }
        print(
            f"reading the workflow (10 shards, best of {max(3, args.repeat)}): "
            f"{startup['off']:.2f} CPU-s parsing every module, {startup[cache]:.2f} with the "
            f"parses of an earlier command (x{startup['off'] / startup[cache]:.2f})",
            flush=True,
        )
        for shards in sorted(args.shards):
            best = {}
            # Interleaved, so a slow minute on a shared machine hits all three alike.
            for _ in range(args.repeat):
                for name, directory, quiet, config in (
                    ("listing", workdir, False, None),
                    ("real", workdir, False, real_config),
                    ("plan", workdir, True, None),
                    ("floor", floor_dir, False, None),
                ):
                    run = dry_run(directory, shards, quiet, config)
                    if name not in best or run["wall_s"] < best[name]["wall_s"]:
                        best[name] = run
            listing = best["listing"]
            listing["s_per_1000_shards"] = round(listing["wall_s"] / shards * 1000, 3)
            listing["real_target_wall_s"] = best["real"]["wall_s"]
            listing["real_target_jobs"] = best["real"]["jobs"]
            listing["real_target_peak_rss_mib"] = best["real"]["peak_rss_mib"]
            listing["plan_wall_s"] = best["plan"]["wall_s"]
            listing["plan_cpu_s"] = best["plan"]["cpu_s"]
            listing["plan_peak_rss_mib"] = best["plan"]["peak_rss_mib"]
            listing["floor_wall_s"] = best["floor"]["wall_s"]
            listing["over_floor"] = round(listing["wall_s"] / best["floor"]["wall_s"], 2)
            runs.append(listing)
            print(
                f"{shards:>6} shards {listing['jobs']:>6} jobs  {listing['wall_s']:7.2f} s "
                f"(cpu {listing['cpu_s']:.2f} s)  peak {listing['peak_rss_mib']:7.1f} MiB  "
                f"{listing['s_per_1000_shards']:.3f} s per 1000 shards | real target "
                f"{listing['real_target_wall_s']:.2f} s, "
                f"{listing['real_target_peak_rss_mib']:.0f} MiB | plan only (-q) "
                f"{listing['plan_wall_s']:.2f} s (cpu {listing['plan_cpu_s']:.2f} s), "
                f"{listing['plan_peak_rss_mib']:.0f} MiB | "
                f"bare Snakemake, same jobs "
                f"{listing['floor_wall_s']:.2f} s (x{listing['over_floor']:g})",
                flush=True,
            )
    figures = {
        "bench": "dag",
        "what": "snakemake -n over N shards (shard_size 1), output to a file; real target: the "
        f"same with {args.real_config}; plan: -n -q; floor: a bare workflow with the same jobs",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "snakemake": _snakemake_version(),
        "runs": runs,
        "startup": startup_figures,
        "growth": growth(runs) if len(runs) > 1 else {},
    }
    at_5000 = next((r for r in runs if r["shards"] == 5000), None)
    if at_5000:
        figures["goal"] = {
            "max_s_at_5000_shards": GOAL_S_AT_5000,
            "real_target_wall_s_at_5000_shards": at_5000["real_target_wall_s"],
            "wall_s_at_5000_shards": at_5000["wall_s"],
            "cpu_s_at_5000_shards": at_5000["cpu_s"],
            "plan_wall_s_at_5000_shards": at_5000["plan_wall_s"],
            "floor_wall_s_at_5000_shards": at_5000["floor_wall_s"],
            "met": at_5000["wall_s"] <= GOAL_S_AT_5000,
        }
    growth_figures = figures["growth"]
    if growth_figures:
        print(
            f"fit: {growth_figures['startup_s']:.2f} s + {growth_figures['ms_per_shard']:.2f} ms "
            f"per shard (cpu {growth_figures['cpu_startup_s']:.2f} s + "
            f"{growth_figures['cpu_ms_per_shard']:.2f} ms); {growth_figures['startup_mib']:.0f} MiB + "
            f"{growth_figures['kib_per_shard']:.0f} KiB per shard"
        )
        for step in growth_figures["steps"]:
            print(
                f"{step['shards'][0]} -> {step['shards'][1]} shards (x{step['shard_ratio']:g}): "
                f"time x{step['time_ratio']:g} (cpu x{step['cpu_ratio']:g}), time above start-up "
                f"per shard ratio "
                f"{step['time_above_startup_ratio_per_shard_ratio'] or 'n/a'} (1 = linear), "
                f"memory x{step['peak_rss_ratio']:g}"
            )
    if "goal" in figures:
        goal = figures["goal"]
        print(
            f"goal <= {goal['max_s_at_5000_shards']:g} s at 5000 shards (listing): {goal['met']} "
            f"({goal['wall_s_at_5000_shards']:.2f} s; real target "
            f"{goal['real_target_wall_s_at_5000_shards']:.2f} s, plan only "
            f"{goal['plan_wall_s_at_5000_shards']:.2f} s)"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


def _wall(run: dict) -> float:
    return run["wall_s"]


def _snakemake_version() -> str:
    from importlib.metadata import version

    return version("snakemake")


if __name__ == "__main__":
    main()
