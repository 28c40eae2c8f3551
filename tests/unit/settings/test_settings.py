"""Params are the interface between a rule and its script: every stage's settings are one typed
object (eaglenest.settings), built from the validated config, passed as a param and handed by
the script to the library. Checked here on the source: scripts never read `snakemake.config`,
every param a rule passes reaches its script (settings through their own `from_json`), every
settings field is read by the library, no field has a default (config/schema.yaml holds them
all), and every object survives its JSON form."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pkgutil
import re
from pathlib import Path

import pytest
import yaml

import eaglenest.settings
from eaglenest.common.config import merged_config, validate_config
from eaglenest.settings import Settings
from eaglenest.settings.report import ReportSettings
from eaglenest.stages.generate.request import GenerationSettings

REPO = Path(__file__).resolve().parents[3]
LIBRARY = REPO / "src" / "eaglenest"
CONFIGS = [REPO / "config" / "config.yaml", *sorted((REPO / "config" / "examples").glob("*.yaml"))]

# Params a script does not read: each is a rerun trigger only, derived by the library from an
# object the script does get (`bounds` and `listing` from PromptOptions) or from the code.
TRIGGER_ONLY = {"code_version", "bounds", "listing"}


def settings_classes() -> list[type[Settings]]:
    for info in pkgutil.iter_modules(eaglenest.settings.__path__, "eaglenest.settings."):
        importlib.import_module(info.name)
    found, todo = [], list(Settings.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += cls.__subclasses__()
    return sorted(found, key=lambda c: c.__name__)


def config_settings_classes() -> list[type[Settings]]:
    """Those made from a whole config; a class with no `from_config` of its own is a field of one
    of them (report.device's DeviceTimings, absent from most configs) and goes with it."""
    return [c for c in settings_classes() if "from_config" in vars(c)]


def rule_params() -> dict[str, tuple[str, dict[str, str]]]:
    """rule name -> (its script, {param name: the param's source text})."""
    rules = {}
    for smk in sorted((REPO / "rules").glob("*.smk")):
        for block in re.split(r"^rule ", smk.read_text(), flags=re.MULTILINE)[1:]:
            name = block.split(":", 1)[0]
            script = re.search(r'script:\s*"\.\./(scripts/[\w.]+)"', block)
            params = re.search(r"^    params:\n((?:        .*\n|\s*\n)*)", block, re.MULTILINE)
            if not script:
                continue
            values = {}
            for line in (params.group(1) if params else "").splitlines():
                match = re.match(r"^        (\w+)=(.*)$", line)
                if match:
                    values[match.group(1)] = match.group(2)
            rules[name] = (script.group(1), values)
    return rules


def test_no_script_reads_the_config():
    """A script reads its settings from its rule's params, never from the config: what it runs
    with is then what Snakemake compares to decide a rerun."""
    readers = []
    for script in sorted((REPO / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "config"
                and isinstance(node.value, ast.Name)
                and node.value.id == "snakemake"
            ):
                readers.append(f"{script.name}:{node.lineno}")
    assert not readers, f"scripts read snakemake.config: {readers}"


# A rule's settings param that a get_* of rules/common.smk builds around settings_json per job
# (the train rule's, with a family's own settings beside TrainSettings') and what reads it.
JOB_READERS = {"get_train_settings": "train_job_settings"}


def test_every_param_reaches_the_script_and_settings_their_library():
    rules = rule_params()
    assert len(rules) >= 10
    for rule, (script, params) in rules.items():
        source = (REPO / script).read_text()
        for name, value in params.items():
            if name in TRIGGER_ONLY:
                continue
            read = f"snakemake.params.{name}"
            assert read in source, f"rule {rule} passes params.{name}, which {script} never reads"
            built = re.search(r"settings_json\((\w+)\)|(PROMPT_OPTIONS)\.to_json\(\)", value)
            if built:
                cls = built.group(1) or "PromptOptions"
                wrapper = re.match(r"(get_\w+)\(", value)
                reader = JOB_READERS.get(wrapper.group(1) if wrapper else "", f"{cls}.from_json")
                assert f"{reader}({read})" in source, (
                    f"{script} does not read params.{name} as the {cls} that rule {rule} passes"
                )


def test_every_rule_passes_its_settings_as_typed_json():
    """Rules build params from the settings classes only (no config sections as raw JSON)."""
    for rule, (_, params) in rule_params().items():
        for name, value in params.items():
            assert "config[" not in value and "as_json(" not in value, (
                f"rule {rule}: params.{name} reads the config directly: {value}"
            )


def names_read() -> set[str]:
    """Every name that the library (outside eaglenest/settings) and the scripts read or pass:
    attributes, keyword arguments, parameters and string constants (dict keys)."""
    names: set[str] = set()
    sources = [p for p in LIBRARY.rglob("*.py") if not p.is_relative_to(LIBRARY / "settings")]
    for path in [*sources, *(REPO / "scripts").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, (ast.keyword, ast.arg)):
                names.add(node.arg or "")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
    return names


def test_every_settings_field_is_read_by_the_library():
    """A field nobody reads would rerun a stage for nothing."""
    names = names_read()
    unread = [
        f"{cls.__name__}.{f.name}"
        for cls in settings_classes()
        for f in dataclasses.fields(cls)
        if f.name not in names
    ]
    assert not unread, f"settings fields that neither library nor scripts read: {unread}"


@pytest.mark.parametrize("cls", [*settings_classes(), GenerationSettings], ids=lambda c: c.__name__)
def test_no_settings_field_has_a_default(cls):
    """config/schema.yaml holds every default; a default here would be a second one."""
    with_default = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    ]
    assert not with_default, f"{cls.__name__} fields with a default: {with_default}"


@pytest.mark.parametrize("config_path", CONFIGS, ids=lambda p: p.name)
def test_settings_survive_their_json(config_path):
    config = merged_config([config_path])
    for cls in config_settings_classes():
        settings = cls.from_config(config)
        assert cls.from_json(settings.to_json()) == settings, cls.__name__


def test_device_timings_survive_their_json():
    """report.device's timings inside the report's settings, as the report rule passes them."""
    config = merged_config([REPO / "config" / "config.yaml"])
    device = {"name": "H200", "drafter_ratio": 0.03, "family_ratios": {"dflash": 0.05}}
    config["report"] = {"device": {**device, "verify_cost": {3: 1.1, 7: 1.3}}}
    settings = ReportSettings.from_config(config)
    assert settings.device.ratio("dflash") == 0.05 and settings.device.verify_cost["7"] == 1.3
    assert ReportSettings.from_json(settings.to_json()) == settings


def test_key_order_changes_no_settings():
    base = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    reordered = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    reordered = {
        k: dict(reversed(list(v.items()))) if isinstance(v, dict) else v
        for k, v in reversed(list(reordered.items()))
    }
    for cls in config_settings_classes():
        one, two = (cls.from_config(validate_config(c)) for c in (base, reordered))
        assert one.to_json() == two.to_json(), cls.__name__


# What the rules pass untracked (rules/common.smk `untracked`): how jobs reach the endpoints and
# how hard they try, and the prompt options (tracked through their `listing` and `bounds`).
UNTRACKED = {"EndpointSettings", "GenerationClientSettings", "ProbeClientSettings", "PromptOptions"}


def test_client_settings_are_in_no_tracked_settings():
    """The brief of tests/workflow/test_incremental.py in one place: concurrency, timeouts, retries, URLs,
    keys and the embedded server's start-up and backend change no settings object that a rule tracks."""
    base = merged_config([REPO / "config" / "config.yaml"])
    client = {
        "generation": {"concurrency": 7, "timeout_s": 30, "max_attempts": 2, "bench_s": 1},
        "probe": {"timeout_s": 5},
        "endpoints": [{"url": "http://10.0.0.1:8000", "api_key_env": "KEY", "max_concurrency": 3}],
        # The cite target's rule answers with its model's greedy tokens: nothing to regenerate.
        "server": {"startup_timeout_s": 10, "max_batch_size": 8, "backend": "rule"},
    }
    changed = merged_config([REPO / "config" / "config.yaml"])
    for section, values in client.items():
        if isinstance(values, dict):
            changed[section].update(values)
        else:
            changed[section] = validate_config({section: values})[section]
    for cls in config_settings_classes():
        if cls.__name__ not in UNTRACKED:
            assert cls.from_config(base) == cls.from_config(changed), cls.__name__
