"""Which base model and LoRA adapter a request's `model` names.

In order: the configured `adapters:` map (adapter -> base model); a base model some pod
serves; an adapter some pod reported (running or waiting, `vllm:lora_requests_info`),
served on those pods' base model. A name nobody knows stays a base-model request, and
the model filter answers 404 unless a pod of unknown model could still serve it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from epp.datalayer.endpoint import Endpoint


def resolve_model(
    model: str | None, configured: Mapping[str, str], endpoints: Iterable[Endpoint]
) -> tuple[str | None, str | None]:
    """(base model, adapter) for a requested model name."""
    if model is None:
        return None, None
    base = configured.get(model)
    if base is not None:
        return base, model
    reported_on: str | None = None
    for endpoint in endpoints:
        if endpoint.model == model:
            return model, None
        if reported_on is None and model in endpoint.adapters and endpoint.model:
            reported_on = endpoint.model
    if reported_on is not None:
        return reported_on, model
    return model, None
