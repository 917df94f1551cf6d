"""Heartbeats to NVIDIA Resiliency Extension's rank monitors when `launch.sh ft_launcher` (or slurm.sbatch /
the manifests with ft_launcher) started this rank: ft_launcher sets FT_RANK_MONITOR_IPC_SOCKET for each worker and
its rank monitor ends a rank whose heartbeats stop for the configured timeout (ft_config.yaml). Every backend's
step phases reach beat() through TrainingWatchdog.phase, where the toolkit's own watchdog heartbeat is; outside
ft_launcher every call is a no-op.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)
SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"  # nvidia_resiliency_ext.fault_tolerance.data (NVRx 0.4.1): set by ft_launcher
_client = None
beats = 0  # heartbeats sent by this process (what a test or a report can read)


def under_ft_launcher() -> bool:
    return bool(os.environ.get(SOCKET_ENV))


def start() -> None:
    """Connect to this rank's monitor (once per process)."""
    global _client
    if _client is not None or not under_ft_launcher():
        return
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient  # lazy: nvidia_resiliency_ext

    client = RankMonitorClient()
    client.init_workload_monitoring()
    _client = client
    log.info("ft_launcher: heartbeats to NVRx's rank monitor (%s)", os.environ[SOCKET_ENV])


def beat() -> None:
    """One heartbeat: this rank is making progress (called from every phase of every step)."""
    global beats
    if _client is None:
        return
    _client.send_heartbeat()
    beats += 1


def stop() -> None:
    """This rank ends normally: close the connection (the monitor then expects no more heartbeats)."""
    global _client
    if _client is None:
        return
    client, _client = _client, None
    client.shutdown_workload_monitoring()
    log.info("ft_launcher: %d heartbeats sent to NVRx's rank monitor", beats)
