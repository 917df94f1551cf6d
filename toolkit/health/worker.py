"""Entry of one rank started by `dmt health --nproc N`: options come as JSON in the environment, the report goes
to the TCPStore that the spawning process hosts."""

import json
import os
import sys
import warnings

from toolkit.errors import UserInputError, error_line
from toolkit.health.options import HealthOptions, rank_env
from toolkit.health.runner import OPTIONS_ENV, REPORT_KEY, run_rank

warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation notes on every collective


def main() -> int:
    fields = json.loads(os.environ[OPTIONS_ENV])
    if fields.get("sizes") is not None:
        fields["sizes"] = tuple(fields["sizes"])
    try:
        return run_rank(HealthOptions(**fields), rank_env(),
                        lambda report, store: store.set(REPORT_KEY, json.dumps(report)))
    except UserInputError as exc:  # the spawning `dmt health` prints this line as its own
        print(error_line("dmt health", exc), file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
