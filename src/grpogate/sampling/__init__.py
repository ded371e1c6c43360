"""Sampling: the decode forwards and G completions per prompt, for training and for the re-test."""
