"""Errors a user can act on: each names the file, key or value at fault and what to do."""


class PipeTrainError(Exception):
    """Base of every error PipeTrain raises about user input or the environment."""


class ConfigError(PipeTrainError):
    def __init__(self, message: str, *, file=None, key: str | None = None):
        where = []
        if file is not None:
            where.append(str(file))
        if key:
            where.append(f"key '{key}'")
        super().__init__(f"{': '.join(where)}: {message}" if where else message)
        self.file = file
        self.key = key


class DatasetError(PipeTrainError):
    """``summary``: the message without the names of the files it lists (what a server answers: the files of a
    folder a workflow names are not for whoever can queue one); the whole message otherwise."""

    def __init__(self, message: str, summary: str | None = None):
        super().__init__(message)
        self.summary = message if summary is None else summary


class CacheError(PipeTrainError):
    pass


class ModelError(PipeTrainError):
    pass


class CheckpointError(PipeTrainError):
    """A training checkpoint that cannot be trusted or read: the message names the file."""


class RuntimeSetupError(PipeTrainError):
    pass
