"""The layouts of a batch a vLLM publisher sends, each built from the one declaration of
the events' fields (events.py):

- map (vLLM >= 0.26, the default): each event a map whose `"type"` key names it;
- map with bytes hashes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`);
- positional (vLLM <= 0.25): each event an array, its type name first, then its fields in
  declaration order through `group_idx` (later fields are ignored).

Each layout has a typed decoder of a whole batch. A batch that none of them decodes (an
unknown event type, a field of the wrong type, layouts mixed) is read event by event with
`read_by_hand`, which checks each declared field by its kind. Either way an event gets
every field its layout carries, with the same values.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from epp.prefix.kv_events.events import EVENT_TYPES, EventBatch, KvEvent
from epp.prefix.kv_events.fields import Invalid, Kind

# The last field each event carries in the positional layout: kv_cache_spec_kind is newer.
_POSITIONAL_THROUGH = "group_idx"


class UnknownType(Exception):
    """An event whose type this decoder does not know; args[0] is what was sent."""


@dataclass(frozen=True, slots=True)
class Layout:
    """One way a batch is sent. `decoder` decodes a whole batch; `converters` turn each of
    its events, by the struct it was decoded as, into the event the router keeps (None:
    they are those events already, hashes as ints); `bytes_hashes`: its hashes may be
    bytes; `counter`: a reason counted once per batch in this layout."""

    name: str
    decoder: msgspec.msgpack.Decoder[Any]
    converters: dict[type, Callable[[Any], KvEvent]] | None
    bytes_hashes: bool
    counter: str | None


def declared(cls: type[KvEvent]) -> tuple[tuple[str, Kind], ...]:
    """Each field `cls` declares, in order, with its kind."""
    return tuple((info.name, info.type.__metadata__[0]) for info in msgspec.structs.fields(cls))


def positional_fields(cls: type[KvEvent]) -> tuple[str, ...]:
    """The fields an event of `cls` carries in the positional layout, in order."""
    names = [name for name, _ in declared(cls)]
    return tuple(names[: names.index(_POSITIONAL_THROUGH) + 1]) if names else ()


def _variant(cls: type[KvEvent], *, array_like: bool, bytes_hashes: bool) -> type[Any]:
    """The struct a typed decoder reads `cls` as in a layout: `cls` itself when the layout
    is `cls`'s own (a map with int hashes)."""
    infos = msgspec.structs.fields(cls)
    if array_like:
        infos = infos[: len(positional_fields(cls))]
    widen = bytes_hashes and any(info.type.__metadata__[0].with_bytes for info in infos)
    if not array_like and not widen:
        return cls
    fields = []
    for info in infos:
        kind: Kind = info.type.__metadata__[0]
        typ = kind.with_bytes if bytes_hashes and kind.with_bytes is not None else info.type
        fields.append((info.name, typ, info.default))  # NODEFAULT: required
    # tag=True, as vLLM declares it: the class name, under "type" in a map, first in an array.
    return msgspec.defstruct(cls.__name__, fields, tag=True, array_like=array_like, gc=False)


def _converter(cls: type[KvEvent], bytes_hashes: bool) -> Callable[[Any], KvEvent]:
    """What turns `cls`'s variant into `cls`: the values in order, hashes made ints."""
    astuple = msgspec.structs.astuple
    to_int = [
        (at, kind.from_bytes)
        for at, (_, kind) in enumerate(declared(cls))
        if bytes_hashes and kind.from_bytes is not None
    ]
    if not to_int:
        return lambda item: cls(*astuple(item))

    def convert(item: Any) -> KvEvent:
        values = list(astuple(item))
        for at, from_bytes in to_int:
            values[at] = from_bytes(values[at])
        return cls(*values)

    return convert


def _layout(name: str, *, array_like: bool, bytes_hashes: bool, counter: str | None) -> Layout:
    variants = {
        cls: _variant(cls, array_like=array_like, bytes_hashes=bytes_hashes) for cls in EVENT_TYPES
    }
    converters: dict[type, Callable[[Any], KvEvent]] | None = {
        variant: _same if variant is cls else _converter(cls, bytes_hashes)
        for cls, variant in variants.items()
    }
    batch: type[Any] = EventBatch
    if all(variant is cls for cls, variant in variants.items()):
        converters = None  # the decoder yields the router's own events
    else:
        batch = msgspec.defstruct(
            "EventBatch",
            [
                ("ts", float),
                ("events", list[functools.reduce(operator.or_, variants.values())]),  # type: ignore[misc]
                ("data_parallel_rank", int | None, None),
            ],
            array_like=True,
            gc=False,
        )
    return Layout(name, msgspec.msgpack.Decoder(batch), converters, bytes_hashes, counter)


def _same(event: KvEvent) -> KvEvent:
    return event


def build_layouts() -> tuple[Layout, ...]:
    """The layouts, in the order a decoder tries them: the first that decodes a batch
    reads it. A map batch with int hashes fits the bytes layout too; the int one comes
    first because its events need no conversion."""
    return (
        _layout("map", array_like=False, bytes_hashes=False, counter=None),
        _layout("map, bytes hashes", array_like=False, bytes_hashes=True, counter=None),
        _layout("positional", array_like=True, bytes_hashes=False, counter="positional_layout"),
    )


LAYOUTS = build_layouts()

_BY_NAME: dict[str, tuple[type[KvEvent], tuple[tuple[str, Kind], ...], tuple[str, ...]]] = {
    cls.__name__: (cls, declared(cls), positional_fields(cls)) for cls in EVENT_TYPES
}


def read_by_hand(item: object) -> tuple[KvEvent, bool]:
    """The event in `item` (a map or a positional array, decoded without a type), and
    whether its block hashes came as bytes. Raises Invalid for a broken rule, UnknownType
    for a type not declared in events.py."""
    if isinstance(item, dict):
        name = item.get("type")
    elif isinstance(item, list) and item:
        name = item[0]
    else:
        raise Invalid("an event is neither a map nor a non-empty array")
    entry = _BY_NAME.get(name) if isinstance(name, str) else None
    if entry is None:
        raise UnknownType(name)
    cls, kinds, positional = entry
    fields = item if isinstance(item, dict) else dict(zip(positional, item[1:], strict=False))
    event = cls(*[kind.read(field, fields.get(field)) for field, kind in kinds])
    hashes = fields.get("block_hashes")
    return event, isinstance(hashes, list) and any(type(h) is bytes for h in hashes)


def sent_bytes(item: object) -> bool:
    """Whether a typed-decoded event's block hashes came as bytes."""
    return any(type(h) is bytes for h in getattr(item, "block_hashes", ()))
