"""Checkpoint formats: reading, converting, writing and verifying what training saves."""
