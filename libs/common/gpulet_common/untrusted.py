"""Decode totally: the one door for every untrusted document that is not a bus message.

Bus messages have their typed codecs (:mod:`gpulet_common.codec`). Everything else that
gpulet reads from outside -- an API server's answer or watch line, a settings or
time-slicing file, a kubeconfig, a state file, a NATS reply of another tool -- is
parsed here, so that one rule holds at every seam:

* **Size** is bounded before parsing (``max_bytes``).
* **Depth** is bounded before parsing, for JSON at C speed
  (:func:`gpulet_common.codec.nesting_problem`): ``json``, msgspec, ``tomllib`` and
  PyYAML all recurse per nesting level and raise ``RecursionError`` -- a
  ``RuntimeError``, which no ``except ValueError`` catches -- on a document a few
  thousand levels deep. For TOML and YAML the parser's own failure is mapped.
* **Typed files** (a checkpoint, a settings or configs file with its own Struct) go
  through :func:`json_typed` (the same bounds, then the file's own msgspec decoder:
  msgspec recurses while it skips an unknown field too) or :func:`toml_typed`.
* **YAML aliases** are refused (:func:`yaml_document`): an alias bomb's few kilobytes
  expand into gigabytes in whoever walks the result, and no document gpulet reads
  needs an alias.
* **Every failure** -- ``RecursionError`` and ``MemoryError`` included -- leaves as
  :class:`UntrustedDocumentError` (a ``ValueError``), with a short ``reason`` for the
  metrics and a ``detail`` an operator reads. Nothing else escapes.

For example::

    try:
        doc = json_document(raw, what="ResourceClaim watch line")
    except UntrustedDocumentError as exc:
        log.warning("dropped: %s", exc)
"""

from __future__ import annotations

import datetime
import tomllib
from typing import Any, Final, TypeVar

import msgspec

from gpulet_common.codec import TOO_DEEP, nesting_problem

# JSON from an API server nests far less than this (a ResourceClaim's opaque
# parameters are the user's, so they are the deepest part); kube-apiserver itself
# accepts up to 10,000 levels, which is why gpulet needs its own bound.
MAX_DEPTH: Final = 100
MAX_BYTES: Final = 32 << 20

# Reasons.
TOO_LARGE: Final = "too_large"
INVALID: Final = "invalid"
ALIASES: Final = "aliases"
ERROR: Final = "error"

_json: Final = msgspec.json.Decoder()
T = TypeVar("T")
_TOML_BUILTINS: Final = (datetime.datetime, datetime.date, datetime.time)


class UntrustedDocumentError(ValueError):
    """An untrusted document that could not be used; ``reason`` is one of this
    module's reasons (or :data:`gpulet_common.codec.TOO_DEEP`)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _bounded_size(raw: bytes | bytearray | memoryview | str, max_bytes: int, what: str) -> None:
    size = len(raw)
    if size > max_bytes:
        raise UntrustedDocumentError(
            TOO_LARGE, f"{what}: {size} bytes is over the {max_bytes}-byte limit"
        )


def json_document(
    raw: bytes | bytearray | memoryview | str,
    *,
    max_bytes: int = MAX_BYTES,
    max_depth: int = MAX_DEPTH,
    what: str = "document",
) -> Any:
    """``raw`` JSON as Python objects, or :class:`UntrustedDocumentError`."""
    return json_typed(raw, _json, max_bytes=max_bytes, max_depth=max_depth, what=what)


def json_typed(
    raw: bytes | bytearray | memoryview | str,
    decoder: msgspec.json.Decoder[T],
    *,
    max_bytes: int = MAX_BYTES,
    max_depth: int = MAX_DEPTH,
    what: str = "document",
) -> T:
    """``raw`` JSON decoded by ``decoder`` (a state or settings file's own Struct
    decoder, strict or not as it was built; untyped for :func:`json_document`), or
    :class:`UntrustedDocumentError`. The bounds run first whatever the decoder: msgspec
    recurses while it skips an unknown field as much as while it decodes an ``Any``."""
    _bounded_size(raw, max_bytes, what)
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    try:
        problem = nesting_problem(data, max_depth)
        if problem is not None:
            reason, detail = problem
            raise UntrustedDocumentError(  # noqa: TRY301 - one except for all paths
                reason if reason == TOO_DEEP else INVALID, f"{what}: {detail}"
            )
        return decoder.decode(data)
    except UntrustedDocumentError:
        raise
    except msgspec.ValidationError as exc:
        raise UntrustedDocumentError(INVALID, f"{what}: {exc}"[:300]) from None
    except msgspec.DecodeError as exc:
        raise UntrustedDocumentError(INVALID, f"{what}: not JSON: {exc}"[:300]) from None
    except Exception as exc:  # RecursionError, MemoryError, UnicodeDecodeError, ...
        raise UntrustedDocumentError(ERROR, f"{what}: {type(exc).__name__}: {exc}"[:300]) from None


def toml_typed(
    raw: bytes | str, type_: type[T], *, max_bytes: int = MAX_BYTES, what: str = "document"
) -> T:
    """``raw`` TOML converted to ``type_`` as ``msgspec.toml.decode`` would (dates kept,
    string keys), or :class:`UntrustedDocumentError`."""
    tree = toml_document(raw, max_bytes=max_bytes, what=what)
    try:
        return msgspec.convert(tree, type_, str_keys=True, builtin_types=_TOML_BUILTINS)
    except msgspec.ValidationError as exc:
        raise UntrustedDocumentError(INVALID, f"{what}: {exc}"[:300]) from None
    except Exception as exc:  # RecursionError (a deep array under the parser's limit), ...
        raise UntrustedDocumentError(ERROR, f"{what}: {type(exc).__name__}: {exc}"[:300]) from None


def toml_document(
    raw: bytes | str, *, max_bytes: int = MAX_BYTES, what: str = "document"
) -> dict[str, Any]:
    """``raw`` TOML as a dict, or :class:`UntrustedDocumentError`."""
    _bounded_size(raw, max_bytes, what)
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UntrustedDocumentError(INVALID, f"{what}: not TOML: {exc}"[:300]) from None
    except RecursionError:
        raise UntrustedDocumentError(TOO_DEEP, f"{what}: nested too deep") from None
    except Exception as exc:  # UnicodeDecodeError, MemoryError, ...
        raise UntrustedDocumentError(ERROR, f"{what}: {type(exc).__name__}: {exc}"[:300]) from None


def yaml_document(
    raw: bytes | str,
    *,
    max_bytes: int = MAX_BYTES,
    max_depth: int = MAX_DEPTH,
    what: str = "document",
) -> Any:
    """``raw`` YAML (one document, safe tags only, no aliases, at most ``max_depth``
    levels) as Python objects, or :class:`UntrustedDocumentError`. Imports PyYAML."""
    _bounded_size(raw, max_bytes, what)
    try:
        return _load_yaml(raw, max_depth)
    except UntrustedDocumentError as exc:
        exc.args = (f"{what}: {exc.detail}",)
        exc.detail = exc.args[0]
        raise
    except RecursionError:
        raise UntrustedDocumentError(TOO_DEEP, f"{what}: nested too deep") from None
    except Exception as exc:  # yaml.YAMLError, MemoryError, ...
        raise UntrustedDocumentError(INVALID, f"{what}: not YAML: {exc}"[:300]) from None


def _load_yaml(raw: bytes | str, max_depth: int) -> Any:
    import yaml  # only the readers of YAML pay for it

    # The pure-Python loader: the C one composes nodes in C, past this hook.
    class _Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                raise UntrustedDocumentError(ALIASES, "YAML aliases are not accepted")
            self.depth += 1
            try:
                if self.depth > max_depth:
                    raise UntrustedDocumentError(
                        TOO_DEEP, f"nesting deeper than {max_depth} levels"
                    )
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    loader = _Loader(raw)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
