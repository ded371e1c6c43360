"""`python -m grpogate.cli ...`, the same as `python -m grpogate ...`."""

from grpogate.cli import app

if __name__ == "__main__":
    app()
