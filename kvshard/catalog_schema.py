"""Catalog versions: what the operator publishes and every pod of a CacheShard reads.

See docs/architecture.md#etcd-layout and docs/operator.md#your-catalog-your-prompt.

One source of truth. The operator reads ``spec.catalog`` (built-in, ConfigMap, file or URL),
checks it, and publishes it to etcd as a *content-addressed version* beside the placement
generations::

    /kvshard/v1/<namespace>/<name>/catalog/<version>/manifest     items, chunks, bytes
    /kvshard/v1/<namespace>/<name>/catalog/<version>/chunks/<i>   items (JSON, each ≤ 1 MiB)

``version`` is a hash of every item's id, text and fields, and each generation names the version
it was computed from. A sidecar loads the version its generation names and nothing else, so a pod
can never serve a catalog the placement was not made for, and the sidecars need no catalog
setting, no volume and no API access of their own.

Why etcd and not "each pod fetches the source": the sources differ in reach (a ConfigMap needs
API rights in the pod, a file a shared volume, a URL network access and its token), a source can
change between two pods' reads, and a bad edit must not reach any pod. Publishing the checked
version makes every pod read the same bytes, through the one client they already have. It scales
like generations do: a 1 M-item catalog of ~60-character texts is ~80 MB in ~80 chunks, written
once per change (unchanged versions are not rewritten: the key is the content) and read once per
pod per change; etcd's default 2 GiB backend quota holds the two versions kept. Beyond that, raise
``--quota-backend-bytes``.

Parsing collects the first bad lines instead of stopping at the first, so the ``Degraded``
condition can name them all at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from kvshard.datasets import Item

SCHEMA = 1
MAX_VALUE_BYTES = 1 << 20  # etcd values, docs/architecture.md#etcd-layout
_CHUNK_TARGET = MAX_VALUE_BYTES - 4096
MAX_ID_CHARS = 256
MAX_TEXT_CHARS = 4096
MAX_BAD_LINES = 5
SCALARS = (str, int, float, bool)
_encode_string: Callable[[str], str] = json.encoder.encode_basestring


class CatalogError(ValueError):
    """A catalog that cannot be used; ``reason`` is one CamelCase word (the condition's reason) and
    ``bad_lines`` the first problems found, each naming its line."""

    def __init__(self, reason: str, message: str, bad_lines: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.reason = reason
        self.bad_lines = tuple(bad_lines)


@dataclasses.dataclass(frozen=True)
class Catalog:
    """Items in a stable order: ``ids[i]`` has text ``texts[i]`` and extra ``fields[i]`` (strings,
    empty when the source has none); ``histories`` hold item ids (only built-ins have them)."""

    ids: tuple[str, ...]
    texts: tuple[str, ...]
    histories: tuple[tuple[str, ...], ...] = ()
    fields: tuple[Mapping[str, str], ...] = ()

    def __len__(self) -> int:
        return len(self.ids)

    def fields_of(self, index: int) -> Mapping[str, str]:
        return self.fields[index] if self.fields else {}

    @property
    def content_hash(self) -> str:
        """The version: a hash of every id, text and field, in order (32 hex characters)."""
        cached: str | None = self.__dict__.get("_hash")
        if cached is None:
            # one update of the whole stream (the same bytes item by item would cost 100k calls)
            if self.fields:
                parts = [f"{item_id}\x00{text}\x01" + (json.dumps(extra, sort_keys=True) + "\x02" if extra else "")
                         for item_id, text, extra in zip(self.ids, self.texts, self.fields, strict=True)]
            else:
                parts = [f"{item_id}\x00{text}\x01" for item_id, text in zip(self.ids, self.texts, strict=True)]
            cached = hashlib.blake2b("".join(parts).encode(), digest_size=16).hexdigest()
            object.__setattr__(self, "_hash", cached)
        return cached

    @property
    def version(self) -> str:
        return self.content_hash

    def items(self) -> dict[str, Item]:
        """Item id → :class:`~kvshard.datasets.Item` (what the prompt builder reads)."""
        return {item_id: Item(item_id, text, dict(self.fields_of(i)))
                for i, (item_id, text) in enumerate(zip(self.ids, self.texts, strict=True))}

    def records(self) -> Iterator[tuple[str, str, Mapping[str, str]]]:
        for i, (item_id, text) in enumerate(zip(self.ids, self.texts, strict=True)):
            yield item_id, text, self.fields_of(i)


def one_line(text: str) -> str:
    """Whitespace runs (newlines included) become one space: an item is one line of the prompt."""
    return " ".join(text.split())


def parse_record(row: Any) -> tuple[str, str, dict[str, str]] | str:
    """``(id, text, fields)`` of one ``{"id", "text", ...}`` object, or why it is not one."""
    if not isinstance(row, dict):
        return 'expected a JSON object {"id": ..., "text": "..."}'
    item_id, text = row.get("id"), row.get("text")
    if isinstance(item_id, bool) or not isinstance(item_id, (str, int)) or str(item_id) == "":
        return "field 'id' must be a non-empty string or an integer"
    if len(str(item_id)) > MAX_ID_CHARS:
        return f"field 'id' is longer than {MAX_ID_CHARS} characters"
    if not isinstance(text, str) or not text.strip():
        return f"item {str(item_id)!r}: field 'text' must be a non-empty string"
    if len(text) > MAX_TEXT_CHARS:
        return f"item {str(item_id)!r}: field 'text' is longer than {MAX_TEXT_CHARS} characters"
    fields = {str(k): one_line(str(v)) for k, v in row.items()
              if k not in ("id", "text") and isinstance(v, SCALARS) and str(v).strip()}
    return str(item_id), one_line(text), fields


def parse_jsonl(text: str, origin: str, extra: Callable[[Any], str | None] | None = None) -> Catalog:
    """A catalog from JSON Lines of ``{"id": ..., "text": "...", <other fields>}`` (blank lines
    skipped). Malformed lines, duplicate ids and empty texts are all collected; the
    :class:`CatalogError` names the first :data:`MAX_BAD_LINES` of them. ``extra`` sees each good
    line's object, in order, and returns why it is bad (e.g. a missing vector) or None."""
    ids: list[str] = []
    texts: list[str] = []
    extras: list[Mapping[str, str]] = []
    first_line: dict[str, int] = {}
    bad: list[str] = []
    bad_count = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        row: Any = None
        try:
            row = json.loads(line)
            parsed = parse_record(row)
        except json.JSONDecodeError as exc:
            parsed = f"not JSON ({exc.msg})"
        except RecursionError:
            parsed = "not JSON (nested too deeply)"
        if isinstance(parsed, tuple) and parsed[0] in first_line:
            parsed = f"duplicate id {parsed[0]!r} (first on line {first_line[parsed[0]]})"
        if isinstance(parsed, tuple) and extra is not None:
            parsed = extra(row) or parsed
        if isinstance(parsed, str):
            bad_count += 1
            if len(bad) < MAX_BAD_LINES:
                bad.append(f"line {number}: {parsed}")
            continue
        item_id, item_text, fields = parsed
        first_line[item_id] = number
        ids.append(item_id)
        texts.append(item_text)
        extras.append(fields)
    if bad:
        more = f" (and {bad_count - len(bad)} more)" if bad_count > len(bad) else ""
        raise CatalogError("CatalogInvalid", f"{origin}: {bad_count} bad line(s): {'; '.join(bad)}{more}", bad)
    if not ids:
        raise CatalogError("CatalogEmpty", f"{origin} holds no items")
    return Catalog(tuple(ids), tuple(texts), fields=tuple(extras) if any(extras) else ())


# ------------------------------------------------------------------------------------------ diff


@dataclasses.dataclass(frozen=True)
class CatalogDiff:
    """What changed between two versions: ids added, ids whose text or fields changed, ids removed."""

    added: tuple[str, ...]
    edited: tuple[str, ...]
    removed: tuple[str, ...]

    @property
    def empty(self) -> bool:
        return not (self.added or self.edited or self.removed)

    def summary(self) -> str:
        """``+N ~M −K`` (what the status shows)."""
        return f"+{len(self.added)} ~{len(self.edited)} \u2212{len(self.removed)}"


def diff(old: Catalog, new: Catalog) -> CatalogDiff:
    """Added, edited and removed ids from ``old`` to ``new`` (one pass over each, O(n))."""
    added: list[str] = []
    edited: list[str] = []
    if not old.fields and not new.fields:  # the common case: compare texts only, no per-item records
        texts = dict(zip(old.ids, old.texts, strict=True))
        for item_id, text in zip(new.ids, new.texts, strict=True):
            prior_text = texts.pop(item_id, None)
            if prior_text is None:
                added.append(item_id)
            elif prior_text != text:
                edited.append(item_id)
        return CatalogDiff(tuple(added), tuple(edited), tuple(texts))
    before = {item_id: (text, fields) for item_id, text, fields in old.records()}
    for item_id, text, fields in new.records():
        prior = before.pop(item_id, None)
        if prior is None:
            added.append(item_id)
        elif prior[0] != text or dict(prior[1]) != dict(fields):
            edited.append(item_id)
    return CatalogDiff(tuple(added), tuple(edited), tuple(before))


# ------------------------------------------------------------------------------------------ etcd values


def encode(catalog: Catalog) -> tuple[bytes, list[bytes]]:
    """``(manifest, chunks)`` for etcd: chunks of ``[id, text, fields]`` rows, each ≤ 1 MiB."""
    chunks: list[bytes] = []
    rows: list[str] = []
    size = 0
    quote = _encode_string  # the C escaper json.dumps uses: the same bytes without 100k dumps calls
    for item_id, text, fields in catalog.records():
        row = (f"[{quote(item_id)},{quote(text)},{json.dumps(dict(fields), ensure_ascii=False, separators=(',', ':'))}]"
               if fields else f"[{quote(item_id)},{quote(text)}]")
        length = (len(row) if row.isascii() else len(row.encode())) + 1
        if rows and size + length > _CHUNK_TARGET:
            chunks.append(_chunk(rows))
            rows, size = [], 0
        rows.append(row)
        size += length
    if rows or not chunks:
        chunks.append(_chunk(rows))
    manifest = json.dumps({"schema": SCHEMA, "version": catalog.version, "items": len(catalog),
                           "chunks": len(chunks), "bytes": sum(map(len, chunks))}, separators=(",", ":")).encode()
    return manifest, chunks


def _chunk(rows: Sequence[str]) -> bytes:
    data = ('{"schema":' + str(SCHEMA) + ',"items":[' + ",".join(rows) + "]}").encode()
    if len(data) > MAX_VALUE_BYTES:
        raise CatalogError("CatalogInvalid", "a single item is larger than 1 MiB")
    return data


def decode_manifest(data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CatalogError("CatalogCorrupt", f"catalog manifest is not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise CatalogError("CatalogCorrupt", "unknown catalog schema")
    return doc


def decode(manifest: bytes, chunks: Iterable[bytes]) -> Catalog:
    """A whole version from its stored values, checked against the version it claims to be."""
    doc = decode_manifest(manifest)
    ids: list[str] = []
    texts: list[str] = []
    extras: list[Mapping[str, str]] = []
    count = 0
    for data in chunks:
        count += 1
        try:
            rows = json.loads(data)["items"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CatalogError("CatalogCorrupt", f"catalog chunk {count - 1} is unreadable: {exc}") from exc
        for row in rows:
            ids.append(row[0])
            texts.append(row[1])
            extras.append(row[2] if len(row) > 2 else {})
    if count != doc["chunks"]:
        raise CatalogError("CatalogCorrupt", f"catalog {doc['version']} has {count} of {doc['chunks']} chunks")
    catalog = Catalog(tuple(ids), tuple(texts), fields=tuple(extras) if any(extras) else ())
    if catalog.version != doc["version"]:
        raise CatalogError("CatalogCorrupt", f"catalog chunks hash to {catalog.version}, not {doc['version']}")
    return catalog
