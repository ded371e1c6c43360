"""Errors the user can act on.

`InputError` is raised for anything wrong with what the user handed us (files, fields,
configuration). The CLI prints its message on one line and exits with code 2, before anything
is written into the output directory.
"""


class InputError(ValueError):
    """Bad user input: the message names the file, line and field where it can."""
