"""Typed reading of JSON members with exact error paths (spec §4.4 "Unknown members MUST be
ignored"; STYLE.md rule 4).

:class:`Fields` wraps one JSON object and reads members by name; every failure raises
:class:`~kvsp.errors.RecordError` naming the JSON path (``$.residency[1].layers``). Members that
are not asked for are ignored. Absent and ``null`` stay distinct: ``optional`` admits absence,
``nullable`` admits ``null``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from kvsp import ids
from kvsp.errors import InvalidIdentifier, RecordError

UINT64_MAX = 2**64 - 1
_ABSENT = object()
_INF = float("inf")


def type_name(value: object) -> str:
    """Name a JSON value's type the way JSON does (object, array, string, number, …)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


class Fields:
    """A JSON object being read member by member; errors carry the member's JSON path."""

    __slots__ = ("obj", "path")

    def __init__(self, obj: object, path: str = "$") -> None:
        if type(obj) is not dict and not isinstance(obj, Mapping):
            raise RecordError(f"expected an object, got {type_name(obj)}", path=path)
        self.obj: Mapping[str, Any] = obj
        self.path = path

    def at(self, key: str) -> str:
        """The JSON path of member ``key``."""
        return f"{self.path}.{key}"

    def has(self, key: str) -> bool:
        """Whether member ``key`` is present (``null`` counts as present)."""
        return key in self.obj

    def raw(self, key: str, *, optional: bool = False, nullable: bool = False) -> Any:
        """The member's value unchecked; ``None`` when absent and ``optional``.

        Raises:
            RecordError: absent and not optional, or ``null`` and not nullable.
        """
        value = self.obj.get(key, _ABSENT)
        if value is _ABSENT:
            if optional:
                return None
            raise RecordError("required member is missing", path=self.at(key))
        if value is None and not nullable:
            raise RecordError("must not be null", path=self.at(key))
        return value

    def string(self, key: str, *, optional: bool = False, nullable: bool = False) -> Any:
        """A string member (``None`` when absent/null and allowed).

        Raises:
            RecordError: missing, null or not a string.
        """
        value = self.raw(key, optional=optional, nullable=nullable)
        if value is not None and not isinstance(value, str):
            raise RecordError(f"expected a string, got {type_name(value)}", path=self.at(key))
        return value

    def integer(
        self,
        key: str,
        *,
        minimum: int = 0,
        maximum: int = UINT64_MAX,
        optional: bool = False,
        nullable: bool = False,
    ) -> Any:
        """An integer member within [minimum, maximum].

        Raises:
            RecordError: missing, not an integer, or out of range.
        """
        value = self.raw(key, optional=optional, nullable=nullable)
        if value is None:
            return None
        if type(value) is int and minimum <= value <= maximum:
            return value  # the common case, without formatting the path an error would name
        return check_int(value, self.at(key), minimum=minimum, maximum=maximum)

    def number(
        self, key: str, *, minimum: float = 0.0, optional: bool = False, nullable: bool = False
    ) -> Any:
        """A finite number member ≥ minimum, returned as float.

        Raises:
            RecordError: missing, not a number, or below minimum.
        """
        value = self.raw(key, optional=optional, nullable=nullable)
        if value is None:
            return None
        if type(value) is float and minimum <= value < _INF:
            return value  # finite and in range (NaN fails the comparison)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RecordError(f"expected a number, got {type_name(value)}", path=self.at(key))
        try:
            number = float(value)
        except OverflowError:
            raise RecordError("number out of range", path=self.at(key)) from None
        if number != number or number in (float("inf"), float("-inf")) or number < minimum:
            raise RecordError(f"must be a finite number >= {minimum}", path=self.at(key))
        return number

    def boolean(self, key: str, *, optional: bool = False) -> Any:
        """A boolean member.

        Raises:
            RecordError: missing or not a boolean.
        """
        value = self.raw(key, optional=optional)
        if value is not None and not isinstance(value, bool):
            raise RecordError(f"expected a boolean, got {type_name(value)}", path=self.at(key))
        return value

    def array(self, key: str, *, optional: bool = False, nullable: bool = False) -> Any:
        """An array member as a list (``None`` when absent/null and allowed).

        Raises:
            RecordError: missing or not an array.
        """
        value = self.raw(key, optional=optional, nullable=nullable)
        if value is not None and not isinstance(value, list | tuple):
            raise RecordError(f"expected an array, got {type_name(value)}", path=self.at(key))
        return value

    def items(self, key: str, *, optional: bool = False) -> Iterator[tuple[Any, str]]:
        """Iterate an array member as (item, path) pairs; nothing when absent and optional.

        Raises:
            RecordError: missing or not an array.
        """
        values = self.array(key, optional=optional)
        for i, item in enumerate(values or ()):
            yield item, f"{self.at(key)}[{i}]"

    def nested(self, key: str, *, optional: bool = False, nullable: bool = False) -> Any:
        """A nested object member as :class:`Fields` (``None`` when absent/null and allowed).

        Raises:
            RecordError: missing or not an object.
        """
        value = self.raw(key, optional=optional, nullable=nullable)
        return None if value is None else Fields(value, self.at(key))

    def _identifier(self, key: str, parse: Callable[[object], bytes], optional: bool) -> Any:
        """The member ``key`` parsed by ``parse`` (None when absent and allowed); its path is
        formatted only for an error, which names it."""
        value = self.raw(key, optional=optional)
        if value is None:
            return None
        try:
            return parse(value)
        except InvalidIdentifier as exc:
            raise RecordError(exc.detail, path=self.at(key)) from None

    def hex32(self, key: str, *, optional: bool = False) -> Any:
        """A hex32 member as 32 octets.

        Raises:
            RecordError: missing or not 64 lowercase hex digits.
        """
        return self._identifier(key, ids.parse_hex32, optional)

    def hex16(self, key: str, *, optional: bool = False) -> Any:
        """A hex16 member as 16 octets.

        Raises:
            RecordError: missing or not 32 lowercase hex digits.
        """
        return self._identifier(key, ids.parse_hex16, optional)

    def digest(self, key: str, *, optional: bool = False) -> Any:
        """A ``"sha-256:<hex32>"`` member as 32 octets.

        Raises:
            RecordError: missing or not of that form.
        """
        return self._identifier(key, ids.parse_digest, optional)


def check_int(value: object, path: str, *, minimum: int = 0, maximum: int = UINT64_MAX) -> int:
    """Check that ``value`` is an integer (not a boolean) in [minimum, maximum].

    JSON numbers such as ``3.0`` are accepted only when integral.

    Raises:
        RecordError: not an integer or out of range.
    """
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecordError(f"expected an integer, got {type_name(value)}", path=path)
    if not minimum <= value <= maximum:
        raise RecordError(f"must be in [{minimum}, {maximum}], got {value}", path=path)
    return value


def _as_record_error(parse: Any, value: object, path: str) -> bytes:
    try:
        result: bytes = parse(value, path)
    except InvalidIdentifier as exc:
        raise RecordError(exc.detail, path=path) from None
    return result


def parse_hex32_at(value: object, path: str) -> bytes:
    """:func:`kvsp.ids.parse_hex32` raising :class:`RecordError` at ``path``."""
    return _as_record_error(ids.parse_hex32, value, path)


def parse_hex16_at(value: object, path: str) -> bytes:
    """:func:`kvsp.ids.parse_hex16` raising :class:`RecordError` at ``path``."""
    return _as_record_error(ids.parse_hex16, value, path)


def parse_digest_at(value: object, path: str) -> bytes:
    """:func:`kvsp.ids.parse_digest` raising :class:`RecordError` at ``path``."""
    return _as_record_error(ids.parse_digest, value, path)
