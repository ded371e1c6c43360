"""Training: advantages, objectives, log-probs, optimizer steps, the loop and its checkpoints."""
