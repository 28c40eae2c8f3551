"""report.device.file read as every other input (settings/device_file.py): a regular file under
a size bound, JSON of the bench's shape, finite numbers, K and batch sizes as canonical
integers; each refusal names the file and the key inside it."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from eaglenest.common.config import ConfigError, merged_config
from eaglenest.settings.device_file import MAX_FILE_BYTES
from eaglenest.settings.report import device_timings

REPO = Path(__file__).resolve().parents[3]


def write(path: Path, at_batch_1) -> Path:
    path.write_text(
        json.dumps({"device_timings": {"device": "H200", "by_batch": {"1": at_batch_1}}})
    )
    return path


def refusal(path: Path) -> str:
    with pytest.raises(ValueError) as raised:
        device_timings({"file": str(path), "batch": 1})
    assert str(raised.value).startswith(f"report.device.file ({path}): "), raised.value
    return str(raised.value)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        # json.dumps writes NaN and Infinity; Python's json reads them back as floats.
        ('{"drafter_ratio": 0.02, "verify_cost": {"3": NaN}}', "by_batch.1.verify_cost.3: NaN is"),
        ('{"drafter_ratio": 0.02, "verify_cost": {"3": Infinity}}', "verify_cost.3: Infinity is"),
        ('{"drafter_ratio": 1e999, "verify_cost": {"3": 1.1}}', "drafter_ratio: Infinity is not"),
        ('{"drafter_ratio": NaN, "verify_cost": {"3": 1.1}}', "by_batch.1.drafter_ratio: NaN is"),
        # bool is a subclass of int: `true` would read as 1.0.
        ('{"drafter_ratio": true, "verify_cost": {"3": 1.1}}', "drafter_ratio: true is not a"),
        ('{"drafter_ratio": 0.02, "verify_cost": {"3": true}}', "verify_cost.3: true is not a"),
        ('{"drafter_ratio": "0.02", "verify_cost": {"3": 1.1}}', 'drafter_ratio: "0.02" is not'),
        # '007' would silently drop out of the choice, which looks K up as str(7).
        ('{"drafter_ratio": 0.02, "verify_cost": {"007": 1.1}}', "verify_cost: '007' is not a K"),
        ('{"drafter_ratio": 0.02, "verify_cost": {"0": 1.1}}', "verify_cost: '0' is not a K"),
        ('{"drafter_ratio": 0.02, "verify_cost": {" 3": 1.1}}', "verify_cost: ' 3' is not a K"),
        ('{"drafter_ratio": 0.02, "verify_cost": [1.1, 1.2]}', "by_batch.1.verify_cost: list"),
        ('{"drafter_ratio": 0.02, "verify_cost": 1.1}', "by_batch.1.verify_cost: float 1.1, not"),
        ("5", "device_timings.by_batch.1: int 5, not an object"),
        ("[0.02]", "device_timings.by_batch.1: list [0.02], not an object"),
    ],
)
def test_a_wrong_figure_in_the_file_is_refused_naming_the_file_and_key(
    tmp_path: Path, text: str, says: str
):
    path = tmp_path / "device_timings.json"
    path.write_text('{"device_timings": {"device": "H200", "by_batch": {"1": ' + text + "}}}")
    assert says in refusal(path)


def test_a_batch_size_not_written_as_an_integer_is_refused_not_missed(tmp_path: Path):
    path = tmp_path / "device_timings.json"
    at = {"drafter_ratio": 0.02, "verify_cost": {"3": 1.1}}
    path.write_text(json.dumps({"device_timings": {"by_batch": {"01": at}}}))
    assert "device_timings.by_batch: '01' is not a batch size" in refusal(path)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({"device_timings": {"by_batch": [1]}}, "no device_timings.by_batch"),
        ({"device_timings": 3}, "no device_timings.by_batch"),
        ([1, 2], "no device_timings.by_batch"),
        ({"device_timings": {"device": 5, "by_batch": {}}}, "device_timings.device: 5 is not"),
    ],
)
def test_a_file_of_another_shape_is_refused(tmp_path: Path, data, says: str):
    path = tmp_path / "device_timings.json"
    path.write_text(json.dumps(data))
    assert says in refusal(path)


def test_a_fifo_is_refused_without_being_opened(tmp_path: Path):
    path = tmp_path / "device_timings.json"
    os.mkfifo(path)
    found: list[str] = []
    reader = threading.Thread(target=lambda: found.append(refusal(path)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():  # the parse waited for a writer: release it, then fail
        with open(path, "w"):
            pass
        pytest.fail("reading report.device.file waited on a FIFO")
    assert "not a regular file" in found[0]


def test_a_file_past_the_bound_is_refused_before_it_is_read(tmp_path: Path):
    path = tmp_path / "device_timings.json"
    with open(path, "wb") as stream:
        stream.truncate(MAX_FILE_BYTES + 1)  # sparse: nothing to read, only the size to see
    assert f"larger than {MAX_FILE_BYTES:,}" in refusal(path)


@pytest.mark.parametrize(
    ("raw", "says"),
    [(b"\xff\xfe{}", "not UTF-8"), (b"[" * 100_000, "nested too deeply"), (b"{", "not JSON")],
)
def test_a_file_that_is_not_json_is_refused(tmp_path: Path, raw: bytes, says: str):
    path = tmp_path / "device_timings.json"
    path.write_bytes(raw)
    assert says in refusal(path)


def test_a_folder_or_a_missing_file_is_refused(tmp_path: Path):
    assert "not a regular file" in refusal(tmp_path)
    assert "cannot be read (No such file" in refusal(tmp_path / "absent.json")


def test_the_config_check_names_the_file_and_key(tmp_path: Path):
    path = write(tmp_path / "t.json", {"drafter_ratio": 0.02, "verify_cost": {"3": float("nan")}})
    config = tmp_path / "config.yaml"
    config.write_text(f"report: {{device: {{file: {path}}}}}\n")
    with pytest.raises(ConfigError, match=r"report.device.file \(.*t.json\): .*verify_cost.3: NaN"):
        merged_config([str(REPO / "config" / "config.yaml"), str(config)])


def test_the_benchs_own_shape_still_reads(tmp_path: Path):
    at = {"target_step_s": 0.01, "drafter_ratio": 0.02, "verify_cost": {"3": 1.01, "15": 1.2}}
    at["drafter_ratio_by_width"] = {"3": 0.03}
    timings = device_timings({"file": str(write(tmp_path / "t.json", at)), "batch": 1})
    assert timings.drafter_ratio == 0.02 and timings.verify_cost == {"3": 1.01, "15": 1.2}
    assert timings.name == "H200, batch 1"


@pytest.mark.parametrize(
    ("section", "says"),
    [
        ({"drafter_ratio": True}, "report.device.drafter_ratio: True is not a finite number"),
        ({"verify_cost": {"3": float("nan")}}, "report.device.verify_cost.3: nan is not a finite"),
        ({"verify_cost": {"007": 1.1}}, "report.device.verify_cost: '007' is not a K"),
        ({"family_ratios": {"dflash": float("inf")}}, "report.device.family_ratios.dflash: inf"),
    ],
)
def test_the_configs_own_figures_are_held_to_the_same(section: dict, says: str):
    with pytest.raises(ValueError, match="^" + says):
        device_timings({"drafter_ratio": 0.03, "verify_cost": {"3": 1.05}, **section})
