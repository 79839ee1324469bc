"""InferenceModel and InferenceObjective objects -> the model table. Pure: no I/O.

Both are `inference.networking.x-k8s.io/v1alpha2` and read only when their CRD is
installed; only objects whose `spec.poolRef.name` is our pool count.

- **InferenceModel** (`spec.modelName`, `spec.criticality`, `spec.targetModels[{name,
  weight}]`, `spec.poolRef`): requests for `modelName` are served as one of the target
  models, chosen by weight (e.g. a traffic split between two LoRA adapter versions); no
  targets means `modelName` itself. Criticality becomes a priority: Critical 1,
  Standard 0, Sheddable -1 (sheddable = priority < 0, as in flow control). Two objects
  claiming one modelName: the oldest (creationTimestamp, then name) wins, as in the
  reference implementation.
- **InferenceObjective** (`spec.priority` int, default 0; `spec.poolRef`): a request
  names its objective in the `x-gateway-inference-objective` header (the object's
  name). Clients can send any header: the gateway must strip it from untrusted traffic.
  An interim version of the object also carried `modelName`/`criticality`; such an
  object also gives that model a priority unless an InferenceModel already does.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

OBJECTIVE_HEADER = "x-gateway-inference-objective"
CRITICALITY_PRIORITY: Mapping[str, int] = {"Critical": 1, "Standard": 0, "Sheddable": -1}

Obj = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class TargetModel:
    name: str
    weight: int


@dataclass(frozen=True, slots=True)
class ModelRoute:
    model: str  # the name clients send
    targets: tuple[TargetModel, ...]  # () = serve `model` as named
    priority: int | None  # None: the configured default
    source: str  # "InferenceModel/<name>", for logs

    def pick(self, u: float) -> str:
        """The target for a uniform draw u in [0, 1): by weight (all-zero weights: equal)."""
        if not self.targets:
            return self.model
        weights = [t.weight for t in self.targets]
        if sum(weights) <= 0:
            weights = [1] * len(weights)
        bounds = list(accumulate(weights))
        index = bisect.bisect_right(bounds, min(max(u, 0.0), 1.0) * bounds[-1])
        return self.targets[min(index, len(self.targets) - 1)].name


@dataclass(frozen=True, slots=True)
class ModelTable:
    models: Mapping[str, ModelRoute] = field(default_factory=dict)
    objectives: Mapping[str, int] = field(default_factory=dict)  # objective name -> priority
    problems: tuple[str, ...] = ()  # objects skipped, and why (logged by the caller)

    def target(self, model: str, u: float) -> str:
        """The model name to serve a request for `model` with (itself when not listed)."""
        route = self.models.get(model)
        return route.pick(u) if route is not None else model

    def priority(self, model: str | None, headers: Mapping[str, str]) -> int | None:
        """The objective named in the header, else the model's criticality; None: unknown."""
        objective = headers.get(OBJECTIVE_HEADER)
        if objective is not None and objective in self.objectives:
            return self.objectives[objective]
        route = self.models.get(model) if model is not None else None
        return route.priority if route is not None else None

    def priorities(self) -> dict[str, int]:
        """model -> priority, the shape of `flow_control.priorities`."""
        return {m: r.priority for m, r in self.models.items() if r.priority is not None}


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _refers_to(spec: Obj, pool_name: str) -> bool:
    ref = _mapping(spec.get("poolRef"))
    kind = ref.get("kind", "InferencePool")
    return ref.get("name") == pool_name and kind in ("InferencePool", "", None)


def _age_key(obj: Obj) -> tuple[str, str]:
    metadata = _mapping(obj.get("metadata"))
    # RFC 3339 UTC timestamps ("2026-01-02T03:04:05Z") sort as strings.
    return str(metadata.get("creationTimestamp") or "~"), str(metadata.get("name") or "")


def _criticality(spec: Obj, source: str, problems: list[str]) -> int | None:
    value = spec.get("criticality")
    if value is None:
        return None
    if value not in CRITICALITY_PRIORITY:
        problems.append(f"{source}: unknown criticality {value!r}, using the default priority")
        return None
    return CRITICALITY_PRIORITY[value]


def _targets(spec: Obj, source: str, problems: list[str]) -> tuple[TargetModel, ...] | None:
    raw = spec.get("targetModels") or []
    if not isinstance(raw, list):
        problems.append(f"{source}: targetModels must be a list")
        return None
    targets: list[TargetModel] = []
    for entry in raw:
        entry = _mapping(entry)
        name = entry.get("name")
        weight = entry.get("weight", 1)
        if not isinstance(name, str) or not name:
            problems.append(f"{source}: a target model has no name")
            return None
        if isinstance(weight, bool) or not isinstance(weight, int) or weight < 0:
            problems.append(f"{source}: target {name!r} has a bad weight {weight!r}")
            return None
        targets.append(TargetModel(name, weight))
    return tuple(targets)


def build_model_table(
    inference_models: Iterable[Obj], inference_objectives: Iterable[Obj], pool_name: str
) -> ModelTable:
    problems: list[str] = []
    models: dict[str, ModelRoute] = {}
    for obj in sorted(inference_models, key=_age_key):
        spec = _mapping(obj.get("spec"))
        source = f"InferenceModel/{_age_key(obj)[1]}"
        if not _refers_to(spec, pool_name):
            continue
        model = spec.get("modelName")
        if not isinstance(model, str) or not model:
            problems.append(f"{source}: no spec.modelName")
            continue
        if model in models:
            problems.append(
                f"{source}: modelName {model!r} already served by {models[model].source}"
            )
            continue
        targets = _targets(spec, source, problems)
        if targets is None:
            continue
        models[model] = ModelRoute(model, targets, _criticality(spec, source, problems), source)

    objectives: dict[str, int] = {}
    for obj in sorted(inference_objectives, key=_age_key):
        spec = _mapping(obj.get("spec"))
        name = _age_key(obj)[1]
        source = f"InferenceObjective/{name}"
        if not _refers_to(spec, pool_name) or not name:
            continue
        priority = spec.get("priority", 0)
        if priority is None:
            priority = 0
        if isinstance(priority, bool) or not isinstance(priority, int):
            problems.append(f"{source}: spec.priority must be an integer, got {priority!r}")
            continue
        objectives[name] = priority
        model = spec.get("modelName")
        if isinstance(model, str) and model and model not in models:
            level = priority if "priority" in spec else _criticality(spec, source, problems)
            models[model] = ModelRoute(model, (), level, source)
    return ModelTable(models, objectives, tuple(problems))
