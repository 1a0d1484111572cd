"""The one exception type of the converter: bad input that the user can fix."""


class ConversionError(ValueError):
    """Bad conversion input (architecture, tensors, shapes, parallel sizes, paths); names the fix."""
