"""The one exception a user can cause. The CLI prints its message without a traceback."""


class TrainwiseError(Exception):
    """A mistake in the user's input (config, data, paths, flags): the message says what and how to fix it."""
