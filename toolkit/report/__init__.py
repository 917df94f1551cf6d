"""Training runs read back: measured against predicted (dmt report), and what dmt calibrate fits from."""
