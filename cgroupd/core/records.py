"""Reading group configs from their KV records, as tolerantly as the reference.

Pure core: no I/O. Reads the current Go reference's records (orbit.go ``pcgroups``), its
older single-``filter`` record and the ADR's revision-1 record; fields this version does
not know are kept in ``extra`` so writing the config back keeps them. Writing is
``to_json`` on the configs themselves (:mod:`cgroupd.core.config`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from cgroupd.core.config import (
    ABSENT,
    DOTNET_ESCAPE,
    GO_ESCAPE,
    LIST,
    NULL,
    ElasticGroupConfig,
    MemberMapping,
    PartitioningFilter,
    StaticGroupConfig,
    WireForm,
    dump_record,
)
from cgroupd.core.errors import ConfigError

_ELASTIC_KNOWN = {
    "max_members", "partitioning_filters", "filter", "partitioning_wildcards",
    "partitioning-wildcards", "max_buffered_msg", "max_buffered_msgs", "msg-buffer-size",
    "max_buffered_bytes", "members", "member_mappings", "member-mappings",
}
_STATIC_KNOWN = {"max_members", "filters", "filter", "members", "member_mappings",
                 "member-mappings"}


def _load_object(data: bytes | str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # deep nesting
        raise ConfigError(f"group record is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ConfigError(f"group record must be a JSON object, not {type(obj).__name__}")
    return obj


def _list_form(obj: dict[str, Any], key: str) -> str:
    """How ``key`` was spelled: ``LIST``, ``NULL`` or ``ABSENT``."""
    if key not in obj:
        return ABSENT
    return NULL if obj[key] is None else LIST


#: The JSON text styles the reference's writers use, tried in turn to find the one a
#: stored record was written in (so writing it back is byte for byte the writer's).
_STYLES = [WireForm(separators=seps, escape=esc, ascii=asc)
           for seps in ((",", ":"), (", ", ": "))
           for esc in ("", GO_ESCAPE, DOTNET_ESCAPE)
           for asc in (False, True)]


def _guess(raw: bytes) -> WireForm:
    """The likeliest style, from a glance at the text (checked by one dump)."""
    seps = (", ", ": ") if re.match(rb'\{\s*"[^"]*": ', raw) else (",", ":")
    escape = (DOTNET_ESCAPE if b"\\u003E" in raw or b"\\u002B" in raw
              else GO_ESCAPE if re.search(rb"\\u00(3e|3c|26)", raw) else "")
    return WireForm(separators=seps, escape=escape)


def _form(data: bytes | str, obj: dict[str, Any], **kw: Any) -> WireForm:
    raw = (data.encode() if isinstance(data, str) else data).strip()
    guess = _guess(raw)
    style = next((s for s in (guess, *_STYLES) if dump_record(obj, s) == raw), _STYLES[0])
    return WireForm(keys=tuple(obj), members=_list_form(obj, "members"),
                    separators=style.separators, escape=style.escape, ascii=style.ascii,
                    **kw)


def _int_list(value: Any, what: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(f"{what} must be a list of integers, not {value!r}")
    return tuple(value)


def _str_list(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{what} must be a list of strings, not {value!r}")
    return tuple(value)


def _mappings(value: Any) -> tuple[MemberMapping, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(f"member_mappings must be a list, not {value!r}")
    out = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("member"), str):
            raise ConfigError(f"member mapping {item!r} needs a 'member' string")
        out.append(MemberMapping(
            item["member"], _int_list(item.get("partitions"), "mapping partitions"),
            partitions_form=_list_form(item, "partitions"),
            extra={k: v for k, v in item.items() if k not in ("member", "partitions")}))
    return tuple(out)


def elastic_from_json(data: bytes | str) -> ElasticGroupConfig:
    """Decode an elastic group record (current Go, older Go single-filter, or ADR rev-1)."""
    obj = _load_object(data)
    filters: list[PartitioningFilter] = []
    filters_form = _list_form(obj, "partitioning_filters")
    if obj.get("partitioning_filters") is not None:
        raw = obj["partitioning_filters"]
        if not isinstance(raw, list) or not all(isinstance(x, dict) for x in raw):
            raise ConfigError("partitioning_filters must be a list of objects (or null)")
        for item in raw:
            if not isinstance(item.get("filter"), str):
                raise ConfigError(f"partitioning filter {item!r} needs a 'filter' string")
            filters.append(PartitioningFilter(
                item["filter"],
                _int_list(item.get("partitioning_wildcards"), "partitioning_wildcards"),
                wildcards_form=_list_form(item, "partitioning_wildcards"),
                extra={k: v for k, v in item.items()
                       if k not in ("filter", "partitioning_wildcards")}))
    elif "partitioning_filters" not in obj and obj.get("filter") is not None:
        if not isinstance(obj["filter"], str):
            raise ConfigError(f"filter must be a subject string, not {obj['filter']!r}")
        # The older single-filter record; written back in the current shape.
        wild = obj.get("partitioning_wildcards", obj.get("partitioning-wildcards"))
        filters = [PartitioningFilter(obj["filter"], _int_list(wild, "partitioning_wildcards"))]
        filters_form = LIST
    # Otherwise (null, [] or no filter at all): whole-subject partitioning, as the
    # reference (orbit.go >= 0.2.0, orbit.java, orbit.net) writes it.
    max_msgs = obj.get("max_buffered_msg", obj.get("max_buffered_msgs",
                                                   obj.get("msg-buffer-size")))
    max_bytes = obj.get("max_buffered_bytes")
    legacy = "partitioning_filters" not in obj and obj.get("filter") is not None
    extra = {k: v for k, v in obj.items()
             if k not in _ELASTIC_KNOWN or (k in ("filter", "partitioning_wildcards")
                                            and not legacy)}
    # "No limit" is written as -1 (natsio-pcgroups), 0 or null, or left out (orbit.go):
    # write back exactly what was there, or the reference's members see a change of
    # the group's fixed settings and stop.
    for name in ("max_buffered_msg", "max_buffered_bytes"):
        if name in obj and _no_limit(obj[name]):
            extra[name] = obj[name]
    return ElasticGroupConfig(
        max_members=obj.get("max_members"),  # type: ignore[arg-type]  # checked in post_init
        partitioning_filters=tuple(filters),
        max_buffered_msgs=0 if _no_limit(max_msgs) else max_msgs,  # type: ignore[arg-type]
        max_buffered_bytes=0 if _no_limit(max_bytes) else max_bytes,  # type: ignore[arg-type]
        members=_str_list(obj.get("members"), "members"),
        member_mappings=_mappings(obj.get("member_mappings", obj.get("member-mappings"))),
        extra=extra,
        lenient=True,
        form=_form(data, obj, filters=filters_form),
    )


def _no_limit(value: object) -> bool:
    return value is None or (type(value) is int and value in (0, -1))


def static_from_json(data: bytes | str) -> StaticGroupConfig:
    """Decode a static group record (``filters`` list, or the older single ``filter``)."""
    obj = _load_object(data)
    filters = obj.get("filters")
    single = False
    if filters is None and isinstance(obj.get("filter"), str) and obj["filter"]:
        filters = [obj["filter"]]  # orbit.java writes one 'filter' string
        single = True
    return StaticGroupConfig(
        max_members=obj.get("max_members"),  # type: ignore[arg-type]
        filters=_str_list(filters, "filters"),
        members=_str_list(obj.get("members"), "members"),
        member_mappings=_mappings(obj.get("member_mappings", obj.get("member-mappings"))),
        extra={k: v for k, v in obj.items()
               if k not in _STATIC_KNOWN or (k == "filter" and not single)},
        lenient=True,
        form=_form(data, obj, single_filter=single, filters=_list_form(obj, "filters")),
    )
