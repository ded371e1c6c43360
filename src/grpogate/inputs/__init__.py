"""Inputs: the problem sets, the verifiers and the policy (base model + LoRA) a run admits."""
