"""MOQT draft-16 Setup Parameters (§9.3.1) and Message Parameters (§9.2.2), typed.

Absent parameters are ``None`` (or an empty tuple), never a default value, so a session can tell
"not sent" from "sent with the default". Unknown Setup Parameters are kept in ``unknown`` (they
MUST be ignored, but a session may want to look); an unknown Message Parameter is a
PROTOCOL_VIOLATION; a known one that the message type does not allow is ignored (§9.2.2).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from .errors import KeyValueFormattingError, NeedMoreData, ProtocolViolation, SessionError
from .wire import (
    KeyValuePair,
    Location,
    Reader,
    Writer,
    push_kvps,
    push_location,
    read_kvps,
    read_location,
)


class SetupParameter(IntEnum):
    """Setup Parameter types (§9.3.1); constant across MOQT versions."""

    PATH = 0x01
    MAX_REQUEST_ID = 0x02
    AUTHORIZATION_TOKEN = 0x03
    MAX_AUTH_TOKEN_CACHE_SIZE = 0x04
    AUTHORITY = 0x05
    MOQT_IMPLEMENTATION = 0x07


class MessageParameter(IntEnum):
    """Message Parameter types (§9.2.2, §13.2)."""

    DELIVERY_TIMEOUT = 0x02
    AUTHORIZATION_TOKEN = 0x03
    EXPIRES = 0x08
    LARGEST_OBJECT = 0x09
    FORWARD = 0x10
    SUBSCRIBER_PRIORITY = 0x20
    SUBSCRIPTION_FILTER = 0x21
    GROUP_ORDER = 0x22
    NEW_GROUP_REQUEST = 0x32


class TokenAliasType(IntEnum):
    """Authorization Token Alias Type (§9.2.2.1, §13.1)."""

    DELETE = 0x0
    REGISTER = 0x1
    USE_ALIAS = 0x2
    USE_VALUE = 0x3


class GroupOrder(IntEnum):
    """GROUP_ORDER parameter / DEFAULT_PUBLISHER_GROUP_ORDER extension values (§9.2.2.4)."""

    ASCENDING = 0x1
    DESCENDING = 0x2


class FilterType(IntEnum):
    """Subscription Filter types (§5.1.2)."""

    NEXT_GROUP_START = 0x1
    LARGEST_OBJECT = 0x2
    ABSOLUTE_START = 0x3
    ABSOLUTE_RANGE = 0x4


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthToken:
    """The Token structure of AUTHORIZATION TOKEN (§9.2.2.1, Figure 4).

    DELETE and USE_ALIAS carry ``alias`` only; REGISTER carries all three; USE_VALUE carries
    ``token_type`` and ``token_value`` only.
    """

    alias_type: TokenAliasType
    alias: int | None = None
    token_type: int | None = None
    token_value: bytes | None = None

    def encode(self) -> bytes:
        """Serialize the Token structure (the parameter value).

        Raises:
            ValueError: a field the alias type requires is missing or one it forbids is set.
        """
        has_alias = self.alias_type != TokenAliasType.USE_VALUE
        has_value = self.alias_type in (TokenAliasType.REGISTER, TokenAliasType.USE_VALUE)
        if (self.alias is not None) != has_alias:
            raise ValueError(
                f"{self.alias_type.name}: alias must be {'set' if has_alias else 'None'}"
            )
        if (self.token_type is not None) != has_value or (
            self.token_value is not None
        ) != has_value:
            raise ValueError(f"{self.alias_type.name}: token type/value presence is wrong")
        writer = Writer()
        writer.push_varint(self.alias_type)
        if self.alias is not None:
            writer.push_varint(self.alias)
        if self.token_type is not None and self.token_value is not None:
            writer.push_varint(self.token_type)
            writer.push_bytes(self.token_value)
        return writer.data

    @classmethod
    def decode(cls, data: bytes) -> AuthToken:
        """Parse a Token structure; Token Value runs to the end of the parameter.

        Raises:
            KeyValueFormattingError: the structure cannot be decoded (§9.2.2.1).
        """
        reader = Reader(data)
        try:
            raw_type = reader.read_varint()
            if raw_type not in TokenAliasType._value2member_map_:
                raise KeyValueFormattingError(f"unknown token alias type {raw_type}")
            alias_type = TokenAliasType(raw_type)
            alias = None if alias_type == TokenAliasType.USE_VALUE else reader.read_varint()
            if alias_type in (TokenAliasType.DELETE, TokenAliasType.USE_ALIAS):
                if not reader.eof():
                    raise KeyValueFormattingError(f"{alias_type.name} token carries a value")
                return cls(alias_type=alias_type, alias=alias)
            token_type = reader.read_varint()
        except NeedMoreData:
            raise KeyValueFormattingError("truncated authorization token") from None
        value = bytes(reader.read_rest())
        return cls(alias_type=alias_type, alias=alias, token_type=token_type, token_value=value)


@dataclass(frozen=True, slots=True, kw_only=True)
class SubscriptionFilter:
    """``Subscription Filter {Filter Type (i), [Start Location], [End Group (i)]}`` (§5.1.2)."""

    filter_type: FilterType
    start: Location | None = None
    end_group: int | None = None

    def encode(self) -> bytes:
        """Serialize the filter (the SUBSCRIPTION_FILTER value, without its length).

        Raises:
            ValueError: Start/End Group presence does not match the filter type.
        """
        needs_start = self.filter_type in (FilterType.ABSOLUTE_START, FilterType.ABSOLUTE_RANGE)
        needs_end = self.filter_type == FilterType.ABSOLUTE_RANGE
        if (self.start is not None) != needs_start or (self.end_group is not None) != needs_end:
            raise ValueError(f"{self.filter_type.name}: start/end_group presence is wrong")
        writer = Writer()
        writer.push_varint(self.filter_type)
        if self.start is not None:
            push_location(writer, self.start)
        if self.end_group is not None:
            writer.push_varint(self.end_group)
        return writer.data

    @classmethod
    def decode(cls, data: bytes) -> SubscriptionFilter:
        """Parse a Subscription Filter that must fill the parameter exactly.

        Raises:
            ProtocolViolation: unknown filter type, or length mismatch (§5.1.2, §9.2.2.5).
        """
        reader = Reader(data)
        try:
            raw_type = reader.read_varint()
            if raw_type not in FilterType._value2member_map_:
                raise ProtocolViolation(f"unknown subscription filter type {raw_type}")
            filter_type = FilterType(raw_type)
            start = end_group = None
            if filter_type in (FilterType.ABSOLUTE_START, FilterType.ABSOLUTE_RANGE):
                start = read_location(reader)
            if filter_type == FilterType.ABSOLUTE_RANGE:
                end_group = reader.read_varint()
        except NeedMoreData:
            raise ProtocolViolation("subscription filter shorter than its parameter") from None
        if not reader.eof():
            raise ProtocolViolation("subscription filter longer than its fields")
        return cls(filter_type=filter_type, start=start, end_group=end_group)


@dataclass(frozen=True, slots=True, kw_only=True)
class MessageParameters:
    """The Message Parameters a control message carries (§9.2.2); ``None`` means absent."""

    delivery_timeout: int | None = None
    authorization_tokens: tuple[AuthToken, ...] = ()
    expires: int | None = None
    largest_object: Location | None = None
    forward: int | None = None
    subscriber_priority: int | None = None
    subscription_filter: SubscriptionFilter | None = None
    group_order: GroupOrder | None = None
    new_group_request: int | None = None

    def to_kvps(self) -> list[KeyValuePair]:
        """The parameters as Key-Value-Pairs in ascending type order."""
        pairs: list[KeyValuePair] = []
        if self.delivery_timeout is not None:
            pairs.append((MessageParameter.DELIVERY_TIMEOUT, self.delivery_timeout))
        for token in self.authorization_tokens:
            pairs.append((MessageParameter.AUTHORIZATION_TOKEN, token.encode()))
        if self.expires is not None:
            pairs.append((MessageParameter.EXPIRES, self.expires))
        if self.largest_object is not None:
            writer = Writer()
            push_location(writer, self.largest_object)
            pairs.append((MessageParameter.LARGEST_OBJECT, writer.data))
        for param, value in (
            (MessageParameter.FORWARD, self.forward),
            (MessageParameter.SUBSCRIBER_PRIORITY, self.subscriber_priority),
        ):
            if value is not None:
                pairs.append((param, value))
        if self.subscription_filter is not None:
            pairs.append((MessageParameter.SUBSCRIPTION_FILTER, self.subscription_filter.encode()))
        if self.group_order is not None:
            pairs.append((MessageParameter.GROUP_ORDER, self.group_order))
        if self.new_group_request is not None:
            pairs.append((MessageParameter.NEW_GROUP_REQUEST, self.new_group_request))
        return pairs


def push_message_parameters(
    writer: Writer, params: MessageParameters, allowed: frozenset[MessageParameter]
) -> None:
    """Append ``Number of Parameters (i), Parameters...`` for a message allowing ``allowed``.

    Raises:
        ValueError: a parameter the message type does not define is set (a receiver would
            ignore it, §9.2.2).
    """
    pairs = params.to_kvps()
    stray = {MessageParameter(pair[0]).name for pair in pairs if pair[0] not in allowed}
    if stray:
        raise ValueError(f"parameters not defined for this message: {sorted(stray)}")
    writer.push_varint(len(pairs))
    push_kvps(writer, pairs)


def _decode_location(value: bytes) -> Location:
    reader = Reader(value)
    try:
        location = read_location(reader)
    except NeedMoreData:
        location = None
    if location is None or not reader.eof():
        raise KeyValueFormattingError("LARGEST_OBJECT is not exactly one Location")
    return location


def _check_range(name: str, value: int, low: int, high: int) -> int:
    if not low <= value <= high:
        raise ProtocolViolation(f"{name} = {value} outside {low}..{high}")
    return value


def _message_param_value(param: MessageParameter, value: int | bytes) -> object:
    """Decode and range-check one known message parameter value (§9.2.2.x)."""
    if isinstance(value, bytes):
        if param == MessageParameter.AUTHORIZATION_TOKEN:
            return AuthToken.decode(value)
        if param == MessageParameter.LARGEST_OBJECT:
            return _decode_location(value)
        return SubscriptionFilter.decode(value)
    if param == MessageParameter.DELIVERY_TIMEOUT and value == 0:
        # §9.2.2.2: DELIVERY_TIMEOUT of 0 MUST close the session with PROTOCOL_VIOLATION
        raise ProtocolViolation("DELIVERY_TIMEOUT is 0")
    if param == MessageParameter.FORWARD:
        return _check_range("FORWARD", value, 0, 1)
    if param == MessageParameter.SUBSCRIBER_PRIORITY:
        return _check_range("SUBSCRIBER_PRIORITY", value, 0, 255)
    if param == MessageParameter.GROUP_ORDER:
        return GroupOrder(_check_range("GROUP_ORDER", value, 1, 2))
    return value


_FIELD_OF = {
    MessageParameter.DELIVERY_TIMEOUT: "delivery_timeout",
    MessageParameter.EXPIRES: "expires",
    MessageParameter.LARGEST_OBJECT: "largest_object",
    MessageParameter.FORWARD: "forward",
    MessageParameter.SUBSCRIBER_PRIORITY: "subscriber_priority",
    MessageParameter.SUBSCRIPTION_FILTER: "subscription_filter",
    MessageParameter.GROUP_ORDER: "group_order",
    MessageParameter.NEW_GROUP_REQUEST: "new_group_request",
}


def read_message_parameters(
    reader: Reader, allowed: frozenset[MessageParameter]
) -> MessageParameters:
    """Read ``Number of Parameters (i), Parameters...`` for a message allowing ``allowed``.

    Raises:
        NeedMoreData: the input ends first.
        ProtocolViolation: an unknown parameter, a repeated one (other than AUTHORIZATION
            TOKEN), or a value outside its range.
        KeyValueFormattingError: a value that does not match its parameter's serialization.
    """
    values: dict[str, object] = {}
    tokens: list[AuthToken] = []
    for kvp_type, raw in read_kvps(reader, reader.read_varint()):
        if kvp_type not in MessageParameter._value2member_map_:
            # §9.2: an unknown Message Parameter MUST close with PROTOCOL_VIOLATION
            raise ProtocolViolation(f"unknown message parameter {kvp_type:#x}")
        param = MessageParameter(kvp_type)
        if param not in allowed:
            continue  # §9.2.2: a parameter in a message it is not defined for MUST be ignored
        value = _message_param_value(param, raw)
        if isinstance(value, AuthToken):
            tokens.append(value)  # §9.2.2.1: AUTHORIZATION TOKEN MAY repeat
            continue
        name = _FIELD_OF[param]
        if name in values:
            raise ProtocolViolation(f"message parameter {param.name} repeated")
        values[name] = value
    return MessageParameters(authorization_tokens=tuple(tokens), **values)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True, kw_only=True)
class SetupParameters:
    """The Setup Parameters of CLIENT_SETUP / SERVER_SETUP (§9.3.1); ``None`` means absent.

    ``unknown`` keeps parameters this version does not define, in wire order; they are
    otherwise ignored, and written back when encoding.
    """

    path: str | None = None
    max_request_id: int | None = None
    authorization_tokens: tuple[AuthToken, ...] = ()
    max_auth_token_cache_size: int | None = None
    authority: str | None = None
    moqt_implementation: str | None = None
    unknown: tuple[KeyValuePair, ...] = ()

    def to_kvps(self) -> list[KeyValuePair]:
        """The parameters as Key-Value-Pairs, known and unknown, in ascending type order."""
        pairs: list[KeyValuePair] = []
        if self.path is not None:
            pairs.append((SetupParameter.PATH, self.path.encode("utf-8")))
        if self.max_request_id is not None:
            pairs.append((SetupParameter.MAX_REQUEST_ID, self.max_request_id))
        for token in self.authorization_tokens:
            pairs.append((SetupParameter.AUTHORIZATION_TOKEN, token.encode()))
        if self.max_auth_token_cache_size is not None:
            pairs.append((SetupParameter.MAX_AUTH_TOKEN_CACHE_SIZE, self.max_auth_token_cache_size))
        if self.authority is not None:
            pairs.append((SetupParameter.AUTHORITY, self.authority.encode("utf-8")))
        if self.moqt_implementation is not None:
            pairs.append((SetupParameter.MOQT_IMPLEMENTATION, self.moqt_implementation.encode()))
        pairs.extend(self.unknown)
        pairs.sort(key=lambda pair: pair[0])
        return pairs


def push_setup_parameters(writer: Writer, params: SetupParameters) -> None:
    """Append ``Number of Parameters (i), Setup Parameters...``."""
    pairs = params.to_kvps()
    writer.push_varint(len(pairs))
    push_kvps(writer, pairs)


def _utf8(value: bytes, what: str, code: SessionError | None) -> str:
    """Decode text; ``code`` None means lenient (MOQT_IMPLEMENTATION is only a SHOULD)."""
    if code is None:
        return value.decode("utf-8", "replace")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolViolation(f"{what} is not UTF-8", error_code=code) from None


_SETUP_TEXT: dict[SetupParameter, tuple[str, SessionError | None]] = {
    SetupParameter.PATH: ("path", SessionError.MALFORMED_PATH),  # §9.3.1.2
    SetupParameter.AUTHORITY: ("authority", SessionError.MALFORMED_AUTHORITY),  # §9.3.1.1
    SetupParameter.MOQT_IMPLEMENTATION: ("moqt_implementation", None),  # §9.3.1.6
}
_SETUP_INT = {
    SetupParameter.MAX_REQUEST_ID: "max_request_id",
    SetupParameter.MAX_AUTH_TOKEN_CACHE_SIZE: "max_auth_token_cache_size",
}


def read_setup_parameters(reader: Reader) -> SetupParameters:
    """Read ``Number of Parameters (i), Setup Parameters...``.

    Raises:
        NeedMoreData: the input ends first.
        ProtocolViolation: a repeated known parameter (AUTHORIZATION TOKEN excepted); PATH or
            AUTHORITY that is not UTF-8 (MALFORMED_PATH / MALFORMED_AUTHORITY).
        KeyValueFormattingError: an undecodable Token structure.
    """
    values: dict[str, object] = {}
    tokens: list[AuthToken] = []
    unknown: list[KeyValuePair] = []
    for kvp_type, raw in read_kvps(reader, reader.read_varint()):
        if kvp_type not in SetupParameter._value2member_map_:
            unknown.append((kvp_type, raw))  # §9.3: unknown setup parameters MUST be ignored
            continue
        param = SetupParameter(kvp_type)
        if param == SetupParameter.AUTHORIZATION_TOKEN:
            tokens.append(AuthToken.decode(_as_bytes(raw)))
            continue
        if param in _SETUP_TEXT:
            name, code = _SETUP_TEXT[param]
            value: object = _utf8(_as_bytes(raw), name, code)
        else:
            name, value = _SETUP_INT[param], raw
        if name in values:
            raise ProtocolViolation(f"setup parameter {param.name} repeated")
        values[name] = value
    return SetupParameters(
        authorization_tokens=tuple(tokens),
        unknown=tuple(unknown),
        **values,  # type: ignore[arg-type]
    )


def _as_bytes(raw: int | bytes) -> bytes:
    # Odd types always decode to bytes (§1.4.2); this narrows the type for mypy.
    if isinstance(raw, int):
        raise KeyValueFormattingError("expected a length-prefixed value")
    return raw


class ExtensionType(IntEnum):
    """Extension Header types, Track and Object (§11, §13.3)."""

    DELIVERY_TIMEOUT = 0x02
    MAX_CACHE_DURATION = 0x04
    IMMUTABLE_EXTENSIONS = 0x0B
    DEFAULT_PUBLISHER_PRIORITY = 0x0E
    DEFAULT_PUBLISHER_GROUP_ORDER = 0x22
    DYNAMIC_GROUPS = 0x30
    PRIOR_GROUP_ID_GAP = 0x3C
    PRIOR_OBJECT_ID_GAP = 0x3E


_TRACK_EXTENSION_RANGES: dict[int, tuple[int, int]] = {
    ExtensionType.DEFAULT_PUBLISHER_PRIORITY: (0, 255),  # §11.1.1.1
    ExtensionType.DEFAULT_PUBLISHER_GROUP_ORDER: (1, 2),  # §11.1.1.2
    ExtensionType.DYNAMIC_GROUPS: (0, 1),  # §11.1.1.3
}


def check_track_extensions(extensions: tuple[KeyValuePair, ...]) -> tuple[KeyValuePair, ...]:
    """Range-check the known Track Extensions (§11.1); unknown ones pass untouched.

    Raises:
        ProtocolViolation: DELIVERY_TIMEOUT of 0, or a priority / group order / dynamic groups
            value out of range.
    """
    for ext_type, value in extensions:
        if not isinstance(value, int):
            continue
        if ext_type == ExtensionType.DELIVERY_TIMEOUT and value == 0:
            # §11.1: DELIVERY_TIMEOUT of 0 MUST close the session with PROTOCOL_VIOLATION
            raise ProtocolViolation("DELIVERY_TIMEOUT track extension is 0")
        bounds = _TRACK_EXTENSION_RANGES.get(ext_type)
        if bounds is not None:
            _check_range(ExtensionType(ext_type).name, value, *bounds)
    return extensions


def track_extension(extensions: tuple[KeyValuePair, ...], ext_type: int) -> int | bytes | None:
    """The value of the first extension of ``ext_type``, or None when absent."""
    for pair_type, value in extensions:
        if pair_type == ext_type:
            return value
    return None
