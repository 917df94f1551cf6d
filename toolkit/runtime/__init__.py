"""The libraries' objects at run time, shared by training and conversion: Megatron-Core built from a megatron.yaml
(and the CPU compatibility layer it runs in without a GPU), DeepSpeed's CPU shared-memory segments, metrics.jsonl."""
