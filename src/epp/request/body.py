"""The request body as routing reads it: one msgspec struct of the fields it uses, the
others validated as JSON and skipped, and the refusals of a body that is not JSON."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from epp.request.types import RequestRejected, bad

NESTED_TOO_DEEPLY = "the body is nested too deeply to parse"


# Only the fields routing reads become Python objects; every other field is validated as
# JSON and skipped. Raw fields (the prompt, the messages, the template's extras) are
# decoded later by typed decoders, so that the type and range checks of every element
# happen in C and each error names its parameter; absent, they are never decoded.
class Body(msgspec.Struct, gc=False):
    model: Any = None
    cache_salt: Any = None
    stream: Any = msgspec.UNSET
    prompt: msgspec.Raw = msgspec.Raw()
    messages: msgspec.Raw = msgspec.Raw()
    # What a chat template reads besides the messages.
    tools: msgspec.Raw = msgspec.Raw()
    chat_template_kwargs: msgspec.Raw = msgspec.Raw()
    documents: msgspec.Raw = msgspec.Raw()
    add_generation_prompt: Any = msgspec.UNSET
    continue_final_message: Any = msgspec.UNSET
    add_special_tokens: Any = msgspec.UNSET
    reasoning_effort: Any = None
    # Anthropic /v1/messages
    system: msgspec.Raw = msgspec.Raw()
    thinking: msgspec.Raw = msgspec.Raw()
    output_config: msgspec.Raw = msgspec.Raw()


_BODY = msgspec.json.Decoder(Body)
ANY = msgspec.json.Decoder()  # a raw field already validated as JSON, decoded as it is
# A JSON escape of a UTF-16 surrogate (\ud800-\udfff) is legal only as a high-low pair.
_UNPAIRED_SURROGATE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)


def is_null(raw: msgspec.Raw) -> bool:
    """The field is absent or JSON null."""
    return len(raw) == 0 or (len(raw) == 4 and bytes(raw) == b"null")


def decode_body(body: bytes | bytearray | memoryview) -> Body:
    """The body's fields, or a 400: not an object, not JSON, or nested too deeply."""
    try:
        return _BODY.decode(body)
    except msgspec.ValidationError as exc:
        if str(exc).startswith("Expected `object`"):
            raise bad("the body must be a JSON object") from None
        raise invalid_json(body, exc) from None  # e.g. a number out of range (1e999)
    except msgspec.DecodeError as exc:
        raise invalid_json(body, exc) from None
    except RecursionError:
        raise bad(NESTED_TOO_DEEPLY, reason="invalid-json") from None


def invalid_json(body: bytes | bytearray | memoryview, exc: Exception) -> RequestRejected:
    message = f"the body is not valid JSON: {exc}"
    if _UNPAIRED_SURROGATE.search(body):
        # msgspec reports a lone high surrogate as "truncated": name the real cause.
        message += (
            " (strings must be valid Unicode: an unpaired UTF-16 surrogate escape such as"
            " \\ud800 is not allowed)"
        )
    return bad(message, reason="invalid-json")


def with_model(body: bytes, model: str) -> bytes:
    """The body with its top-level `model` replaced: a request served as another model (an
    InferenceModel's target). Called only on a body `parse_request` accepted, so it is a
    JSON object; every other field passes through unchanged in value."""
    decoded = msgspec.json.decode(body)
    if not isinstance(decoded, dict):
        raise bad("the request body must be a JSON object")
    decoded["model"] = model
    return msgspec.json.encode(decoded)
