"""`dmt health`: the preflight that finds the bad rank, link or node before a training job wastes a day."""
