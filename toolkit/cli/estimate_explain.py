"""`dmt estimate --explain` and `--train-tokens`: what they add to the record, and the explanation as plain text."""

from __future__ import annotations

import argparse
import textwrap
from typing import TYPE_CHECKING

from toolkit.cli.train_tokens import add_train_tokens_argument, add_training_time, training_time_lines
from toolkit.estimate.explain import explain_estimate

if TYPE_CHECKING:
    from toolkit.spec.model import ModelSpec
    from toolkit.spec.prediction import Prediction


def add_explain_arguments(parser: argparse.ArgumentParser) -> None:
    add_train_tokens_argument(parser)
    parser.add_argument("--explain", action="store_true",
                        help="for each component: the rule used, its source, and how it differs from the rule of "
                             "thumb (with --json: an `explain` list)")


def add_extras(prediction: Prediction, model: ModelSpec, args: argparse.Namespace) -> None:
    """training_time and explain, each only when its flag is given (the JSON is unchanged otherwise)."""
    add_training_time([prediction], args)
    if args.explain:
        prediction.explain = explain_estimate(model, prediction)


def print_extras(prediction: Prediction) -> None:
    if prediction.training_time is not None:
        print("\n".join(training_time_lines(prediction)))
    if prediction.explain is not None:
        print(explain_text(prediction.explain))


def explain_text(entries: list[dict], width: int = 110) -> str:
    """Plain text, wrapped but never cut: every value whole whether printed to a terminal or a pipe."""
    lines = ["", "Why these numbers"]
    for entry in entries:
        lines.append(f"{entry['component']}:")
        for label in ("rule", "rule_of_thumb", "difference", "source"):
            text = f"{label.replace('_', ' ')}: {entry[label]}"
            lines += textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="    ",
                                   break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines)
