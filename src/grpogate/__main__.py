"""`python -m grpogate ...` is the `grpogate` command (and what `torchrun -m grpogate` launches)."""

from grpogate.cli import app

if __name__ == "__main__":
    app()
