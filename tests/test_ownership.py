"""One writer per piece of state: every field of an Endpoint is assigned by the one module
that `FIELD_OWNERS` (datalayer/endpoint.py) names for it, and by no other module in
src/epp. Every field has a declared owner; the store's write methods are called by the
components named below.

The check reads the source (ast), so it needs to know which objects are Endpoints without
running mypy. It is conservative: a write to an attribute named like an Endpoint field
counts as an Endpoint write unless the object's type is known and is not an Endpoint
(`self` in another class, a parameter or variable annotated or constructed as another
type, an attribute whose declared types in src/epp are all other types). What it cannot
tell apart is listed in NOT_ENDPOINTS, by hand, with the type it is.

Writes it sees: `e.f = v`, `e.f += v`, `del e.f`, `setattr(e, "f", v)`; writes into a
field's value: `e.f[k] = v`, `del e.f[k]`, `e.f.x = v`, `e.f.append(...)` and the other
mutating methods, also through a local alias (`peer = e.peer; peer.popleft()`); and
`Endpoint(...)`, which sets every field. It does not follow a field's value passed to a
function that mutates it.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from epp.datalayer.endpoint import FIELD_OWNERS, Endpoint

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = SRC / "epp"
FIELDS = frozenset(f.name for f in dataclasses.fields(Endpoint))
# Constructing an Endpoint sets every field: only the owner of its identity does it.
CONSTRUCTOR_OWNER = FIELD_OWNERS["name"]

# Callers allowed for the store's write methods, by receiver `store` / `_store`.
ACCOUNTING = ("epp.routing.accounting",)
STORE_CALLERS: dict[str, tuple[str, ...]] = {
    "dispatched": ACCOUNTING,  # a reservation
    "completed": ACCOUNTING,  # its end
    "record_status": ACCOUNTING,  # a response from a pod that was not the reserved one
    "peer_dispatched": ("epp.replicas.inbox",),  # a peer replica's reservation
    "scraped": ("epp.datalayer.scraper",),
    "scrape_failed": ("epp.datalayer.scraper",),
}

# (module, object as written, attribute) -> what the object is instead of an Endpoint.
NOT_ENDPOINTS: dict[tuple[str, str, str], str] = {
    ("epp.scheduling.registry", "scorer", "name"): "a Scorer built by its factory",
}

MUTATORS = frozenset(
    {
        "append",
        "appendleft",
        "extend",
        "extendleft",
        "insert",
        "pop",
        "popleft",
        "popitem",
        "clear",
        "add",
        "discard",
        "remove",
        "update",
        "setdefault",
        "sort",
        "reverse",
        "rotate",
        "difference_update",
        "intersection_update",
        "symmetric_difference_update",
        "__setitem__",
        "__delitem__",
    }
)
NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
# Fields whose value is mutable: a local alias of one mutates the Endpoint's.
MUTABLE = frozenset(
    f.name for f in dataclasses.fields(Endpoint) if f.default_factory is not dataclasses.MISSING
) | {"metrics"}
ANY = frozenset({"Any", "typing.Any", "object"})  # annotations that may be an Endpoint
ENDPOINT_TYPE = re.compile(r"\bEndpoint\b")
UNKNOWN = None  # a type the check cannot tell: treated as possibly an Endpoint


@dataclass(frozen=True)
class Write:
    module: str
    line: int
    field: str  # an Endpoint field, or "Endpoint(...)"
    target: str  # the statement's target as written

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: {self.target}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _call_class(value: ast.expr) -> str | None:
    """`Foo(...)` -> "Foo" (a capitalised name: a constructor)."""
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else None
        if isinstance(func, ast.Attribute):
            name = func.attr
        if name and name[0].isupper():
            return name
    return None


def _value_type(value: ast.expr, params: dict[str, str]) -> str | None:
    """The type of a value assigned to an attribute, where it is plain: a constructor, an
    annotated parameter, `param or Default()`."""
    if isinstance(value, ast.Name):
        return params.get(value.id)
    if isinstance(value, ast.BoolOp):
        types = {_value_type(v, params) for v in value.values}
        return None if None in types else " | ".join(sorted(t for t in types if t))
    return _call_class(value)


AttrTypes = dict[str, set[str | None]]  # attribute -> declared types (None: not plain)


def attribute_types(trees: list[ast.Module]) -> tuple[dict[str, AttrTypes], AttrTypes]:
    """Declared types of the attributes of every class in the package: per class, and per
    attribute name across all classes."""
    by_class: dict[str, AttrTypes] = {}
    for tree in trees:
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            types = by_class.setdefault(cls.name, {})
            for stmt in cls.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    types.setdefault(stmt.target.id, set()).add(ast.unparse(stmt.annotation))
            for func in cls.body:
                if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                params = {
                    a.arg: ast.unparse(a.annotation)
                    for a in [*func.args.args, *func.args.kwonlyargs]
                    if a.annotation is not None
                }
                for node in ast.walk(func):
                    if isinstance(node, ast.AnnAssign):
                        targets, type_ = [node.target], ast.unparse(node.annotation)
                    elif isinstance(node, ast.Assign):
                        targets, type_ = node.targets, _value_type(node.value, params)
                    else:
                        continue
                    for target in targets:
                        if (
                            isinstance(target, ast.Attribute)
                            and isinstance(target.value, ast.Name)
                            and target.value.id == "self"
                        ):
                            types.setdefault(target.attr, set()).add(type_)
    by_name: AttrTypes = {}
    for types in by_class.values():
        for attr, found in types.items():
            by_name.setdefault(attr, set()).update(found)
    return by_class, by_name


class Scope:
    """Types of the names bound in one function (or module), and aliases of fields."""

    def __init__(self, parent: Scope | None) -> None:
        self.parent = parent
        self.types: dict[str, set[str | None]] = {}
        self.aliases: dict[str, str] = {}  # local name -> the Endpoint field it holds

    def bind(self, name: str, type_: str | None) -> None:
        self.types.setdefault(name, set()).add(type_)

    def type_of(self, name: str) -> str | None:
        scope: Scope | None = self
        while scope is not None:
            if name in scope.types:
                found = scope.types[name]
                return next(iter(found)) if len(found) == 1 else UNKNOWN
            scope = scope.parent
        return UNKNOWN


class WriteFinder:
    def __init__(self, module: str, attr_types: tuple[dict[str, AttrTypes], AttrTypes]) -> None:
        self.module = module
        self.by_class, self.by_name = attr_types
        self.writes: list[Write] = []

    # -- types -------------------------------------------------------------------
    def type_of(self, expr: ast.expr, scope: Scope) -> str | None:
        if isinstance(expr, ast.Name):
            return scope.type_of(expr.id)
        if isinstance(expr, ast.Attribute):
            owner = self.type_of(expr.value, scope)
            declared = self.by_class.get(owner or "", {}).get(expr.attr)
            if declared is None:  # an unknown object's: any class's attribute of that name
                declared = self.by_name.get(expr.attr)
            if not declared or None in declared:
                return UNKNOWN
            return " | ".join(sorted(t for t in declared if t is not None))
        return _call_class(expr)

    def may_be_endpoint(self, expr: ast.expr, scope: Scope, attr: str) -> bool:
        if (self.module, ast.unparse(expr), attr) in NOT_ENDPOINTS:
            return False
        type_ = self.type_of(expr, scope)
        return type_ is UNKNOWN or type_ in ANY or bool(ENDPOINT_TYPE.search(type_))

    def endpoint_field(self, expr: ast.expr, scope: Scope) -> str | None:
        """The Endpoint field whose value `expr` is, or is inside of (`e.f`, `e.f[k]`,
        `e.f.x`, an alias of `e.f`)."""
        while True:
            if isinstance(expr, ast.Attribute):
                if expr.attr in FIELDS and self.may_be_endpoint(expr.value, scope, expr.attr):
                    return expr.attr
                expr = expr.value
            elif isinstance(expr, ast.Subscript):
                expr = expr.value
            elif isinstance(expr, ast.Name):
                return scope.aliases.get(expr.id)
            else:
                return None

    # -- walking -----------------------------------------------------------------
    def run(self, tree: ast.Module) -> list[Write]:
        scope = Scope(None)
        self.bind_all(tree.body, scope, cls=None)
        self.visit_body(tree.body, scope, cls=None)
        return self.writes

    def bind_all(self, body: list[ast.stmt], scope: Scope, cls: str | None) -> None:
        """Types of the names this body binds (nested functions and classes excluded)."""
        for node in self.own_nodes(body):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                scope.bind(node.target.id, ast.unparse(node.annotation))
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    for name in self.names(target):
                        scope.bind(name, _call_class(node.value))
                if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    field = self.endpoint_field(node.value, scope)
                    if field in MUTABLE and isinstance(node.value, ast.Attribute):
                        scope.aliases[node.targets[0].id] = field
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                for name in self.names(node.target):
                    scope.bind(name, UNKNOWN)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    if item.optional_vars is not None:
                        for name in self.names(item.optional_vars):
                            scope.bind(name, UNKNOWN)
            elif isinstance(node, ast.NamedExpr):
                scope.bind(node.target.id, _call_class(node.value))
            elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                scope.bind(node.target.id, UNKNOWN)

    @staticmethod
    def names(target: ast.expr) -> Iterator[str]:
        if isinstance(target, ast.Name):
            yield target.id
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                yield from WriteFinder.names(element)
        elif isinstance(target, ast.Starred):
            yield from WriteFinder.names(target.value)

    @staticmethod
    def own_nodes(body: list[ast.stmt]) -> Iterator[ast.AST]:
        """Every node of `body`, not descending into the functions and classes it defines
        (those are yielded: they have scopes of their own)."""
        stack: list[ast.AST] = list(reversed(body))
        while stack:
            node = stack.pop()
            yield node
            if not isinstance(node, NESTED):
                stack.extend(reversed(list(ast.iter_child_nodes(node))))

    def visit_body(self, body: list[ast.stmt], scope: Scope, cls: str | None) -> None:
        for node in self.own_nodes(body):
            if isinstance(node, NESTED):
                self.visit_nested(node, scope, cls)
            else:
                self.check(node, scope)

    def visit_nested(self, node: ast.AST, scope: Scope, cls: str | None) -> None:
        """A class body (`self` in its methods is that class) or a function."""
        if isinstance(node, ast.ClassDef):
            inner = Scope(scope)
            self.bind_all(node.body, inner, cls=node.name)
            self.visit_body(node.body, inner, cls=node.name)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner = Scope(scope)
            args = node.args
            params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
            params += [a for a in (args.vararg, args.kwarg) if a is not None]
            for i, arg in enumerate(params):
                if arg.annotation is not None:
                    inner.bind(arg.arg, ast.unparse(arg.annotation))
                elif i == 0 and cls is not None:
                    inner.bind(arg.arg, cls)  # self / cls
                else:
                    inner.bind(arg.arg, UNKNOWN)
            self.bind_all(node.body, inner, cls=None)
            self.visit_body(node.body, inner, cls=cls)

    def check(self, node: ast.AST, scope: Scope) -> None:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            targets = [node.target]
        for target in targets:
            for element in ast.walk(target):
                if isinstance(element, (ast.Attribute, ast.Subscript)) and isinstance(
                    element.ctx, (ast.Store, ast.Del)
                ):
                    self.found(element, self.endpoint_field(element, scope), node)
            if isinstance(node, ast.AugAssign) and isinstance(target, ast.Name):
                self.found(target, scope.aliases.get(target.id), node)  # peer += ... in place
        if isinstance(node, ast.Call):
            self.check_call(node, scope)

    def check_call(self, node: ast.Call, scope: Scope) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in MUTATORS:
            self.found(func, self.endpoint_field(func.value, scope), node)
        name = func.id if isinstance(func, ast.Name) else None
        if isinstance(func, ast.Attribute) and func.attr == "__setattr__":
            name = "setattr"
        if name in ("setattr", "delattr") and len(node.args) >= 2:
            obj, attr = node.args[0], node.args[1]
            if (
                isinstance(attr, ast.Constant)
                and attr.value in FIELDS
                and self.may_be_endpoint(obj, scope, str(attr.value))
            ):
                self.found(func, str(attr.value), node)
        if name == "Endpoint" or (isinstance(func, ast.Attribute) and func.attr == "Endpoint"):
            self.found(func, "Endpoint(...)", node)

    def found(self, at: ast.AST, field: str | None, node: ast.AST) -> None:
        if field is not None:
            line = getattr(at, "lineno", getattr(node, "lineno", 0))
            text = ast.unparse(node).splitlines()[0] if isinstance(node, ast.stmt) else ""
            self.writes.append(Write(self.module, line, field, text or ast.unparse(at)))


def package_trees() -> dict[str, ast.Module]:
    return {
        module_name(path): ast.parse(path.read_text(), filename=str(path))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def endpoint_writes(sources: dict[str, ast.Module]) -> list[Write]:
    attr_types = attribute_types(list(sources.values()))
    writes = []
    for module, tree in sources.items():
        writes += WriteFinder(module, attr_types).run(tree)
    return writes


def stray(writes: list[Write]) -> list[str]:
    """Writes by a module that does not own the field, as readable lines."""
    out = []
    for write in writes:
        owner = CONSTRUCTOR_OWNER if write.field == "Endpoint(...)" else FIELD_OWNERS[write.field]
        if write.module != owner:
            out.append(
                f"{write} writes Endpoint.{write.field}, owned by {owner}: call the owner"
                " (Endpoint's docstring), or, if this object is no Endpoint, say what it"
                " is in NOT_ENDPOINTS"
            )
    return out


def store_calls(sources: dict[str, ast.Module]) -> list[tuple[str, int, str]]:
    """(module, line, method) of every call of a store write method (`store.m(...)`,
    `self._store.m(...)`)."""
    calls = []
    for module, tree in sources.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            receiver = node.func.value
            name = receiver.attr if isinstance(receiver, ast.Attribute) else None
            if isinstance(receiver, ast.Name):
                name = receiver.id
            if name in ("store", "_store") and node.func.attr in STORE_CALLERS:
                calls.append((module, node.lineno, node.func.attr))
    return calls


# -- the rules, over src/epp ----------------------------------------------------------


def test_every_endpoint_field_has_exactly_one_declared_owner() -> None:
    assert sorted(FIELDS - FIELD_OWNERS.keys()) == [], "fields without an owner"
    assert sorted(FIELD_OWNERS.keys() - FIELDS) == [], "owners of fields that do not exist"
    modules = package_trees().keys()
    assert {owner for owner in FIELD_OWNERS.values() if owner not in modules} == set()


def test_the_docstring_table_names_every_field() -> None:
    table = Endpoint.__doc__ or ""
    assert sorted(f for f in FIELDS if not re.search(rf"\b{f}\b", table)) == []


def test_only_the_owner_module_writes_an_endpoint_field() -> None:
    sources = package_trees()
    writes = endpoint_writes(sources)
    assert stray(writes) == []
    # The check sees the owners' own writes: it is looking at the right objects.
    seen = {(w.module, w.field) for w in writes}
    assert ("epp.datalayer.ledger", "in_flight") in seen
    assert ("epp.datalayer.store", "metrics") in seen
    assert ("epp.datalayer.health", "excluded") in seen
    assert ("epp.datalayer.endpoint", "load") in seen


def test_the_store_is_written_through_by_its_named_callers_only() -> None:
    wrong = [
        f"{module}:{line} calls store.{method}, which only {STORE_CALLERS[method]} may call"
        for module, line, method in store_calls(package_trees())
        if module not in STORE_CALLERS[method]
    ]
    assert wrong == []


# -- the check itself, on small sources -----------------------------------------------

STRAY = """
from epp.datalayer.endpoint import Endpoint

def reserve(endpoint: Endpoint) -> None:
    endpoint.in_flight += 1

def untyped(e):
    e.health = 0.0

def each(pods):
    for e in pods:
        e.excluded = True

def containers(endpoint: Endpoint, d) -> None:
    endpoint.open[1] = d
    del endpoint.adapters_seen["a"]
    endpoint.peer.append(d)
    endpoint.unconfirmed_failures.clear()
    endpoint.metrics.running = 3.0

def aliased(endpoint: Endpoint) -> None:
    peer = endpoint.peer
    peer.popleft()

def dynamic(endpoint: Endpoint) -> None:
    setattr(endpoint, "load", 1.0)

def through_an_event(event) -> None:
    event.endpoint.panic = True

def anything(x: Any) -> None:
    x.last_error = "?"

def new() -> Endpoint:
    return Endpoint(name="p", address="a:1", metrics_url="u")
"""

NOT_STRAY = """
from epp.config import EndpointConfig
from epp.datalayer.metrics_parser import PodMetrics

class Gate:
    open: bool = True

class Holder:
    def __init__(self) -> None:
        self.gate = Gate()
        self.name = "mine"
        self.health = 1.0

    def close(self) -> None:
        self.gate.open = False

def page() -> PodMetrics:
    result = PodMetrics()
    result.model = "m"
    return result

def config(c: EndpointConfig) -> None:
    c.labels = {}
"""


def writes_in(source: str, module: str = "epp.scheduling.elsewhere") -> list[tuple[int, str]]:
    sources = {module: ast.parse(textwrap.dedent(source))}
    return [(w.line, w.field) for w in endpoint_writes(sources)]


def test_the_check_sees_every_form_of_write() -> None:
    found = writes_in(STRAY)
    assert sorted({field for _, field in found}) == sorted(
        {
            "in_flight",
            "health",
            "excluded",
            "open",
            "adapters_seen",
            "peer",
            "unconfirmed_failures",
            "metrics",
            "load",
            "panic",
            "last_error",
            "Endpoint(...)",
        }
    )
    assert (23, "peer") in found  # through the alias
    assert len(stray(endpoint_writes({"epp.elsewhere": ast.parse(STRAY)}))) == len(found)


def test_the_check_leaves_other_types_alone() -> None:
    assert writes_in(NOT_STRAY) == []


def test_a_stray_write_in_a_real_module_fails_the_rule() -> None:
    path = PACKAGE / "replicas" / "inbox.py"
    source = (
        path.read_text()
        + "\n\ndef _stray(endpoint: Endpoint) -> None:\n    endpoint.in_flight = 0\n"
    )
    sources = package_trees()
    sources["epp.replicas.inbox"] = ast.parse(source)
    assert [
        line.split(" writes ")[1].split(",")[0] for line in stray(endpoint_writes(sources))
    ] == ["Endpoint.in_flight"]
