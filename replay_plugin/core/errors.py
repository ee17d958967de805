"""Typed errors for bad replay data and for sampler settings that replay cannot reproduce.

Every error names the field that is wrong and, where it applies, the trajectory and token
index and what was expected, so a user can find the offending sample in a batch of thousands.
They subclass ``ValueError`` (or ``TypeError``) so callers that catch the builtin still work.
"""

from __future__ import annotations


def _rebuild(cls: type[BaseException], args: tuple, state: dict) -> BaseException:
    """An error of ``cls`` with ``args`` and attributes ``state``, without calling its ``__init__``
    (whose signature differs from the exception's ``args``): how a pickled error is loaded."""
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


def _state(error: object) -> dict:
    """The error's attributes, each one that cannot be pickled (a ``value`` such as a live object)
    replaced by its ``repr``: the message and the type must cross, whatever the value."""
    import pickle

    state = {}
    for key, value in error.__dict__.items():
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - anything pickle refuses
            value = repr(value)
        state[key] = value
    return state


def _where(field: str, trajectory: int | None, token: int | None) -> str:
    parts = [f"field {field!r}"]
    if trajectory is not None:
        parts.append(f"trajectory {trajectory}")
    if token is not None:
        parts.append(f"token {token}")
    return ", ".join(parts)


class _Located:
    """The shared constructor: records where the data is wrong and builds the message."""

    def __init__(
        self,
        field: str,
        problem: str,
        *,
        trajectory: int | None = None,
        token: int | None = None,
        expected: str | None = None,
    ) -> None:
        self.field = field
        self.trajectory = trajectory
        self.token = token
        self.expected = expected
        message = f"{_where(field, trajectory, token)}: {problem}"
        if expected:
            message += f" (expected {expected})"
        super().__init__(message)  # type: ignore[call-arg]

    def __reduce__(self) -> tuple:
        # Picklable, so that it crosses processes as itself: a refusal raised in a Ray actor (verl's
        # vLLM server, an agent-loop worker) reaches the caller typed. Pickle's default rebuilds an
        # exception as ``cls(*args)``, which this constructor cannot take: Ray 2.60 then delivers an
        # ``UnserializableException`` carrying only the text.
        return _rebuild, (type(self), getattr(self, "args", ()), _state(self))


class ReplayDataError(_Located, ValueError):
    """Replay data with a wrong value, shape or layout.

    Attributes ``field``, ``trajectory`` (batch row or trajectory index, or None),
    ``token`` (token index within the trajectory, or None) and ``expected`` (text).
    """


class ReplayTypeError(_Located, TypeError):
    """Replay data of the wrong Python type or dtype; same attributes as ReplayDataError."""


class NotReplayable(ValueError):
    """A sampler or engine setting that sampler-support replay cannot reproduce.

    Attributes ``setting`` (the setting's name, e.g. ``"top_k"`` or ``"logprobs_mode"``) and
    ``value`` (its value as seen, or None when the message does not depend on it).
    """

    def __init__(self, setting: str, message: str, *, value: object = None) -> None:
        super().__init__(message)
        self.setting = setting
        self.value = value

    def __reduce__(self) -> tuple:  # picklable across processes, as ``_Located``
        return _rebuild, (type(self), self.args, _state(self))


class RouteSanityWarning(UserWarning):
    """Recorded routes that are possible but look broken (a layer routing every token of a batch
    to the same experts, a top-1 trajectory all on expert 0). ``-W error::replay_plugin.core.
    errors.RouteSanityWarning`` (or ``warnings.simplefilter("error", RouteSanityWarning)``) makes
    them errors."""
