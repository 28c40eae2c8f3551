"""The `eaglenest` command. Each subcommand lives in the module that does the work; that module
exposes `add_arguments(parser)` and `run(args) -> int`. Imports are lazy so `eaglenest --help`
does not pay for torch."""

from __future__ import annotations

import argparse
import importlib
import sys

from eaglenest.common.logs import setup_cli_logging

SUBCOMMANDS = {
    "serve": (
        "eaglenest.demo.server",
        "OpenAI-compatible server for a local causal LM (or echo mode)",
    ),
    "probe": (
        "eaglenest.stages.probe",
        "send one minimal request to an endpoint and report what it returns",
    ),
    "build-demo-target": ("eaglenest.demo.target", "build and train the tiny demo target model"),
    "serve-capture": (
        "eaglenest.stages.hidden_states.capture_server",
        "one vLLM capture engine (one a node) for the hidden-state shards of a run (vllm.capture_urls)",
    ),
    "vllm-cpu-flags": (
        "eaglenest.common.vllm_cpu",
        "the flags a vLLM server on CPU needs to compute what it does on GPUs",
    ),
    "plan": (
        "eaglenest.common.plan",
        "shards, jobs, disk and hours per stage of a config, before anything runs",
    ),
    "config-docs": (
        "eaglenest.common.config_docs",
        "print config/README.md, the reference of every config key, from config/schema.yaml",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="eaglenest", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
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
