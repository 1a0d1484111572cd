"""The one error path for bad user input.

Every exception that means "the input is wrong and the user can fix it" derives from ``InputError``:
configuration, run directory, data files, checkpoints, rollout stores, engine output, rewards,
allocation, conversion. Its message names the file or field and the fix. The CLI catches exactly
this class, prints one ``error: ...`` line and exits with status 2; any other exception is a bug
and keeps its traceback.

Component errors keep a second, conventional base (``ValueError`` / ``RuntimeError``) so that
callers that catch those still work.
"""

from __future__ import annotations

import dataclasses


class InputError(Exception):
    """Bad input (config, data, checkpoint, store, engine output, reward, CLI argument); says how to fix it."""


class MissingInputError(InputError, FileNotFoundError):
    """A file or directory the user pointed at does not exist or is not what it should be."""


class ConfigError(InputError, ValueError):
    """A configuration value is invalid; the message names the key (``section.field``) and the fix."""


def require(ok: bool, message: str) -> None:
    """Raise ``ConfigError(message)`` unless ``ok``: the one-line validation used by every config section."""
    if not ok:
        raise ConfigError(message)


def with_registry_sections(settings: type, sections: dict[str, type]) -> type:
    """The config section ``settings`` plus one field per registry entry, each typed by (and defaulting
    to) the entry's own options dataclass: how a new loss or engine brings its section in one file.

    ``settings`` names the result (its name without a leading underscore and a trailing ``Settings``
    becomes ``<Prefix>Config``) and lends it its docstring and module.
    """
    fields = [(name, cls, dataclasses.field(default_factory=cls)) for name, cls in sections.items()]
    name = settings.__name__.lstrip("_").removesuffix("Settings") + "Config"
    return dataclasses.make_dataclass(
        name,
        fields,
        bases=(settings,),
        kw_only=True,
        namespace={"__module__": settings.__module__, "__doc__": settings.__doc__},
    )
