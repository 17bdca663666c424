"""Training loop, losses, metrics and evaluation."""
