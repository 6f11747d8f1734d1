"""The error hierarchy. Every error names what failed, where (host, rank) and in which phase."""


class TrainMoverError(Exception):
    """Base of all TrainMover errors."""


class ConfigError(TrainMoverError):
    """A malformed option, environment variable or config file."""


class SlurmError(TrainMoverError):
    """A Slurm command failed or timed out."""


class ProtocolError(TrainMoverError):
    """A control message was malformed, too large or not authenticated."""


class MigrationError(TrainMoverError):
    """A migration step failed; carries the phase and the ranks involved."""

    def __init__(self, message: str, *, phase: str = "", rank: int | None = None, host: str = ""):
        where = ", ".join(p for p in (f"phase={phase}" if phase else "", f"rank={rank}" if rank is not None else "", f"host={host}" if host else "") if p)
        super().__init__(f"{message} ({where})" if where else message)
        self.phase, self.rank, self.host = phase, rank, host


class DeadlineExceeded(TrainMoverError):
    """A bounded wait ran out; the message names what was waited for."""
