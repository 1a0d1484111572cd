"""The one exception type of the converter: bad input that the user can fix."""

from megatron_mugrpo.errors import InputError


class ConversionError(InputError, ValueError):
    """Bad conversion input (architecture, tensors, shapes, parallel sizes, paths); names the fix."""
