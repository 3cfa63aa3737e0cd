"""lm-evaluation-harness in process against through the front door (run.py); standard library only."""
