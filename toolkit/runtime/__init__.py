"""What runs beside a training or conversion job of any backend, below the backends themselves: the rank's place in
its job (job.py) and free ports (ports.py), the heartbeat watchdog (training's and `dmt health`'s: watchdog.py,
supervision.py), the NaN/spike guard's verdicts (guard.py), incident.json (incident.py), metrics.jsonl and
run_plan.json (metrics.py), the children a verb starts (children.py), DeepSpeed's CPU shared-memory segments
(ds_shm.py), and the tests' fault injection (faults.py). A backend's own run-time code lives in its package
(toolkit/backends/<name>/)."""
