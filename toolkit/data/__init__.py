"""Prepared token datasets: input files tokenised into Megatron-Core's indexed .bin/.idx pairs (prepare), checked and
summarised (inspect), with the record of how they were made beside them (sidecar)."""
