"""OpenAI and Anthropic request bodies -> the few facts the scheduler needs.

Only what routing uses is extracted: model (and the LoRA adapter it names), the prompt
(completion text, token ids, or chat messages with what the chat template also reads:
tools, chat_template_kwargs, add_generation_prompt, ...), stream and cache_salt.
Anthropic `/v1/messages` bodies become the same chat prompt, converted as vLLM converts
them (`epp.conversation`). Everything else in the body is passed to the pod untouched.
Malformed input raises `RequestRejected` carrying the HTTP status and an OpenAI-style
message; it never raises anything else.

Modules, by job: `types` (what parsing hands the router), `body` (the fields routing
reads, JSON errors), `parse` (`parse_request`), `completions` (the completion prompt
forms), `chat` (OpenAI turns), `anthropic` (Anthropic turns), `options` (what the chat
template reads besides the turns), `parts` (content parts and their sizes, media
undecoded) and `heads` (the bounded head of a long conversation).
"""

from epp.request.body import with_model
from epp.request.parse import parse_request
from epp.request.types import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    DEFAULT_MAX_PROMPT_TOKENS,
    MESSAGES_PATH,
    IncomingRequest,
    InferenceRequest,
    Prompt,
    RequestKind,
    RequestRejected,
    kind_of,
)

__all__ = [
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "DEFAULT_MAX_PROMPT_TOKENS",
    "MESSAGES_PATH",
    "IncomingRequest",
    "InferenceRequest",
    "Prompt",
    "RequestKind",
    "RequestRejected",
    "kind_of",
    "parse_request",
    "with_model",
]
