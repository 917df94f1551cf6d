"""Entry of one rank spawned by `dmt health --nproc N` (options arrive in DMT_HEALTH_OPTIONS)."""

import json
import os
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation notes on every collective

from toolkit.health.runner import HealthOptions, run_rank

if __name__ == "__main__":
    options = json.loads(os.environ["DMT_HEALTH_OPTIONS"])
    options["sizes"] = tuple(options["sizes"])
    raise SystemExit(run_rank(HealthOptions(**options)))
