"""Exception types of shardpar's public API."""


class CheckpointError(Exception):
    """Anything wrong with a checkpoint on disk: missing, incomplete, corrupted, or not
    matching the model/optimizer it is loaded into. The message names the file or tensor."""
