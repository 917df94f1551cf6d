"""The libraries' objects at run time, shared by training and conversion: Megatron-Core built from a megatron.yaml
(its CPU compatibility layer is toolkit.compat.megatron_cpu), DeepSpeed's CPU shared-memory segments, metrics.jsonl;
and what watches a job of any backend: the rank's place in its job, the heartbeat watchdog (training's and
`dmt health`'s), the NaN/spike guard, incident.json, and the tests' fault injection."""
