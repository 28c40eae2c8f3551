"""The `eaglenest` command. Each subcommand lives in the module that does the work; that module
exposes `add_arguments(parser)` and `run(args) -> int`. Imports are lazy so `eaglenest --help`
does not pay for torch."""

from __future__ import annotations

import argparse
import importlib
import sys

from eaglenest.common.logs import setup_cli_logging

# What `eaglenest --help` opens with: whole sentences, not the module docstring's first line.
DESCRIPTION = (
    "The tools around the eaglenest pipeline, which `snakemake --cores all` runs: serving, "
    "probing, capture and configuration. Each command has its own --help."
)

SUBCOMMANDS = {
    "serve": (
        "eaglenest.demo.server",
        "Serve a local causal LM (or echo prompts) behind an OpenAI-compatible API.",
    ),
    "probe": (
        "eaglenest.stages.probe",
        "Send one minimal request to an endpoint and report what it returns.",
    ),
    "build-demo-target": ("eaglenest.demo.target", "Build and train the tiny demo target model."),
    "serve-capture": (
        "eaglenest.capture.server",
        "Start one vLLM capture engine a node for the hidden-state shards (vllm.capture_urls).",
    ),
    "vllm-cpu-flags": (
        "eaglenest.vllm_engine.cpu",
        "Print the flags a vLLM server on CPU needs to compute what it computes on GPUs.",
    ),
    "plan": (
        "eaglenest.run.plan_command",
        "Print the shards, jobs, disk and hours per stage of a config, before anything runs.",
    ),
    "check-drafter": (
        "eaglenest.drafter.served_check",
        "Check a drafter against its target and vLLM for configuration cliffs (exit 1: refused).",
    ),
    "config-docs": (
        "eaglenest.common.config_docs",
        "Print config/README.md, the reference of every config key, from config/schema.yaml.",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="eaglenest", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="Log debug messages too.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        subparsers.add_parser(name, help=help_text, add_help=False)
    # Parse just the command name first, then let the owning module define its own options.
    known, _ = parser.parse_known_args(argv)
    module = importlib.import_module(SUBCOMMANDS[known.command][0])
    sub = argparse.ArgumentParser(prog=f"eaglenest {known.command}")
    module.add_arguments(sub)
    rest = argv[argv.index(known.command) + 1 :]
    args = sub.parse_args(rest)
    setup_cli_logging(known.verbose)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
