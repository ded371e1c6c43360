"""The stable public name of the verifiers (docs/design.md §5):
`from grpogate.verifiers import get_verifier`.

The verifiers live in `grpogate.inputs.verifiers`; this module only re-exports them.
"""

from grpogate.inputs.verifiers import (GSM8K_FINAL_NUMBER, KNOWN_VERIFIERS, FinalNumberVerifier,
                                       ReasoningGymVerifier, Verifier, extract_final_answer,
                                       get_verifier)

__all__ = ["GSM8K_FINAL_NUMBER", "KNOWN_VERIFIERS", "FinalNumberVerifier", "ReasoningGymVerifier",
           "Verifier", "extract_final_answer", "get_verifier"]
