"""`eaglenest plan` refuses flags that would print nonsense (a zero rate was a traceback, negative
inputs printed negative disk and hours, zeros were read as not given) and says when its rates are
the CPU demo's; `hidden.store: budget` is the fixed split it is named, and says so: a warning
when not one shard fits, and the stored files already written measured against `cache_gb`."""

from __future__ import annotations

import copy
import logging

import pytest
from support.workflow import SMALL_DEMO

from eaglenest.cli import main
from eaglenest.common.config import REPO_ROOT, validate_config
from eaglenest.run.plan import DEMO_RATES, Assumptions, Rates, plan_run
from eaglenest.run.split import split_shards

DEMO = str(REPO_ROOT / "config" / "config.yaml")


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--capture-tokens-per-s", "0"), ("--train-tokens-per-s", "-5"), ("--samples", "0"),
     ("--tokens-per-sample", "nan"), ("--cache-gb", "inf"), ("--hidden-size", "-1"),
     ("--generate-tokens-per-s", "-inf")],
)  # fmt: skip
def test_non_positive_and_non_finite_flags_are_refused_by_name(flag, value, capsys):
    assert main(["plan", "--configfile", DEMO, f"{flag}={value}"]) == 2
    out = capsys.readouterr().out
    assert out.startswith(f"eaglenest plan: {flag} ") and "a positive, finite number" in out


def test_the_plan_says_when_its_rates_are_the_cpu_demos(capsys):
    assert main(["plan", "--configfile", DEMO]) == 0
    out = capsys.readouterr().out
    assert "the generate, capture, train rate(s) are the CPU demo's" in out
    assert "--generate-tokens-per-s, --capture-tokens-per-s, --train-tokens-per-s" in out
    rates = ["--generate-tokens-per-s", "100", "--capture-tokens-per-s", "200"]
    assert main(["plan", "--configfile", DEMO, *rates, "--train-tokens-per-s", "300"]) == 0
    assert "CPU demo's" not in capsys.readouterr().out
    assert main(["plan", "--configfile", DEMO, "--capture-tokens-per-s", "200"]) == 0
    assert "the generate, train rate(s) are the CPU demo's" in capsys.readouterr().out


def budget_config(cache_gb: float) -> dict:
    raw = copy.deepcopy(SMALL_DEMO)
    raw["hidden"] = {**raw.get("hidden", {}), "backend": "vllm", "store": "budget"}
    raw["hidden"]["cache_gb"] = cache_gb
    raw["vllm"] = {**raw.get("vllm", {}), "capture_url": "http://127.0.0.1:8765"}
    return validate_config(raw)


def test_a_budget_that_holds_no_shard_says_so(caplog, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = budget_config(1e-6)  # one shard is ~0.8 MB
    with caplog.at_level(logging.WARNING, logger="eaglenest.run.split"):
        split = split_shards(config)
    assert split.stored == ()
    assert "hidden.cache_gb 1e-06 holds not one shard (the first is estimated at" in caplog.text
    assert "as with hidden.store none" in caplog.text
    plan = plan_run(config, Assumptions(80, 64, Rates(**DEMO_RATES), 1e-6))
    assert any("holds not one shard" in note for note in plan.notes)


def test_stored_shards_already_written_are_measured_against_the_budget(
    caplog, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    config = budget_config(0.0015)  # the first training shard (~0.83 MB estimated) fits
    hidden = tmp_path / "results" / config["run"] / "hidden"
    hidden.mkdir(parents=True)
    (hidden / "00000.safetensors").write_bytes(b"\0" * 2_000_000)  # bigger than the estimate
    with caplog.at_level(logging.WARNING, logger="eaglenest.run.split"):
        split = split_shards(config)
    assert split.stored_training == ("00000",)  # a fixed split: the files do not move it
    assert "the 1 stored shard(s) written so far take 0.002 GB measured against" in caplog.text
    assert "over hidden.cache_gb 0.0015: the split is fixed from the config" in caplog.text


def _capped_4gb() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


TOO_MANY = "is greater than the maximum of 1000000000"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--samples", "1e21"], f"'prompts.max_samples': 1000000000000000000000 {TOO_MANY}"),
        (["--set", "prompts.max_samples=100000000000000000000"], TOO_MANY),
    ],
)
def test_absurd_sizes_are_refused_in_seconds_under_a_4gb_cap(args, said, tmp_path):
    """A plan of 1e21 prompts listed every shard id: MemoryError under a 4-8 GB cap, past 23 GB
    without one. Run as a user would, in a process of its own under a 4 GB address-space cap."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "eaglenest.cli", "plan", "--configfile", DEMO, *args]
    done = subprocess.run(
        command, check=False, capture_output=True, text=True, timeout=60, preexec_fn=_capped_4gb
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert said in done.stdout


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("- a\n- b\n", "holds a list, not a mapping of config sections"),
        ("a: [\n", "not valid YAML"),
        (None, "cannot be read (No such file or directory)"),
    ],
)
def test_a_config_file_that_is_no_mapping_is_named_not_a_traceback(text, said, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    if text is not None:
        path.write_text(text)
    assert main(["plan", "--configfile", str(path)]) == 2
    assert capsys.readouterr().out.startswith(f"eaglenest plan: config file {path}: {said}")


def test_a_plan_that_holds_out_every_shard_is_refused_by_key(tmp_path, capsys):
    every = tmp_path / "every.yaml"
    every.write_text("train:\n  eval_shards: 4\n")
    assert main(["plan", "--configfile", DEMO, str(every)]) == 2
    out = capsys.readouterr().out
    assert "'train.eval_shards' holds out every shard (4)" in out


def test_training_hours_follow_the_tokens_the_recipe_reads_and_the_disk_every_stored_one(capsys):
    """Whole answers are stored (disk per stored token); a step reads at most
    train.sequence.length tokens a sample, so training hours are bounded by it."""
    rates = Rates(**DEMO_RATES)

    def planned(sequence: dict, tokens_per_sample: float = 20_000):
        config = validate_config({"train": {"sequence": sequence}})
        return plan_run(config, Assumptions(tokens_per_sample, 128, rates, 1.0))

    whole, head, windows = (planned({"mode": m}) for m in ("whole", "head", "windows"))
    trained_samples = whole.train_shards * whole.shard_size
    assert whole.train_tokens_per_epoch == pytest.approx(trained_samples * 20_000)
    assert head.train_tokens_per_epoch == windows.train_tokens_per_epoch
    assert windows.train_tokens_per_epoch == pytest.approx(trained_samples * 8192)
    rows = {
        name: {r.stage: r for r in p.stages} for name, p in (("whole", whole), ("windows", windows))
    }
    assert rows["windows"]["train"].hours == pytest.approx(
        rows["whole"]["train"].hours * 8192 / 20_000
    )
    assert rows["windows"]["hidden"].disk_bytes == rows["whole"]["hidden"].disk_bytes
    assert "windows of 8,192 tokens a sample" in rows["windows"]["train"].note
    short = planned({"mode": "windows"}, tokens_per_sample=1000)
    assert short.train_tokens_per_epoch == pytest.approx(trained_samples * 1000)
    assert main(["plan", "--configfile", DEMO, "--set", "train.sequence.length=512"]) == 0
    out = capsys.readouterr().out
    assert "training reads at most train.sequence.length 512 tokens a sample" in out
    assert "tokens an epoch (train.sequence)" in out
