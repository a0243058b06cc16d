"""Runnable RL examples (`python -m cuttle.rl.examples.<name>`); each documents its own command."""
