"""InferenceModel, InferenceObjective and InferenceModelRewrite objects -> the model
table. Pure: no I/O.

Read only when their CRD is installed. Which group's InferenceObjective and
InferenceModelRewrite objects are passed in is the caller's choice (`llm-d.ai` when it is
served, else `inference.networking.x-k8s.io`, as the reference EPP chooses). Only
objects whose `spec.poolRef` names our pool count: its `name`, and for objectives and
rewrites its `group` too (default `inference.networking.k8s.io`, the CRDs' default), as
the reference EPP matches them. InferenceModel predates pool groups: its name alone.

- **InferenceModelRewrite** (`spec.rules[{matches[{model{type: Exact, value}}],
  targets[{modelRewrite, weight}]}]`): a request whose `model` a rule matches is served
  as one of the rule's targets, chosen at random by weight, and the body's `model` is
  rewritten to it before Envoy forwards the request. Precedence, as the reference EPP
  (llm-d router v0.10.0, `datastore/modelrewritestore.go`) applies it: a rule naming the
  model exactly beats a generic rule (no `matches`: every model); among equals the oldest
  object (creationTimestamp, then name) wins, and within one object the first rule in
  list order. Weights: targets without a weight are never chosen when another target has
  one; none weighted: equal shares. A rule without targets is skipped (reported).
- **InferenceModel** (`spec.modelName`, `spec.criticality`, `spec.targetModels[{name,
  weight}]`, `spec.poolRef`): requests for `modelName` are served as one of the target
  models, chosen by weight; no targets means `modelName` itself. Criticality becomes a
  priority: Critical 1, Standard 0, Sheddable -1 (sheddable = priority < 0, as in flow
  control). Two objects claiming one modelName: the oldest wins.
- **InferenceObjective** (`spec.priority` int, default 0; `spec.poolRef`): a request
  names its objective in the `x-llm-d-inference-objective` header, or the older
  `x-gateway-inference-objective` (the object's name). Clients can send any header: an
  objective may lower a model's own priority but not raise it (`ModelTable.priority`), and
  the gateway should strip the headers from untrusted traffic (`epp envoy-config` does). An interim version of the object also
  carried `modelName`/`criticality`; such an object also gives that model a priority
  unless an InferenceModel already does.

The model served (`ModelTable.target`): an exact rewrite rule, else an InferenceModel's
targets, else a generic rewrite rule, else the `x-llm-d-model-name-rewrite` (or
`x-gateway-model-name-rewrite`) request header, else the model as the client named it.
The reference EPP takes the header first and lets any rewrite rule override it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

OBJECTIVE_HEADER = "x-llm-d-inference-objective"
OLD_OBJECTIVE_HEADER = "x-gateway-inference-objective"
OBJECTIVE_HEADERS = (OBJECTIVE_HEADER, OLD_OBJECTIVE_HEADER)  # the first one present wins
MODEL_REWRITE_HEADERS = ("x-llm-d-model-name-rewrite", "x-gateway-model-name-rewrite")
DEFAULT_POOL_GROUP = "inference.networking.k8s.io"  # poolRef.group's default in the CRDs
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
class RewriteRule:
    """One InferenceModelRewrite rule: weighted targets (weight 0: unweighted)."""

    targets: tuple[TargetModel, ...]  # never empty
    source: str  # "InferenceModelRewrite/<name>#<rule index>", for logs and metrics

    def pick(self, u: float) -> str:
        return ModelRoute("", self.targets, None, self.source).pick(u)


def _header(headers: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    for name in names:
        value = headers.get(name)
        if value:
            return value
    return None


@dataclass(frozen=True, slots=True)
class ModelTable:
    models: Mapping[str, ModelRoute] = field(default_factory=dict)
    objectives: Mapping[str, int] = field(default_factory=dict)  # objective name -> priority
    problems: tuple[str, ...] = ()  # objects skipped, and why (logged by the caller)
    rewrites: Mapping[str, RewriteRule] = field(default_factory=dict)  # exact model -> rule
    generic_rewrite: RewriteRule | None = None  # the rule for every other model

    def rule(self, model: str) -> RewriteRule | ModelRoute | None:
        """What decides the model served for `model`, by precedence; None: nothing."""
        exact = self.rewrites.get(model)
        if exact is not None:
            return exact
        route = self.models.get(model)
        if route is not None and route.targets:
            return route
        return self.generic_rewrite

    def target(self, model: str, u: float, headers: Mapping[str, str] | None = None) -> str:
        """The model name to serve a request for `model` with, for a uniform draw u in
        [0, 1): a rewrite rule or an InferenceModel's targets, else the rewrite header,
        else `model` itself."""
        rule = self.rule(model)
        if rule is not None:
            return rule.pick(u)
        if headers:
            return _header(headers, MODEL_REWRITE_HEADERS) or model
        return model

    def priority(
        self,
        model: str | None,
        headers: Mapping[str, str],
        *,
        own: int | None = None,
        may_raise: bool = False,
    ) -> int | None:
        """The objective named in the header, else the model's criticality; None: unknown.

        The client names its objective, so an objective may lower the model's own priority
        (its InferenceModel criticality, else `own`: flow_control.priorities) but never
        raise it, unless `may_raise` (flow_control.objective_may_raise). A model without a
        priority of its own takes the objective's, as the reference EPP does (there,
        objectives are the only priorities)."""
        route = self.models.get(model) if model is not None else None
        if route is not None and route.priority is not None:
            own = route.priority
        objective = _header(headers, OBJECTIVE_HEADERS)
        if objective is not None and objective in self.objectives:
            wanted = self.objectives[objective]
            return wanted if own is None or may_raise else min(wanted, own)
        return route.priority if route is not None else None

    def priorities(self) -> dict[str, int]:
        """model -> priority, the shape of `flow_control.priorities`."""
        return {m: r.priority for m, r in self.models.items() if r.priority is not None}


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _refers_to(spec: Obj, pool_name: str, pool_group: str | None = None) -> bool:
    """spec.poolRef names our pool; with `pool_group`, its group (defaulted) must match."""
    ref = _mapping(spec.get("poolRef"))
    kind = ref.get("kind", "InferencePool")
    if ref.get("name") != pool_name or kind not in ("InferencePool", "", None):
        return False
    return pool_group is None or (ref.get("group") or DEFAULT_POOL_GROUP) == pool_group


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


def _rewrite_targets(raw: Any, source: str, problems: list[str]) -> tuple[TargetModel, ...]:
    targets: list[TargetModel] = []
    for entry in raw if isinstance(raw, list) else ():
        entry = _mapping(entry)
        name = entry.get("modelRewrite")
        weight = entry.get("weight")
        if not isinstance(name, str) or not name:
            problems.append(f"{source}: a target has no modelRewrite; rule skipped")
            return ()
        if weight is None:
            weight = 0  # unweighted: chosen only when no target has a weight
        elif isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
            problems.append(f"{source}: target {name!r} has a bad weight {weight!r}; rule skipped")
            return ()
        targets.append(TargetModel(name, weight))
    if not targets:
        problems.append(f"{source}: no targets; rule skipped")
    return tuple(targets)


def _exact_models(rule: Obj, source: str, problems: list[str]) -> list[str] | None:
    """The model names a rule matches exactly; [] for a generic rule; None: unusable."""
    raw = rule.get("matches") or []
    if not isinstance(raw, list):
        problems.append(f"{source}: matches must be a list; rule skipped")
        return None
    names: list[str] = []
    for match in raw:
        model = _mapping(_mapping(match).get("model"))
        kind = model.get("type") or "Exact"
        value = model.get("value")
        if kind != "Exact" or not isinstance(value, str) or not value:
            problems.append(f"{source}: unsupported match {match!r}; rule skipped")
            return None
        names.append(value)
    return names


def build_rewrites(
    rewrites: Iterable[Obj], pool_name: str, pool_group: str, problems: list[str]
) -> tuple[dict[str, RewriteRule], RewriteRule | None]:
    """InferenceModelRewrite objects -> (exact model -> its rule, the generic rule)."""
    exact: dict[str, RewriteRule] = {}
    generic: RewriteRule | None = None
    for obj in sorted(rewrites, key=_age_key):  # oldest first: the first rule set wins
        spec = _mapping(obj.get("spec"))
        name = _age_key(obj)[1]
        if not _refers_to(spec, pool_name, pool_group):
            continue
        rules = spec.get("rules")
        for index, rule in enumerate(rules if isinstance(rules, list) else ()):
            source = f"InferenceModelRewrite/{name}#{index}"
            models = _exact_models(_mapping(rule), source, problems)
            if models is None:
                continue
            targets = _rewrite_targets(_mapping(rule).get("targets"), source, problems)
            if not targets:
                continue
            parsed = RewriteRule(targets, source)
            if not models:
                generic = generic or parsed
            for model in models:
                exact.setdefault(model, parsed)
    return exact, generic


def build_model_table(
    inference_models: Iterable[Obj],
    inference_objectives: Iterable[Obj],
    pool_name: str,
    *,
    rewrites: Iterable[Obj] = (),
    pool_group: str = DEFAULT_POOL_GROUP,
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
        if not _refers_to(spec, pool_name, pool_group) or not name:
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
    exact, generic = build_rewrites(rewrites, pool_name, pool_group, problems)
    return ModelTable(models, objectives, tuple(problems), exact, generic)
