"""Heartbeats and sections to NVIDIA Resiliency Extension's rank monitors when `launch.sh ft_launcher` (or
slurm.sbatch / the manifests with ft_launcher) started this rank: ft_launcher sets FT_RANK_MONITOR_IPC_SOCKET for each
worker and its rank monitor ends a rank whose heartbeats stop, or whose section stays open, for longer than its
timeout (ft_config.yaml, toolkit/generate/ft_launcher.py). Every backend's step phases reach phase() through
TrainingWatchdog.phase, where the toolkit's own watchdog heartbeat is; outside ft_launcher every call is a no-op.

Each phase is a heartbeat and moves this rank between NVRx's sections (Megatron-LM's ft_integration's `step` and
`checkpointing`; the rest is NVRx's out-of-section). At every save (the `save` phase, where every rank arrives at the
same step) NVRx calculates the heartbeat and section timeouts from what it observed on every rank
(RankMonitorClient.calculate_and_set_hb_timeouts / calculate_and_set_section_timeouts: a collective on the default
group, the longest interval x safety_factor, merged with the timeouts already calculated); the toolkit keeps each
within ft_launcher.calculated_bounds (the recipe's hang_timeout_s the highest) and the first heartbeat's and the
out-of-section timeouts as configured (the toolkit connects at the first step, so NVRx's measure of the time to the
first heartbeat is not the startup's; out of section is where the startup is). Rank 0 keeps the result in
OUTPUT/ft_state.json (NVRx's own state_dict), and a restarted attempt starts from it, as Megatron-LM does with its
checkpoint directory's ft_state.json.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from toolkit.errors import UserInputError
from toolkit.generate.ft_launcher import SECTIONS, calculated_bounds, fault_tolerance_timeouts
from toolkit.readers import read_text

log = logging.getLogger(__name__)
SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"  # nvidia_resiliency_ext.fault_tolerance.data (NVRx 0.4.1): set by ft_launcher
STATE_FILE = "ft_state.json"  # NVRx's RankMonitorClient.state_dict(): the timeouts it calculated, the ones in force
STATE_KEY = "current_timeouts"  # RankMonitorClient.CURRENT_TIMEOUTS_STATE_KEY (NVRx 0.4.1)
SECTION_OF_PHASE = {"train": "step", "save": "checkpointing", "save-wait": "checkpointing", "manifest": "checkpointing",
                    "log": None}  # None: out of section; other phases (forward, backward, ...) stay where they are
_client = None
_run: dict = {}  # output_dir, hang_timeout_s, the open section, what was observed since the last calculation
beats = 0  # heartbeats sent by this process (what a test or a report can read)


def under_ft_launcher() -> bool:
    return bool(os.environ.get(SOCKET_ENV))


def start(output_dir: Path, hang_timeout_s: float) -> None:
    """Connect to this rank's monitor (once per process), with the timeouts an earlier attempt had NVRx calculate."""
    global _client
    if _client is not None or not under_ft_launcher():
        return
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient  # lazy: nvidia_resiliency_ext

    client = RankMonitorClient()
    state = read_state(output_dir)
    if state is not None:
        client.load_state_dict(state)  # sent to the monitor by init_workload_monitoring
    client.init_workload_monitoring()
    _client = client
    _run.clear()
    _run.update(output_dir=Path(output_dir), hang=hang_timeout_s, section=None, closed=set(), calculated_at=None)
    log.info("ft_launcher: heartbeats and sections to NVRx's rank monitor (%s); timeouts %s, %s%s",
             os.environ[SOCKET_ENV], client.hb_timeouts, client.section_timeouts,
             f" (calculated before, from {STATE_FILE})" if state is not None else "")


def phase(step: int, name: str) -> None:
    """One heartbeat (this rank is making progress; called from every phase of every step), the section the phase
    is in, and at a save NVRx's calculation of the timeouts."""
    global beats
    if _client is None:
        return
    _client.send_heartbeat()
    beats += 1
    if name not in SECTION_OF_PHASE:
        return
    section = SECTION_OF_PHASE[name]
    if name == "save" and _run["calculated_at"] != step:
        _enter(None)  # the step's section closes here: observed before the calculation
        _calculate(step)
    _enter(section)


def _enter(section: str | None) -> None:
    if section == _run["section"]:
        return
    if _run["section"] is not None:
        _client.end_all_sections()
        _run["closed"].add(_run["section"])
    if section is not None:
        _client.start_section(section)
    _run["section"] = section


def _calculate(step: int) -> None:
    """NVRx's timeouts from what every rank observed (collectives on the default group: every rank saves at `step`),
    kept within the bounds, set on this rank's monitor and, on rank 0, kept in OUTPUT/ft_state.json."""
    _run["calculated_at"] = step
    hang = _run["hang"]
    if hang <= 0:  # no deadline in the recipe: none to calculate under
        return
    client = _client
    heartbeat = client.calculate_and_set_hb_timeouts(skip_if_not_ready=True)
    observed = sorted(s for s in SECTIONS if s in _run["closed"])  # the same on every rank: the same phases
    sections = bool(observed) and client.calculate_and_set_section_timeouts(
        selected_sections=observed, calc_out_of_section=False, skip_if_not_ready=True)
    if not (heartbeat or sections):
        return
    calculated = client.state_dict()
    state = bounded(calculated, hang)
    client.load_state_dict(state)  # the bounded timeouts replace NVRx's on this rank's monitor
    log.info("ft_launcher: at step %d NVRx calculated %s; in force %s", step, json.dumps(calculated[STATE_KEY]),
             json.dumps(state[STATE_KEY]))
    if os.environ.get("RANK", "0") == "0":
        path = _run["output_dir"] / STATE_FILE
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({**state, "calculated": calculated[STATE_KEY], "step": step}, indent=1) + "\n")
        os.replace(tmp, path)


def bounded(state: dict, hang_timeout_s: float) -> dict:
    """NVRx's state_dict with every calculated timeout within calculated_bounds, the first heartbeat's and the
    out-of-section ones as configured (see the module's docstring)."""
    low, high = calculated_bounds(hang_timeout_s)
    configured = fault_tolerance_timeouts(hang_timeout_s)
    keep = lambda value: None if value is None else min(max(value, low), high)  # noqa: E731
    timeouts = json.loads(json.dumps(state[STATE_KEY]))
    if "heartbeat" in timeouts:
        heartbeat = timeouts["heartbeat"]
        heartbeat.update(initial=configured["initial_rank_heartbeat_timeout"], subsequent=keep(heartbeat["subsequent"]))
    if "section" in timeouts:
        section = timeouts["section"]
        section["section"] = {name: keep(value) if name in section["calculated_sections"] else value
                              for name, value in section["section"].items()}
        section["out_of_section"] = configured["rank_out_of_section_timeout"]
        section["is_out_of_section_calculated"] = False
    return {STATE_KEY: timeouts}


def read_state(output_dir: Path) -> dict | None:
    """The timeouts an earlier attempt of this run had NVRx calculate (OUTPUT/ft_state.json), or None."""
    path = Path(output_dir) / STATE_FILE
    if not path.is_file():
        return None
    try:
        state = json.loads(read_text(path))
    except (UserInputError, ValueError):
        log.warning("ft_launcher: %s unreadable; the timeouts start from ft_config.yaml's", path)
        return None
    return {STATE_KEY: state[STATE_KEY]} if isinstance(state, dict) and STATE_KEY in state else None


def stop() -> None:
    """This rank ends normally: close its sections and the connection (the monitor then expects no more heartbeats)."""
    global _client
    if _client is None:
        return
    client, _client = _client, None
    client.end_all_sections()
    client.shutdown_workload_monitoring()
    log.info("ft_launcher: %d heartbeats sent to NVRx's rank monitor", beats)
