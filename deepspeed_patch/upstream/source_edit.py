"""Edits of a module's source text that keep the rest byte for byte: the operations the upstream series is
cut with (``series_spec``), each located through the module's syntax tree.

``Cut`` names a part of a package module that a later pull request of the series brings: whole definitions
(``drop``), the statements of one scope whose first line matches a pattern (``statements``), or a text inside
one scope (``replace``). A cut that finds nothing raises ``StaleCut``: the modules changed under it, and the
spec must follow. ``resolve_capabilities`` writes one DeepSpeed release's ``capabilities`` facts in as
constants and folds the conditions they decide; ``drop_unused`` takes out the imports and private functions
nothing uses any more.
"""

import ast
import re
import textwrap
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple, Union

Scope = str  # "" (the module), "name" (a top-level function or class), "Class.method"
COLUMN_LIMIT = 119
"""DeepSpeed's line length (its ``.style.yapf``)."""


class StaleCut(ValueError):
    """A cut of the series spec matches nothing in the module it names."""


@dataclass(frozen=True)
class Cut:
    """A part of ``path`` (relative to the upstream package) that a later pull request brings."""

    path: str
    drop: Tuple[str, ...] = ()
    """Definitions, by name: ``"name"`` (module level: function, class, assignment), ``"Class.member"``."""
    statements: Tuple[Tuple[Scope, str], ...] = ()
    """``(scope, pattern)``: every statement in ``scope`` (at any depth) whose first line matches ``pattern``."""
    replace: Tuple[Tuple[Scope, str, str], ...] = ()
    """``(scope, old, new)``: ``old`` (it must occur) replaced by ``new`` inside ``scope``; for a file that is
    not Python, ``scope`` is ``""``."""
    docstrings: Tuple[Tuple[Scope, str, str], ...] = ()
    """Like ``replace``, for the text of docstrings that name what the pull request brings."""
    rows: Tuple[str, ...] = ()
    """Markdown table rows, by the key in their first cell (the docs section)."""
    unwrap: Tuple[Tuple[Scope, str], ...] = ()
    """``(scope, pattern)``: every ``with`` or ``try`` statement in ``scope`` whose first line matches ``pattern``
    replaced by its body (a guard the pull request brings around code an earlier one has)."""


def _lines(text: str) -> List[str]:
    return text.splitlines(keepends=True)


def _scope_node(tree: ast.Module, scope: Scope, path: str) -> ast.AST:
    node: ast.AST = tree
    for part in filter(None, scope.split(".")):
        found = [child for child in node.body if getattr(child, "name", None) == part]
        if not found:
            raise StaleCut(f"{path}: no {scope!r} (at {part!r})")
        node = found[0]
    return node


def _defined_names(node: ast.stmt) -> Set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    names = set()
    for target in targets:
        for part in ([target] if not isinstance(target, ast.Tuple) else target.elts):
            if isinstance(part, ast.Name):
                names.add(part.id)
    return names


def _span(lines: List[str], body: List[ast.stmt], index: int) -> Tuple[int, int]:
    """``(first, last)`` line indices (0-based, inclusive) of ``body[index]``: its decorators, the comment
    lines right above it, and an attribute docstring right after an assignment."""
    node = body[index]
    first = min([node.lineno] + [dec.lineno for dec in getattr(node, "decorator_list", [])]) - 1
    while first > 0 and lines[first - 1].strip().startswith("#"):
        first -= 1
    last = node.end_lineno - 1
    following = body[index + 1] if index + 1 < len(body) else None
    if (isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str)):
        last = following.end_lineno - 1
    return first, last


def _remove(text: str, spans: Iterable[Tuple[int, int]]) -> str:
    lines = _lines(text)
    for first, last in sorted(set(spans), reverse=True):
        del lines[first:last + 1]
    return "".join(lines)


def _bodies(node: ast.AST) -> Iterable[List[ast.stmt]]:
    """Every statement list under ``node``, itself included."""
    for child in ast.walk(node):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(child, field, None)
            if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
                yield body
        for handler in getattr(child, "handlers", []):
            yield handler.body


def drop_definitions(text: str, names: Iterable[str], path: str) -> str:
    tree, lines, spans = ast.parse(text), _lines(text), []
    for dotted in names:
        scope, _, name = dotted.rpartition(".")
        body = _scope_node(tree, scope, path).body
        found = [index for index, node in enumerate(body) if name in _defined_names(node)]
        if not found:
            raise StaleCut(f"{path}: nothing defines {dotted!r}")
        spans.extend(_span(lines, body, index) for index in found)
    return _remove(text, spans)


def drop_statements(text: str, scope: Scope, pattern: str, path: str) -> str:
    tree, lines = ast.parse(text), _lines(text)
    matcher = re.compile(pattern)
    spans = []
    for body in _bodies(_scope_node(tree, scope, path)):
        for index, node in enumerate(body):
            if matcher.search(lines[node.lineno - 1]):
                spans.append(_span(lines, body, index))
    outermost = [span for span in spans if not any(o[0] <= span[0] and span[1] <= o[1] and o != span for o in spans)]
    if not outermost:
        raise StaleCut(f"{path}: no statement in {scope or 'the module'!r} matches {pattern!r}")
    return _remove(text, outermost)


def unwrap_statements(text: str, scope: Scope, pattern: str, path: str) -> str:
    """``text`` with each ``with`` or ``try`` statement of ``scope`` whose first line matches ``pattern`` replaced by
    its body, one level less indented (a ``try``'s handlers dropped; one with an ``else`` or a ``finally`` refused)."""
    matcher, unwrapped = re.compile(pattern), 0
    while True:
        lines = _lines(text)
        found = [
            node for body in _bodies(_scope_node(ast.parse(text), scope, path)) for node in body
            if isinstance(node, (ast.With, ast.Try)) and matcher.search(lines[node.lineno - 1])
        ]
        if not found:
            break
        node = found[0]
        if isinstance(node, ast.Try) and (node.orelse or node.finalbody):
            raise StaleCut(f"{path}: the try at line {node.lineno} of {scope!r} has an else or a finally to keep")
        dedent = node.body[0].col_offset - node.col_offset
        body = lines[node.body[0].lineno - 1:node.body[-1].end_lineno]
        lines[node.lineno - 1:node.end_lineno] = [line[dedent:] if line.strip() else line for line in body]
        text, unwrapped = "".join(lines), unwrapped + 1
    if not unwrapped:
        raise StaleCut(f"{path}: no with or try statement in {scope or 'the module'!r} matches {pattern!r}")
    return text


def replace_text(text: str, scope: Scope, old: str, new: str, path: str) -> str:
    if path.endswith(".py") and scope:
        node = _scope_node(ast.parse(text), scope, path)
        lines = _lines(text)
        start = sum(len(line) for line in lines[:node.lineno - 1])
        end = sum(len(line) for line in lines[:node.end_lineno])
    else:
        start, end = 0, len(text)
    if old not in text[start:end]:
        raise StaleCut(f"{path}: {old!r} is not in {scope or 'the file'!r}")
    return text[:start] + text[start:end].replace(old, new) + text[end:]


def apply_cut(text: str, cut: Cut) -> str:
    """``text`` (the file ``cut.path``) without what ``cut`` names."""
    for scope, old, new in cut.replace + cut.docstrings:
        text = replace_text(text, scope, old, new, cut.path)
    for scope, pattern in cut.unwrap:
        text = unwrap_statements(text, scope, pattern, cut.path)
    for scope, pattern in cut.statements:
        text = drop_statements(text, scope, pattern, cut.path)
    if cut.drop:
        text = drop_definitions(text, cut.drop, cut.path)
    for key in cut.rows:
        row = re.compile(rf"^\| {re.escape(key)} \|.*\n", re.MULTILINE)
        if not row.search(text):
            raise StaleCut(f"{cut.path}: no table row {key!r}")
        text = row.sub("", text)
    return text


# --- the release's facts as constants -------------------------------------------------------------


def _capability(node: ast.AST, facts: Dict[str, bool]) -> Optional[bool]:
    """The fact ``node`` reads (``<x>.capabilities.<fact>`` or ``capabilities.<fact>``), else ``None``."""
    if isinstance(node, ast.Attribute) and node.attr in facts:
        holder = node.value
        if (isinstance(holder, ast.Attribute) and holder.attr == "capabilities") or (isinstance(holder, ast.Name)
                                                                                     and holder.id == "capabilities"):
            return facts[node.attr]
    return None


def _reads_fact(node: ast.AST, facts: Dict[str, bool]) -> bool:
    """Whether ``node`` reads a ``capabilities`` fact anywhere."""
    return any(_capability(inner, facts) is not None for inner in ast.walk(node))


def _static(node: ast.AST, facts: Dict[str, bool]) -> Optional[bool]:
    """The value of a condition that the facts decide, else ``None``."""
    known = _capability(node, facts)
    if known is not None:
        return known
    if isinstance(node, ast.Constant) and isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        inner = _static(node.operand, facts)
        return None if inner is None else not inner
    if isinstance(node, ast.BoolOp):
        values = [_static(value, facts) for value in node.values]
        absorbing = isinstance(node.op, ast.Or)  # True absorbs an "or", False an "and"
        if absorbing in values:
            return absorbing
        if all(value is not None for value in values):
            return not absorbing
    return None


def _segment(text: str, node: ast.AST) -> str:
    return ast.get_source_segment(text, node)


def _folded(text: str, node: ast.AST, facts: Dict[str, bool]) -> str:
    """The source of expression ``node`` with every decided part folded away."""
    value = _static(node, facts)
    if value is not None:
        return repr(value)
    if isinstance(node, ast.BoolOp):
        keep = [value for value in node.values if _static(value, facts) is None]
        joiner = " and " if isinstance(node.op, ast.And) else " or "
        return joiner.join(_folded(text, value, facts) for value in keep)
    return _segment(text, node)


def _block(lines: List[str], body: List[ast.stmt], indent: int) -> List[str]:
    """The lines of ``body``, re-indented to ``indent`` columns."""
    first, last = body[0].lineno - 1, body[-1].end_lineno - 1
    block = textwrap.dedent("".join(lines[first:last + 1]))
    return [(" " * indent + line) if line.strip() else line for line in _lines(block)]


def _fold_once(text: str, facts: Dict[str, bool]) -> Optional[str]:
    """``text`` with one decided ``if``, or one decided expression, written out; ``None`` when none is left."""
    tree, lines = ast.parse(text), _lines(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _static(node.test, facts) is not None:
            branch = node.body if _static(node.test, facts) else node.orelse
            replacement = _block(lines, branch, node.col_offset) if branch else []
            lines[node.lineno - 1:node.end_lineno] = replacement
            return "".join(lines)
    for node in ast.walk(tree):
        # a decided dict entry (a table of conditions): an entry a fact decides False goes, a literal False stays
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if _static(value, facts) is False and key is not None and _reads_fact(value, facts):
                    start = _offset(lines, key.lineno, key.col_offset)
                    end = _offset(lines, value.end_lineno, value.end_col_offset)
                    rest = text[end:]
                    comma = len(rest) - len(rest.lstrip(" \n,")) if rest.lstrip().startswith(",") else 0
                    return text[:start] + text[end + comma:].lstrip(" ") if comma else text[:start] + text[end:]
        if isinstance(node, ast.expr) and _capability(node, facts) is None and _static(node, facts) is not None:
            if isinstance(node, ast.Constant):
                continue
            return _substitute(text, lines, node, repr(_static(node, facts)))
        if isinstance(node, ast.BoolOp) and any(_static(value, facts) is not None for value in node.values):
            return _substitute(text, lines, node, _folded(text, node, facts))
        if _capability(node, facts) is not None:
            return _substitute(text, lines, node, repr(_capability(node, facts)))
    return None


def _offset(lines: List[str], lineno: int, col: int) -> int:
    return sum(len(line) for line in lines[:lineno - 1]) + len(lines[lineno - 1].encode()[:col].decode())


def _substitute(text: str, lines: List[str], node: ast.AST, new: str) -> str:
    start = _offset(lines, node.lineno, node.col_offset)
    end = _offset(lines, node.end_lineno, node.end_col_offset)
    return text[:start] + new + text[end:]


def resolve_capabilities(text: str, facts: Dict[str, bool]) -> str:
    """``text`` with each ``capabilities`` fact it reads written in and the conditions it decides folded: an
    ``if`` keeps the branch taken, ``x and True`` is ``x``, an entry decided ``False`` of a table of
    conditions goes."""
    while True:
        folded = _fold_once(text, facts)
        if folded is None:
            return text
        text = folded


# --- what nothing uses any more -------------------------------------------------------------------


def _annotations(tree: ast.Module) -> Iterable[ast.AST]:
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            yield node.annotation
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            yield node.returns
        elif isinstance(node, ast.AnnAssign):
            yield node.annotation
        elif isinstance(node, ast.Assign) and any(getattr(target, "id", "") == "__all__" for target in node.targets):
            yield node.value


def _used_names(tree: ast.Module) -> Set[str]:
    """The names read anywhere, string annotations and ``__all__`` included."""
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store)}
    for annotation in _annotations(tree):
        for node in ast.walk(annotation):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                used.update(re.findall(r"[A-Za-z_]\w*", node.value))
    return used


def _body_import_spans(tree: ast.Module, used: Set[str], lines: List[str]) -> Tuple[List[Tuple[int, int]], str]:
    """The imports (anywhere) whose names are all unused, and the text of those partly used."""
    spans, edits = [], []
    for body in _bodies(tree):
        for index, node in enumerate(body):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or getattr(node, "module", None) == "__future__":
                continue
            names = [(alias, (alias.asname or alias.name).split(".")[0]) for alias in node.names]
            kept = [alias for alias, bound in names if bound in used]
            if not kept:
                spans.append(_span(lines, body, index))
            elif len(kept) < len(names):
                edits.append((node, kept))
    return spans, edits


def import_line(node: Union[ast.Import, ast.ImportFrom]) -> str:
    """``node`` written back as one line, its names in parentheses where the line would pass DeepSpeed's column
    limit: yapf then wraps it (a long ``from M import a, b`` without them stays one line)."""
    text = " " * node.col_offset + ast.unparse(node)
    if len(text) <= COLUMN_LIMIT or isinstance(node, ast.Import):
        return text + "\n"
    head, names = text.split(" import ", 1)
    return f"{head} import ({names})\n"


def drop_unused(text: str, exported: Iterable[str] = ()) -> str:
    """``text`` without the imports nothing in it uses and the private module-level functions nothing calls
    (repeated until none is left); ``exported``: names other modules import from it."""
    keep = set(exported)
    while True:
        tree, lines = ast.parse(text), _lines(text)
        used = _used_names(tree) | keep
        spans = [
            _span(lines, tree.body, index) for index, node in enumerate(tree.body)
            if isinstance(node, ast.FunctionDef) and node.name.startswith("_") and node.name not in used
        ]
        import_spans, edits = _body_import_spans(tree, used, lines)
        if edits:
            node, kept = edits[0]
            node.names = kept
            lines[node.lineno - 1:node.end_lineno] = [import_line(node)]
            text = "".join(lines)
            continue
        if not spans and not import_spans:
            return text
        text = _remove(text, spans + import_spans)


def module_level_names(text: str) -> Set[str]:
    """The names a module defines at its top level."""
    names = set()
    for node in ast.parse(text).body:
        names |= _defined_names(node)
    return names
