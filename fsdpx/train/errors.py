"""The error of a run configured with values that cannot work together."""


class ConfigError(ValueError):
    """A run was configured with values that cannot work together; the message says which.
    ``fsdpx train`` prints it as one line and exits with status 2."""


class RunFailure(RuntimeError):
    """The run failed while training, through no fault of its configuration (a checkpoint that
    could not be written: a full disk, a directory gone); the message says what, where, and
    which checkpoint is the newest intact one. ``fsdpx train`` prints it as one line and exits
    with status 1."""
