"""Typed errors that the CLI turns into one line and exit code 2."""


class KvsimError(Exception):
    """Bad input or an impossible configuration.

    The message reads `<what>, <where>, <fix>` and is printed as `error: <message>`.
    """


class ConfigError(KvsimError):
    """A configuration that composes but cannot work (a model that does not fit, say)."""


class UnknownNameError(KvsimError):
    """A name (model, GPU profile, allocator, scenario) that has no definition."""

    def __init__(self, kind: str, name: str, known: list[str], where: str):
        super().__init__(
            f"unknown {kind} '{name}', {where}, use one of: {', '.join(sorted(known))}"
        )
