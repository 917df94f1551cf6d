"""SLURM job scripts rendered from a recipe and its plan, and their submission."""
