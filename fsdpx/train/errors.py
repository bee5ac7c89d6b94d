"""The error of a run configured with values that cannot work together."""


class ConfigError(ValueError):
    """A run was configured with values that cannot work together; the message says which.
    ``fsdpx train`` prints it as one line and exits with status 2."""
