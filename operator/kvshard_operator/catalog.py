"""Catalog sources of a CacheShard: a built-in data set, a JSONL file, a ConfigMap key or a URL.

Every source yields the same :class:`~kvshard.catalog_schema.Catalog` — item ids, texts and extra
fields in a stable order, plus user histories when the source has them (only built-ins do) for the
optional co-occurrence pull. Errors are :class:`CatalogError` with a CamelCase ``reason`` that
becomes the condition's reason and the first bad lines; the caller keeps the last good version in
force (a bad edit never reaches a pod, :mod:`kvshard.catalog_schema`).

Only the operator reads sources; pods read the checked version from etcd. So the operator alone
needs the ConfigMap's API rights, the file's volume, or the URL's network reach and token.
"""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvshard.catalog_schema import Catalog, CatalogError, parse_jsonl
from kvshard.datasets import DatasetError, load_dataset

__all__ = ["CONFIGMAP_MAX_BYTES", "Catalog", "CatalogError", "ConfigMapReader", "SecretKeyReader", "describe",
           "load_catalog", "parse_jsonl"]

ConfigMapReader = Callable[[str, str], Mapping[str, str]]
"""``(namespace, name) -> data``; raises :class:`CatalogError` when the ConfigMap is missing."""
SecretKeyReader = Callable[[str, str, str], str]
"""``(namespace, name, key) -> value``; raises ValueError when the Secret or key is missing."""

CONFIGMAP_MAX_BYTES = 1 << 20
"""Kubernetes refuses ConfigMaps over 1 MiB; a bigger catalog belongs in a file or at a URL."""
URL_MAX_BYTES = 2 << 30
URL_TIMEOUT_S = 30.0


def describe(source: Mapping[str, Any], namespace: str) -> str:
    """The source in words, for conditions and logs."""
    if "builtin" in source:
        return f"built-in catalog {source['builtin']}"
    if "file" in source:
        return f"catalog file {source['file']['path']}"
    if "configMap" in source:
        ref = source["configMap"]
        return f"ConfigMap {namespace}/{ref['name']} key {ref['key']}"
    if "url" in source:
        return f"catalog URL {_redacted(source['url']['url'])}"
    return "spec.catalog"


def _redacted(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def load_catalog(source: Mapping[str, Any], namespace: str, read_configmap: ConfigMapReader | None = None,
                 read_secret_key: SecretKeyReader | None = None,
                 extra: Callable[[Any], str | None] | None = None) -> Catalog:
    """The catalog named by ``spec.catalog`` (exactly one of builtin, file, configMap, url).

    ``extra`` sees every parsed JSONL line (:func:`parse_jsonl`): the per-line vectors of
    :mod:`catalog_vectors` are read in the same pass. Built-ins have no lines, so none with it."""
    origin = describe(source, namespace)
    if "builtin" in source:
        if extra is not None:
            raise CatalogError("EmbeddingsInvalid", f"{origin}: a built-in catalog carries no vectors "
                               "(spec.catalog.embeddings.from must be Model)")
        try:
            dataset = load_dataset(str(source["builtin"]))
        except (DatasetError, FileNotFoundError) as exc:
            raise CatalogError("CatalogNotFound", f"{origin}: {exc}") from exc
        ids = tuple(sorted(dataset.items))
        histories = tuple(tuple(h) for h in dataset.histories.values())
        return Catalog(ids, tuple(dataset.items[i].text for i in ids), histories)
    if "file" in source:
        path = Path(source["file"]["path"])
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CatalogError("CatalogNotFound", f"{origin}: {getattr(exc, 'strerror', None) or exc}") from exc
        return parse_jsonl(text, origin, extra)
    if "configMap" in source:
        ref = source["configMap"]
        if read_configmap is None:
            raise CatalogError("CatalogNotFound", "ConfigMap catalogs need API access")
        data = read_configmap(namespace, ref["name"])
        if ref["key"] not in data:
            raise CatalogError("CatalogNotFound", f"ConfigMap {namespace}/{ref['name']} has no key {ref['key']!r}")
        text = data[ref["key"]]
        size = len(text.encode())
        if size > CONFIGMAP_MAX_BYTES:
            raise CatalogError("CatalogTooLarge", f"{origin}: {size} bytes; a ConfigMap holds at most 1 MiB "
                               "(1048576 bytes): put a bigger catalog in a file or at a URL (spec.catalog.url)")
        return parse_jsonl(text, origin, extra)
    if "url" in source:
        return parse_jsonl(_fetch(source["url"], namespace, read_secret_key, origin), origin, extra)
    raise CatalogError("CatalogInvalid", "spec.catalog names no source")


def _fetch(ref: Mapping[str, Any], namespace: str, read_secret_key: SecretKeyReader | None, origin: str) -> str:
    """GET the catalog (HTTP or HTTPS), with ``Authorization: Bearer <token>`` from the Secret
    ``ref.secretRef`` when given. Any failure is ``CatalogUnreachable`` (the last good version stays)."""
    headers = {"Accept": "application/x-ndjson, application/jsonl, text/plain, */*"}
    secret = ref.get("secretRef")
    if secret:
        if read_secret_key is None:
            raise CatalogError("CatalogUnreachable", f"{origin}: no API access to read its token Secret")
        key = secret.get("key", "token")
        try:
            token = str(read_secret_key(namespace, secret["name"], key)).strip()
        except ValueError as exc:
            raise CatalogError("CatalogUnreachable", f"{origin}: token Secret: {exc}") from exc
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(ref["url"], headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=URL_TIMEOUT_S) as response:  # noqa: S310 (http(s) by CRD)
            body = response.read(URL_MAX_BYTES + 1)
    except urllib.error.HTTPError as exc:
        raise CatalogError("CatalogUnreachable", f"{origin}: HTTP {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise CatalogError("CatalogUnreachable", f"{origin}: {reason}") from exc
    if len(body) > URL_MAX_BYTES:
        raise CatalogError("CatalogTooLarge", f"{origin}: larger than {URL_MAX_BYTES} bytes")
    try:
        text: str = bytes(body).decode("utf-8")
        return text
    except UnicodeDecodeError as exc:
        raise CatalogError("CatalogInvalid", f"{origin}: not UTF-8 ({exc.reason} at byte {exc.start})") from exc
