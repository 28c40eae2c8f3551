"""Settings of the report: the serving device's timings (`report.device`) that the report's
choice of drafter family counts in (stages/report/device_choice.py, docs/report.md).

A family's tokens per target step on a device = tau / (v(K) + d * r): tau its emitted tokens per
round (the evaluate stage's vLLM run), v(K) the time of verifying K + 1 tokens in one target
forward over one plain decode step's, d its drafter forwards per round (EAGLE-3 K, P-EAGLE and
DFlash one: settings/families.py `parallel`) and r one drafter forward's time over one target
decode step's. This machine's own live loop (Python overhead at batch 1 on two cores) says
nothing of r or v on a GPU beside a large target, so without `report.device` the report chooses
no family.

The figures come from the config (`source` "user") or from the JSON file bench/gpu_check.py's
`device_timings` step writes (`report.device.file`, at one of its batch sizes: `source` is the
file); a figure given in the config wins over the file's. The file is read when the settings are
built, so its figures are in the report rule's tracked settings: a new file reruns the report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eaglenest.settings import Settings
from eaglenest.settings.device_file import (
    KEY,
    is_number,
    is_positive_integer_key,
    read_timings_file,
)
from eaglenest.settings.families import FAMILIES

COLLAPSE_RATIO = 0.7  # config/schema.yaml's report.collapse_ratio


@dataclass(frozen=True)
class DeviceTimings(Settings):
    """The serving device's timings, relative to one plain target decode step."""

    name: str  # as the report names the device
    source: str  # "user", or the bench/gpu_check.py file they were read from
    drafter_ratio: float  # one drafter forward over one target decode step, in (0, 1]
    family_ratios: dict[str, float]  # a family's own ratio in place of drafter_ratio
    verify_cost: dict[str, float]  # K (a string, as JSON has it) -> verify K + 1 over one step

    def ratio(self, family: str) -> float:
        """The drafter/target forward-time ratio of `family` on this device."""
        return self.family_ratios.get(family, self.drafter_ratio)


@dataclass(frozen=True)
class ReportSettings(Settings):
    """`report`: the device timings (None: this machine's alone, no family chosen), and the
    share of the earliest depth's acceptance below which a depth is a collapse
    (stages/report/depth_health.py)."""

    SECTION = "report"

    device: DeviceTimings | None
    collapse_ratio: float

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ReportSettings:
        report = config.get("report") or {}
        section = report.get("device")
        # The schema's default, for a config built by hand (validate_config fills it in).
        ratio = report.get("collapse_ratio", COLLAPSE_RATIO)
        return cls(device=device_timings(section) if section else None, collapse_ratio=ratio)


def device_timings(section: Mapping[str, Any]) -> DeviceTimings:
    """report.device as checked timings: the file's figures under the config's."""
    found: dict[str, Any] = {"name": None, "drafter_ratio": None, "verify_cost": {}}
    source = "user"
    if section.get("file"):
        found = read_timings_file(section["file"], section.get("batch") or 1)
        source = str(section["file"])
    timings = DeviceTimings(
        name=section.get("name") or found["name"] or "the serving device",
        source=source,
        drafter_ratio=_given(section.get("drafter_ratio"), found["drafter_ratio"]),
        family_ratios=dict(section.get("family_ratios") or {}),
        verify_cost={
            str(k): v
            for k, v in {**found["verify_cost"], **(section.get("verify_cost") or {})}.items()
        },
    )
    check_timings(timings)
    return timings


def _given(config_value: Any, file_value: Any) -> Any:
    return config_value if config_value is not None else file_value


def check_timings(timings: DeviceTimings) -> None:
    """Every ratio in (0, 1], every verify cost at least 1 (verifying K + 1 tokens costs at least
    the one token's step), each a finite number (NaN passes every comparison's `not`, and would
    win the choice of K), each K a positive integer as str(int) writes it (the report looks K
    up so): ValueError naming the key."""
    where = "" if timings.source == "user" else f" (from {timings.source})"
    if timings.drafter_ratio is None:
        raise ValueError(
            f"{KEY}.drafter_ratio: not given{where}: one drafter forward's time over one target "
            "decode step's, in (0, 1]"
        )
    ratios = {"drafter_ratio": timings.drafter_ratio}
    for family, ratio in timings.family_ratios.items():
        if family not in FAMILIES:
            raise ValueError(f"{KEY}.family_ratios: {family!r} is not one of {', '.join(FAMILIES)}")
        ratios[f"family_ratios.{family}"] = ratio
    for key, ratio in ratios.items():
        if not is_number(ratio):
            raise ValueError(f"{KEY}.{key}: {ratio!r}{where} is not a finite number")
        if not 0 < ratio <= 1:
            raise ValueError(f"{KEY}.{key}: {ratio!r}{where} is outside (0, 1]")
    if not timings.verify_cost:
        raise ValueError(f"{KEY}.verify_cost: none given{where}: K -> verify K + 1 over one step")
    for k, cost in timings.verify_cost.items():
        if not is_positive_integer_key(k):
            raise ValueError(
                f"{KEY}.verify_cost: {k!r}{where} is not a K written as an integer (3, 7, 15)"
            )
        if not is_number(cost):
            raise ValueError(f"{KEY}.verify_cost.{k}: {cost!r}{where} is not a finite number")
        if cost < 1:
            raise ValueError(
                f"{KEY}.verify_cost.{k}: {cost!r}{where} is below 1 (verifying K + 1 tokens "
                "takes at least one decode step)"
            )


def check_report_device(config: Mapping[str, Any]) -> None:
    """report.device, checked when the config is (its file read): ValueError naming the key."""
    ReportSettings.from_config(config)
