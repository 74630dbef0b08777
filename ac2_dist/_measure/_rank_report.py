"""One rank's memory figures (:class:`RankReport`, what ``memory.track`` reports and a
run file holds) and the checks that read one back (Note [Run-file validation]).
Moved verbatim from memory.py, which re-exports :class:`RankReport`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any

from .._trace._nodes import REASONS

__all__ = ["RankReport", "SCHEMA_VERSION"]

SCHEMA_VERSION = 1


@dataclass
class RankReport:
    """One rank's figures; bytes are ints. ``to_dict()`` is JSON-safe.

    Peaks are the most bytes allocated at any moment of a step's forward (backward)
    phases, above what was allocated when that step began (largest step reported);
    ``live_bytes_after_forward`` is the most allocated, above the same base, when one of
    its forward phases ended (with several microbatches in flight, all of them).
    A step is found as :func:`track` says (or set by :meth:`Tracker.step`).
    ``saved_bytes`` (and its split by reason) is what ac2 holds for backward in the
    device's memory after forward; ``saved_host_bytes`` what it holds in host memory
    (offloaded values whose host copy is the one kept), not device bytes.
    """

    rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    steps: int = 0
    peak_bytes_forward: int = 0
    peak_bytes_backward: int = 0
    live_bytes_after_forward: int = 0  # everything still allocated when forward returned
    saved_bytes: int = 0
    saved_bytes_by_reason: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    saved_host_bytes: int = 0  # offloaded values held in host memory after forward
    recomputed_ops: int = 0
    recomputed_bytes: int = 0
    replay_seconds: float = 0.0
    collectives_not_replayed: int = 0
    allgathers_backward: int = 0
    per_module: dict[str, dict[str, int]] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> RankReport:
        """Rebuild a report from :meth:`to_dict`'s output (e.g. one entry of a run file).

        Raises ValueError naming the first field that is missing or has the wrong type.
        Every key of schema 1's first release is required; ``steps``,
        ``live_bytes_after_forward`` and ``saved_host_bytes`` (added later in schema 1)
        default to 0; unknown keys are ignored.
        """
        if not isinstance(d, dict):
            raise ValueError(f"a rank report must be a JSON object (dict), got {_describe(d)}")
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(
                f"report schema_version {version!r} is not supported (expected "
                f"{SCHEMA_VERSION}); re-run with a matching ac2_dist version"
            )
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise ValueError(f"report is missing field(s) {', '.join(missing)}")
        values: dict[str, Any] = {}
        for name, check in _FIELD_CHECKS.items():
            if name in d:
                values[name] = check(name, d[name])
        return cls(**values)


def _what(value: Any) -> str:
    """``value`` named for an error message, with the fix when it is a tracker."""
    if callable(getattr(value, "report", None)) and not isinstance(value, RankReport):
        return f"a {type(value).__name__} (call its .report() for this rank's RankReport)"
    return f"a {type(value).__name__}"


def as_report(value: Any, who: str) -> RankReport:
    """``value`` if it is one rank's :class:`RankReport`; a TypeError naming ``who`` and
    what was passed instead (a tracker: call its ``.report()``)."""
    if not isinstance(value, RankReport):
        raise TypeError(f"ac2_dist.memory.{who} takes this rank's RankReport (tracker.report()), got {_what(value)}")
    return value


def as_reports(value: Any, who: str) -> list[RankReport]:
    """``value`` as a list of :class:`RankReport` (a list or tuple of them, or one of
    them); a TypeError naming ``who`` and the first thing that is not one."""
    if isinstance(value, RankReport):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"ac2_dist.memory.{who} takes a list of RankReport (memory.gather(...) on rank 0, or "
                        f"[tracker.report()]), got {_what(value)}")
    for i, r in enumerate(value):
        if not isinstance(r, RankReport):
            raise TypeError(f"ac2_dist.memory.{who}: item {i} of the list is {_what(r)}, not a RankReport")
    return list(value)


def _describe(value: Any) -> str:
    """A short, one-line description of a JSON value for error messages."""
    if value is None:
        return "null"
    kind = _JSON_NAMES.get(type(value), type(value).__name__)
    text = repr(value)
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"


_JSON_NAMES = MappingProxyType({dict: "object", list: "list", str: "string", bool: "boolean",
                                int: "integer", float: "number"})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise ValueError(f"field {name} must be an integer, got {_describe(value)}")
    return value


def _check_rank(name: str, value: Any) -> int:
    if _check_int(name, value) < 0:
        raise ValueError(f"field {name} must be >= 0, got {value}")
    return value


def _check_world_size(name: str, value: Any) -> int:
    if _check_int(name, value) < 1:
        raise ValueError(f"field {name} must be >= 1, got {value}")
    return value


def _check_float(name: str, value: Any) -> float:
    if not (_is_int(value) or isinstance(value, float)):
        raise ValueError(f"field {name} must be a number, got {_describe(value)}")
    return float(value)


def _check_str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"field {name} must be a string, got {_describe(value)}")
    return value


def _check_int_map(name: str, value: Any) -> dict[str, int]:
    if not isinstance(value, dict):
        raise ValueError(f"field {name} must be an object of integers, got {_describe(value)}")
    for key, v in value.items():
        if not _is_int(v):
            raise ValueError(f"field {name}[{key!r}] must be an integer, got {_describe(v)}")
    return dict(value)


def _check_per_module(name: str, value: Any) -> dict[str, dict[str, int]]:
    if not isinstance(value, dict):
        raise ValueError(f"field {name} must be an object {{fqn: {{...}}}}, got {_describe(value)}")
    return {fqn: _check_int_map(f"{name}[{fqn!r}]", entry) for fqn, entry in value.items()}


# Note [Run-file validation]: every field of RankReport has a checker here (a test
# keeps the two in sync), so a report read back has the types format_table/plot use;
# a bad file fails in from_dict with the field's name instead of deep inside rendering.
_FIELD_CHECKS = MappingProxyType({
    "rank": _check_rank,
    "world_size": _check_world_size,
    "device": _check_str,
    "steps": _check_int,
    "peak_bytes_forward": _check_int,
    "peak_bytes_backward": _check_int,
    "live_bytes_after_forward": _check_int,
    "saved_bytes": _check_int,
    "saved_bytes_by_reason": _check_int_map,
    "saved_host_bytes": _check_int,
    "recomputed_ops": _check_int,
    "recomputed_bytes": _check_int,
    "replay_seconds": _check_float,
    "collectives_not_replayed": _check_int,
    "allgathers_backward": _check_int,
    "per_module": _check_per_module,
    "schema_version": _check_int,
})
_OPTIONAL = frozenset({"steps", "live_bytes_after_forward", "saved_host_bytes"})  # added within schema 1
_REQUIRED = tuple(k for k in _FIELD_CHECKS if k not in _OPTIONAL)
