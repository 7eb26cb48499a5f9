"""Runnable cookbook: `python -m treadle.recipes.<name>`."""
