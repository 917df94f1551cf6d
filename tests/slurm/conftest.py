"""A real single-node Slurm (slurmctld, slurmd, munge) for the session, state under a temp dir, stopped by pid."""

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

from helpers import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch")


def _find(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.path.exists(p)), None)


def _wait_for(check, timeout: float, what: str) -> None:
    """Poll `check` until it holds. The waits below end as soon as a daemon is up (a few seconds idle), so their
    bounds are generous for a loaded 2-core machine (load ~10): 120 s for munged, 300 s for an idle node."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    missing = [d for d in DAEMONS if _find(d) is None]
    if missing or os.geteuid() != 0:
        reason = f"Slurm test cluster needs root and {', '.join(missing) or 'its daemons'} (.ci/run installs slurm-wlm munge)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "munge", "logs"):
        (root / sub).mkdir()
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    socket_path = root / "munge" / "munge.socket"
    munge = subprocess.Popen([_find("munged"), "--foreground", "--force", f"--key-file={key}", f"--socket={socket_path}",
                              f"--pid-file={root / 'munge' / 'munged.pid'}", f"--log-file={root / 'munge' / 'munged.log'}",
                              f"--seed-file={root / 'munge' / 'seed'}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for(socket_path.exists, 120, "munged")
    host = socket.gethostname().split(".")[0]
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // 2
    conf = root / "slurm.conf"
    conf.write_text(f"""ClusterName=dmt
SlurmctldHost={host}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket={socket_path},cred_expire=10
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
# a requeued job becomes eligible after cred_expire; let the schedulers look again soon (defaults 60 s and 30 s)
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation={root / 'state'}
SlurmdSpoolDir={root / 'spool'}
SlurmctldPidFile={root / 'slurmctld.pid'}
SlurmdPidFile={root / 'slurmd.pid'}
SlurmctldLogFile={root / 'logs' / 'slurmctld.log'}
SlurmdLogFile={root / 'logs' / 'slurmd.log'}
SlurmUser=root
SlurmdUser=root
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobRequeue=1
KillWait=5
MinJobAge=600
NodeName={host} CPUs={os.cpu_count()} RealMemory={memory_mb} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
    env = dict(os.environ, SLURM_CONF=str(conf))
    ctld = subprocess.Popen([_find("slurmctld"), "-D", "-i", "-f", str(conf)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    slurmd = subprocess.Popen([_find("slurmd"), "-D", "-f", str(conf)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: "idle" in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                                   text=True).stdout, 300, "an idle Slurm node")
        yield {"env": env, "root": root, "conf": conf}
    finally:
        for process in (slurmd, ctld, munge):  # the daemons this fixture started, by pid
            process.send_signal(signal.SIGTERM)
        for process in (slurmd, ctld, munge):
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
