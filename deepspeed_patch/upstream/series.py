"""Write the upstream contribution as a series of small pull requests on DeepSpeed master.

    python -m deepspeed_patch.upstream.series --deepspeed MASTER_CHECKOUT [-o DIR]

Each pull request of ``series_spec.SERIES`` brings package modules, call sites of ``hooks.CALL_SITES``,
files of its own (``series_tree/NN/``: DeepSpeed-style tests) and rows of the docs section; what it
brings into a module that an earlier one already added is named by its cuts (``source_edit.Cut``). The
tree after pull request k is master with the modules of pull requests 1..k, each without the cuts of
pull requests k+1..N; ``series/NN-name.patch`` is the difference between the trees after k-1 and k, and
applies with ``git apply`` on master after the ones before it. PR 01 is written by hand for DeepSpeed (the seed,
``PullRequest.written_by_hand``): its committed patch is the tree after it, and patch 02 takes that tree to the
package's modules.

What belongs to the package only is left out of every stage: the release table (``capabilities``: its
facts are those of the checkout, written in as constants), the plain-PyTorch path, the naming of logs
(``tags``: what the modules use of it is inlined), the CLI, and the cuts of ``series_spec.PACKAGE_ONLY``
(among them the misspelling check of ``load_config``, which reads every config).
"""

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import tempfile
from typing import Dict, List, Optional, Set, Tuple

from yapf.yapflib.yapf_api import FormatCode

from ..capabilities import of_source_tree
from ..hooks import CALL_SITES, CallSite
from .build import (
    DOCS_ANCHOR,
    DOCS_PAGE,
    DOCS_SECTION,
    FACTS_FILE,
    PACKAGE_DIR,
    UPSTREAM_PACKAGE,
    _diff,
    _import_insertion,
    deepspeed_version,
    docs_among_anchor,
    docs_line,
    patch_source,
    upstream_modules,
)
from .series_spec import PACKAGE_ONLY, SERIES, SERIES_TREE, TREE_PATHS, PullRequest
from .source_edit import Cut, apply_cut, drop_unused, import_line, module_level_names, resolve_capabilities

HERE = os.path.dirname(os.path.abspath(__file__))
SERIES_DIR = os.path.join(HERE, "series")
STYLE = os.path.join(os.path.dirname(os.path.dirname(HERE)), ".style.yapf")
MAX_ADDED_LINES = 1000
# Pull requests with a cap of their own. PR 01 (the seed, written for DeepSpeed) is held to issue 47's 600 lines.
# PR 02 is past the cap: it takes PR 01's module to the package's core, the shape the other families, the recorder,
# the optimizer's statistics and the remedies share (config model, layer map, statistics table, adapters,
# publisher), 1,292 added lines as the package's modules are written; its cap is a ratchet a little above that, so
# that it only shrinks; issue 47's rewrite of that core into the seed's shape is to bring it under 1,000.
CAPS = {"01": 600, "02": 1350}

PACKAGE_ONLY_MODULES = ("capabilities.py", "plain.py", "outputs/tags.py")
TAGS = "outputs/tags.py"
# The modules that use the naming of logs, in the order its definitions are inlined: a definition goes
# into the first module that needs it, the later ones import it from there.
TAGS_HOMES = ("config.py", "statistics/layer_map.py", "statistics/result.py", "outputs/monitor.py")
TAGS_IMPORT = re.compile(r"^from \.+(?:outputs\.)?tags import (.+)\n", re.MULTILINE)
DOCS_KEY = "config-json-section.md"  # the path cuts of the docs section name


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def series_modules() -> List[str]:
    """The package's modules that go upstream in the series."""
    return [name for name in upstream_modules() if name not in PACKAGE_ONLY_MODULES]


# --- the naming of logs, inlined ------------------------------------------------------------------


def _tags_statements() -> List[Tuple[Set[str], Set[str], str, bool]]:
    """``(defines, uses, source, is_import)`` of each top-level statement of ``tags.py`` but its docstring
    and ``__all__``."""
    text = _read(os.path.join(PACKAGE_DIR, TAGS))
    tree, lines = ast.parse(text), text.splitlines(keepends=True)
    statements = []
    for node in tree.body[1:]:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            continue
        defines = {(alias.asname or alias.name)
                   for alias in getattr(node, "names", [])} if isinstance(
                       node, (ast.Import, ast.ImportFrom)) else module_level_names(ast.unparse(node))
        uses = {child.id for child in ast.walk(node) if isinstance(child, ast.Name)}
        uses |= {
            word
            for child in ast.walk(node) if isinstance(child, ast.Constant) and isinstance(child.value, str)
            for word in re.findall(r"[A-Za-z_]\w*", child.value)
        }  # string annotations
        source = "".join(lines[node.lineno - 1:node.end_lineno])
        following = tree.body[tree.body.index(node) + 1] if node is not tree.body[-1] else None
        if (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(node, (ast.Assign, ast.AnnAssign))):
            source += "".join(lines[following.lineno - 1:following.end_lineno])
        statements.append((defines - {"__all__"}, uses, source, isinstance(node, (ast.Import, ast.ImportFrom))))
    return [entry for entry in statements if entry[0] or entry[3]]


def inline_tags(texts: Dict[str, str]) -> Dict[str, str]:
    """``texts`` with each ``from .tags import ...`` replaced by the definitions it needs (and theirs), placed in
    the first of ``TAGS_HOMES`` that needs them."""
    statements = _tags_statements()
    definitions = [entry for entry in statements if not entry[3]]
    placed: Dict[str, str] = {}  # name -> module that holds it
    texts = dict(texts)
    for name, text in texts.items():
        if TAGS_IMPORT.search(text) and name not in TAGS_HOMES:
            raise ValueError(f"{name} imports tags; add it to series.TAGS_HOMES")
    for home in TAGS_HOMES:
        text = texts[home]
        found = TAGS_IMPORT.search(text)
        if found is None:
            continue
        wanted = {name.strip() for name in found.group(1).split(",")}
        closure, frontier = set(), set(wanted)
        while frontier:
            name = frontier.pop()
            if name in closure or name in placed:
                continue
            closure.add(name)
            for defines, uses, _, _ in definitions:
                if name in defines:
                    frontier |= uses
        from_elsewhere: Dict[str, List[str]] = {}
        for name in sorted(wanted | {use for d, uses, _, _ in definitions if d & closure for use in uses}):
            if name in placed and name not in closure:
                from_elsewhere.setdefault(placed[name], []).append(name)
        body = [source for defines, _, source, _ in definitions if defines & closure]
        imports = [source for _, _, source, is_import in statements if is_import]
        imports += [f"from {relative_import(home, module)} import {', '.join(names)}\n" for module, names in
                    from_elsewhere.items()]
        text = text.replace(found.group(0), "")
        lines = text.splitlines(keepends=True)
        at = _import_insertion(ast.parse(text))
        lines[at:at] = ["".join(imports), "\n\n", "\n".join(body)]
        texts[home] = _dedupe_imports("".join(lines))
        for defines, _, _, _ in definitions:
            if defines & closure:
                placed.update((name, home) for name in defines)
    return texts


def relative_import(importer: str, module: str) -> str:
    """How the package's module ``importer`` names ``module`` in a relative import (both paths in the package)."""
    folder, target = importer.split("/")[:-1], module[:-3].split("/")
    shared = 0
    while shared < min(len(folder), len(target) - 1) and folder[shared] == target[shared]:
        shared += 1
    return "." * (len(folder) - shared + 1) + ".".join(target[shared:])


def _dedupe_imports(text: str) -> str:
    """Without an import of a name an earlier module-level import binds already, and with the names of a later
    ``from M import ...`` joined to the first import from ``M`` (the inlined definitions' imports beside the
    module's own)."""
    tree, lines = ast.parse(text), text.splitlines(keepends=True)
    bound: Set[str] = set()
    first_from: Dict[Tuple[Optional[str], int], ast.ImportFrom] = {}
    for node in tree.body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        names = [alias for alias in node.names if (alias.asname or alias.name) not in bound]
        bound |= {alias.asname or alias.name for alias in node.names}
        first = first_from.setdefault((node.module, node.level), node) if isinstance(node, ast.ImportFrom) else node
        if first is not node:
            if names:
                first.names = sorted(first.names + names, key=lambda alias: alias.name)
                _rewrite(lines, first, import_line(first))
            _rewrite(lines, node, "")
            continue
        if len(names) < len(node.names):
            node.names = names  # also what a later import from the same module joins
            _rewrite(lines, node, import_line(node) if names else "")
    return "".join(lines)


def _rewrite(lines: List[str], node: ast.stmt, new: str) -> None:
    """The lines of statement ``node`` replaced by ``new``, keeping every other statement's line numbers."""
    lines[node.lineno - 1:node.end_lineno] = [new] + [""] * (node.end_lineno - node.lineno)


# --- the stages -----------------------------------------------------------------------------------


def _upstream_imports(text: str) -> str:
    """The package's imports of what DeepSpeed has itself."""
    return text.replace("from .capabilities import DeepSpeedConfigModel",
                        "from deepspeed.runtime.config_utils import DeepSpeedConfigModel")


def _cut_all(texts: Dict[str, str], cuts: Tuple[Cut, ...]) -> Dict[str, str]:
    texts = dict(texts)
    for cut in cuts:
        if cut.path in texts:
            texts[cut.path] = apply_cut(texts[cut.path], cut)
    return texts


def full_texts(facts: Dict[str, bool]) -> Dict[str, str]:
    """Every file the whole series adds, by its path in the upstream package (``DOCS_KEY``: the docs section;
    ``tree:``-prefixed: a file of a pull request's own tree, by its path in DeepSpeed)."""
    texts = {name: _upstream_imports(_read(os.path.join(PACKAGE_DIR, name))) for name in series_modules()}
    texts = inline_tags(texts)
    texts[DOCS_KEY] = _read(DOCS_SECTION)
    for request in SERIES:
        folder = os.path.join(SERIES_TREE, request.number)
        for root, _, names in os.walk(folder):
            for name in names:
                path = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
                texts[f"tree:{path}"] = _read(os.path.join(root, name))
    unowned = [name for name in texts if name != DOCS_KEY and _owner(name) is None]
    unknown = [cut.path for request in SERIES for cut in request.cuts + PACKAGE_ONLY if cut.path not in texts]
    if unowned or unknown:
        raise ValueError(f"series_spec: give each module to a pull request ({unowned}); cuts of unknown files "
                         f"({unknown})")
    texts = _cut_all(texts, PACKAGE_ONLY)
    return {name: resolve_capabilities(text, facts) if name.endswith(".py") else text for name, text in texts.items()}


def _owner(name: str) -> Optional[PullRequest]:
    """The pull request that adds the file ``name``."""
    for request in SERIES:
        if name in request.modules or (name.startswith("tree:") and name in request.tree_files()):
            return request
        if name == DOCS_KEY and request.docs:
            return request
    return None


def _exported(texts: Dict[str, str]) -> Dict[str, Set[str]]:
    """Per module, the names other modules of the stage import from it."""
    found: Dict[str, Set[str]] = {name: set() for name in texts}
    for name, text in texts.items():
        if not name.endswith(".py"):
            continue
        folder = os.path.dirname(name.removeprefix("tree:"))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level:
                target = _relative_module(folder, node.level, node.module, name.startswith("tree:"))
                for candidate in (f"{target}.py", f"{target}/__init__.py"):
                    if candidate in found:
                        found[candidate] |= {alias.name for alias in node.names}
    return found


def _relative_module(folder: str, level: int, module: Optional[str], in_tree: bool) -> str:
    parts = folder.split("/") if folder else []
    parts = parts[:len(parts) - (level - 1)] if level > 1 else parts
    path = "/".join(parts + (module.split(".") if module else []))
    if in_tree and path.startswith(UPSTREAM_PACKAGE):
        path = path[len(UPSTREAM_PACKAGE) + 1:]
    return path


def stage_texts(full: Dict[str, str], upto: int) -> Dict[str, str]:
    """The files the series adds after pull request ``upto`` (0: none), formatted as DeepSpeed formats them."""
    included = {name: text for name, text in full.items() if _owner(name) and int(_owner(name).number) <= upto}
    later = [cut for request in reversed(SERIES) if int(request.number) > upto for cut in request.cuts]
    texts = _cut_all(included, tuple(later))
    exported = _exported(texts)
    stage = {}
    for name, text in texts.items():
        if name.endswith(".py"):
            text = FormatCode(drop_unused(text, exported.get(name, ())), style_config=STYLE)[0]
        stage[name] = text
    return stage


def deepspeed_path(name: str) -> str:
    """Where the package's module ``name`` goes in DeepSpeed."""
    return TREE_PATHS.get(name, f"{UPSTREAM_PACKAGE}/{name}")


def stage_sites(upto: int, facts_release) -> List[CallSite]:
    """The call sites of pull requests 1..``upto``, in the order of ``CALL_SITES``."""
    from ..hooks import sites_for

    owned = [site for request in SERIES if int(request.number) <= upto for site in CALL_SITES if request.owns(site)]
    return [site for site in sites_for(facts_release) if site in owned]


def _docs_page(root: str, section: str) -> Tuple[str, str]:
    page = _read(os.path.join(root, DOCS_PAGE))
    anchor = "".join(DOCS_ANCHOR)
    if anchor not in page:
        raise ValueError(f"{DOCS_PAGE}: the lines the docs section goes among are not there")
    return page, page.replace(anchor, docs_among_anchor(section)) if section else page


def stage_tree(root: str, upto: int, full: Dict[str, str], release) -> Dict[str, str]:
    """``{path in DeepSpeed: text}`` of every file the series adds or changes, after pull request ``upto``."""
    files: Dict[str, str] = {}
    for name, text in stage_texts(full, upto).items():
        if name == DOCS_KEY:
            if os.path.isfile(os.path.join(root, DOCS_PAGE)):  # an installed package has no docs
                files[DOCS_PAGE] = _docs_page(root, text)[1]
        elif name.startswith("tree:"):
            files[name[5:]] = text
        else:
            files[deepspeed_path(name)] = text
    by_path: Dict[str, List[CallSite]] = {}
    for site in stage_sites(upto, release):
        by_path.setdefault(f"deepspeed/{site.path}", []).append(site)
    for path, sites in by_path.items():
        files[path] = patch_source(_read(os.path.join(root, path)), sites)
    return files


def release_facts(root: str) -> Tuple[object, Dict[str, bool]]:
    """The ``capabilities`` record of the DeepSpeed under ``root``, and its facts by name."""
    release = of_source_tree(os.path.join(root, "deepspeed"), deepspeed_version(root))
    return release, {name: release.has(name) for name in release.__dataclass_fields__ if name != "release"}


def make_series(root: str, upto: Optional[int] = None) -> List[Tuple[PullRequest, str]]:
    """``(pull request, patch)`` of each pull request of the series (of the first ``upto``), against the DeepSpeed
    checkout ``root``. A pull request written by hand (PR 01) is its committed patch; on a checkout it does not apply
    to (an installed release) it is left out, and the next patch then starts from DeepSpeed's own files."""
    release, facts = release_facts(root)
    full = full_texts(facts)
    previous: Dict[str, Optional[str]] = {}
    patches = []
    for request in SERIES[:upto]:
        if request.written_by_hand:
            patch = _read(committed_patch(request))
            applied = files_after(root, patch)
            if applied is not None:
                patches.append((request, patch))
                previous = applied
            continue
        current = stage_tree(root, int(request.number), full, release)
        diffs = []
        for path in sorted(set(current) | set(previous)):
            original = _read(os.path.join(root, path)) if os.path.isfile(os.path.join(root, path)) else None
            old = previous.get(path, original)
            new = current.get(path, original)  # what an earlier patch changed and this stage does not: as it was
            if old != new:
                diffs.append(_diff(path, old, new))
        patches.append((request, "".join(diffs)))
        previous = current
    return patches


def committed_patch(request: PullRequest) -> str:
    """Where the series keeps ``request``'s patch."""
    return os.path.join(SERIES_DIR, request.file_name + ".patch")


def files_after(root: str, patch: str) -> Optional[Dict[str, Optional[str]]]:
    """``{path: text}`` of the files ``patch`` touches, as applying it to the checkout ``root`` leaves them (``None``:
    deleted); ``None`` when it does not apply there."""
    paths = re.findall(r"^diff --git a/(\S+) b/", patch, re.MULTILINE)
    with tempfile.TemporaryDirectory(prefix="lgn-series-") as work:
        subprocess.run(["git", "init", "-q", work], check=True)
        for path in paths:
            if os.path.isfile(os.path.join(root, path)):
                os.makedirs(os.path.dirname(os.path.join(work, path)), exist_ok=True)
                shutil.copy(os.path.join(root, path), os.path.join(work, path))
        applied = subprocess.run(["git", "apply", "-"], input=patch, cwd=work, capture_output=True, text=True)
        if applied.returncode != 0:
            return None
        return {path: _read(os.path.join(work, path)) if os.path.isfile(os.path.join(work, path)) else None
                for path in paths}


def added_lines(patch: str) -> int:
    return sum(1 for line in patch.splitlines() if line.startswith("+") and not line.startswith("+++"))


def write_series(root: str, folder: str = SERIES_DIR) -> List[Tuple[str, int]]:
    """Write ``NN-name.patch`` for each pull request (PR 01, written by hand, as committed: it must apply to ``root``);
    returns ``(file, added lines)``; raises past the cap."""
    os.makedirs(folder, exist_ok=True)
    written = []
    series = make_series(root)
    if [request for request, _ in series] != list(SERIES):
        raise ValueError(f"{committed_patch(SERIES[0])} does not apply to {root}")
    for request, patch in series:
        count, cap = added_lines(patch), CAPS.get(request.number, MAX_ADDED_LINES)
        if count > cap:
            raise ValueError(f"{request.file_name}: {count} added lines, over {cap}")
        with open(os.path.join(folder, request.file_name + ".patch"), "w", encoding="utf-8") as handle:
            handle.write(patch)
        written.append((request.file_name, count))
    _, facts = release_facts(root)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    recorded = {"deepspeed": deepspeed_version(root), "commit": commit, "docs_line": docs_line(root), "facts": facts}
    with open(os.path.join(folder, FACTS_FILE), "w", encoding="utf-8") as handle:
        json.dump(recorded, handle, indent=1)
        handle.write("\n")
    return written


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed", required=True, help="a DeepSpeed master checkout")
    parser.add_argument("-o", "--output", default=SERIES_DIR)
    args = parser.parse_args(argv)
    for name, count in write_series(args.deepspeed, args.output):
        print(f"{name}.patch: {count} added lines")


if __name__ == "__main__":
    main()
