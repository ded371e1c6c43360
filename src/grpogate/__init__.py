"""grpogate: one auditable GRPO run that ends in an accept / tune / reject decision."""

__version__ = "0.1.0"
