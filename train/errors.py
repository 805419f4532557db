"""The trainer's error types: bad user input is one line and exit status 2."""


class ConfigError(ValueError):
    """Bad user input (config, CLI, data, checkpoint, a user's class): the CLI prints it in
    one line and exits 2."""
