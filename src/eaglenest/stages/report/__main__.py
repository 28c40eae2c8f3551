"""The report by hand, without Snakemake, of whatever files a run has so far:
`python -m eaglenest.stages.report results/RUN [--benchmarks benchmarks/RUN] [--logs logs/RUN]
[--out DIR] [--device-timings FILE [--batch N]]` (FILE: bench/gpu_check.py's device_timings.json,
as report.device.file: the family chosen for that device)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eaglenest.settings.report import device_timings
from eaglenest.stages.report.inputs import RunFiles
from eaglenest.stages.report.report import build_report


def main(argv: list[str] | None = None) -> int:
    """Write RUN_DIR/report/index.html and its PNGs from whatever files the run has so far."""
    parser = argparse.ArgumentParser(
        prog="python -m eaglenest.stages.report", description=main.__doc__
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--benchmarks", type=Path, help="benchmarks/RUN (generation wall times)")
    parser.add_argument("--logs", type=Path, help="logs/RUN (generation's activity files)")
    parser.add_argument("--out", type=Path, help="report folder (default RUN_DIR/report)")
    parser.add_argument("--device-timings", type=Path, help="as report.device.file")
    parser.add_argument("--batch", type=int, default=1, help="as report.device.batch")
    args = parser.parse_args(argv)
    device = None
    if args.device_timings:
        device = device_timings({"file": str(args.device_timings), "batch": args.batch})
    out = args.out or args.run_dir / "report"
    figures = build_report(
        RunFiles.from_run_dir(args.run_dir, args.benchmarks, args.logs),
        out / "index.html",
        run=args.run_dir.name,
        device=device,
    )
    print(json.dumps(figures, indent=2, default=str))
    print(f"wrote {out / 'index.html'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
