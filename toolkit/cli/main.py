"""`dmt` entry point: registers one sub-command per module and turns bad input into exit code 2 and one line, an
interrupt (Ctrl-C) into exit code 130 and one line."""

from __future__ import annotations

import argparse
import os
import sys

from toolkit import __version__
from toolkit.errors import UsageError, UserInputError, error_line
from toolkit.outputs import command_inputs

# verb -> module under toolkit.cli exposing add_arguments(parser) and run(args) -> int; imported on use only
VERBS = {
    "estimate": ("toolkit.cli.estimate", "per-GPU memory, parameter counts and step time for one model and plan"),
    "plan": ("toolkit.cli.plan", "search the fastest DP/ZeRO/FSDP/TP/PP/VPP/CP/EP plan that fits"),
    "generate": ("toolkit.cli.generate", "write deepspeed.json, accelerate.yaml, trainer_args.json, launch.sh, plan.json"),
    "validate": ("toolkit.cli.validate", "check a DeepSpeed JSON, an FSDP accelerate.yaml (and HF trainer arguments), "
                                         "a megatron.yaml or a Kubernetes manifest before launching"),
    "convert": ("toolkit.cli.convert", "convert checkpoints: DeepSpeed ZeRO -> HF, FSDP2 -> HF, HF <-> Megatron-Core"),
    "ckpt": ("toolkit.cli.ckpt", "verify or inspect a checkpoint"),
    "health": ("toolkit.cli.health", "preflight: collectives, bandwidth, stragglers, hangs on every rank"),
    "slurm": ("toolkit.cli.slurm", "render or submit SLURM job scripts for a recipe"),
    "k8s": ("toolkit.cli.k8s", "render a recipe's plan as a Kubernetes TrainJob, JobSet or PyTorchJob manifest"),
    "restore-test": ("toolkit.cli.restore", "train, kill after a save, resume: prove the run comes back"),
    "report": ("toolkit.cli.report", "measured against predicted for finished runs: step time, tokens/s, MFU, memory"),
    "calibrate": ("toolkit.cli.calibrate", "fit the step-time model's efficiencies (and measured links) to runs"),
    "explore": ("toolkit.cli.explore", "a local web page: memory breakdown, sweeps and ranked plans as inputs change"),
    "data": ("toolkit.cli.data", "prepare token datasets (Megatron's .bin/.idx) from JSON lines, parquet or text; "
                                 "inspect them"),
}


def quiet_library_warnings() -> None:
    """Megatron-Core warns on import about its own install (no Apex, no Transformer Engine: 14 lines on CPU) and its
    deprecations: nothing the user gave, printed before a command's result or its one-line refusal."""
    import warnings

    warnings.filterwarnings("ignore", module=r"megatron(\.|$)")


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line, with exit code 2; built with `exit_on_error=False` (a verb's
    parser in `dmt explore`), it raises the error instead (see parse_arguments)."""

    def __init__(self, *args, **kwargs) -> None:
        # options are matched whole, never by prefix: `--gpu gb200` to a verb without --gpu is not --gpus-per-node
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        if not self.exit_on_error:
            raise UsageError(None, message)
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_arguments(parser: OneLineParser, argv: list[str]) -> argparse.Namespace:
    """`parser.parse_args(argv)` of a parser built with exit_on_error=False: a refused command line is a UsageError
    naming the option at fault."""
    try:
        return parser.parse_args(argv)
    except argparse.ArgumentError as exc:
        raise UsageError(exc.argument_name, exc.message, str(exc)) from None


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    import importlib

    parser = OneLineParser(prog="dmt", description="dm-toolkit: plan, configure, launch and verify distributed training.")
    parser.add_argument("--version", action="version", version=f"dmt {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="COMMAND", parser_class=OneLineParser)
    for name, (module, help_text) in VERBS.items():
        verb_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == verb:  # only the verb being run pays for its module's import
            importlib.import_module(module).add_arguments(verb_parser)
    return parser


EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended


def main(argv: list[str] | None = None) -> int:
    program = argv is None  # `dmt` or `python -m toolkit` itself, not a caller inside Python
    argv = sys.argv[1:] if argv is None else argv
    verb = next((a for a in argv if a in VERBS), None)
    try:
        return _main(argv, verb)
    except KeyboardInterrupt as exc:  # what the verb undid on the way out travels with it (toolkit.errors.Interrupted)
        undone = getattr(exc, "undone", [])
        print(f"dmt{f' {verb}' if verb else ''}: interrupted" + (f"; {', '.join(undone)}" if undone else ""),
              file=sys.stderr)
        if program:
            # CPython ends a program with SIGINT instead of its exit code when the interrupt once passed through C
            # code that ran Python source (pybind11's exec while torch imports): the status is 130 either way
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED


def _main(argv: list[str], verb: str | None) -> int:

    quiet_library_warnings()
    parser = build_parser(verb)
    with command_inputs():  # the path flags register the command's inputs as they are parsed
        return _parse_and_run(parser, argv)


def _parse_and_run(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    import importlib

    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed in one line
        return int(exc.code or 0)
    if args.verb is None:
        parser.print_help()
        return 0
    try:
        code = importlib.import_module(VERBS[args.verb][0]).run(args)
        sys.stdout.flush()  # inside the try: a reader that went away is seen here, not at interpreter exit
        return code
    except UserInputError as exc:
        print(error_line(f"dmt {args.verb}", exc), file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader of stdout closed it (`dmt plan --json | head -1`): what it read was whole; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
