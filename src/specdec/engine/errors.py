"""The executor's errors, shared by the executor and its KV stores."""


class CacheError(ValueError):
    """A request that does not match the sequence's cached state (a client or orchestrator bug)."""


class CapacityError(CacheError):
    """No room for the sequence now (the KV budget or the live-sequence limit is reached): the same step
    can succeed once other sequences end. The adapters answer it UNAVAILABLE."""
