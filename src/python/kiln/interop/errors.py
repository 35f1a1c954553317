"""The error kiln.interop raises for input it cannot convert."""


class InteropError(Exception):
    """A checkpoint, folder or tokenizer Kiln cannot convert: the message names what differs
    (the field, parameter or file) and what to do. Printed as one paragraph by the CLI."""
