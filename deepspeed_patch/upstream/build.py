"""Build the upstream patch: this package's modules, and the call sites of ``hooks.CALL_SITES``,
as a change to DeepSpeed's own source tree.

    python -m deepspeed_patch.upstream.build [--deepspeed DIR] -o FILE

The patch is built on demand, not stored: against the installed DeepSpeed (the 0.19.8 release) or a
checkout (``--deepspeed CHECKOUT``, of master for a pull request).
``layer-grad-norms patch`` builds what it applies (``apply.py``). The committed form of the upstream work
is the series (``series.py``, ``series/``).

The modules are copied as they are into ``deepspeed/runtime/layer_grad_norms/``; each call site
becomes one line in the method it belongs to, written against the installed DeepSpeed's files (or
those under ``DIR``). ``tree/`` holds the files the patch adds beside them (its ``__init__.py``, the docs
section); its DeepSpeed-style unit test is the series' (``series_tree/``), whole."""

import argparse
import ast
import difflib
import inspect
import json
import os
import re
from typing import Dict, List, Optional, Tuple

from ..capabilities import of_source_tree
from ..hooks import ATTRIBUTE, END, METHOD, RESULT, RETURNED, START, AdapterCall, Assign, CallSite, Method, sites_for
from .series_spec import ZERO_TESTS, series_tree_file

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_DIR = os.path.dirname(HERE)
PATCH_RELEASES = ("0.19.8", )  # the releases `layer-grad-norms patch` applies to
# What the series was generated against (release, commit, capabilities facts), and the line of DeepSpeed's config page
# the docs section goes at there.
FACTS_FILE = "master.json"
SERIES_FACTS = os.path.join(HERE, "series", FACTS_FILE)
TREE = os.path.join(HERE, "tree")

UPSTREAM_PACKAGE = "deepspeed/runtime/layer_grad_norms"
# Every module of the package goes upstream as it is, but its __init__ (the tree has DeepSpeed's own),
# hooks.py and patching.py (the call sites and install()'s placing of them: the patch places the calls in the
# source), hf.py and hf_readers.py (the Hugging Face Trainer callback and its guarded readers import transformers,
# which DeepSpeed does not depend on: they belong with the Trainer).
NOT_UPSTREAM = ("__init__.py", "hooks.py", "patching.py", "hf.py", "outputs/hf_readers.py")
IMPORT_LINE = "from deepspeed.runtime import layer_grad_norms"
LICENSE = "# Copyright (c) Microsoft Corporation.\n# SPDX-License-Identifier: Apache-2.0\n\n# DeepSpeed Team\n"
CPP_LICENSE = LICENSE.replace("# ", "// ")
SOURCE_SUFFIXES = {".py": LICENSE, ".cpp": CPP_LICENSE}  # the package's files that go upstream, by their header

# Where the docs section goes on DeepSpeed's config-json page: among these lines, after "Gradient Clipping"'s table
# and its blank line (DOCS_SECTION_AT), where PR 01 puts it. A checkout has the page; an installed package does not
# (see docs_line).
DOCS_PAGE = "docs/_pages/config-json.md"
DOCS_ANCHOR = ("| Enable gradient clipping with value | `1.0`   |\n", "\n", "\n", "\n",
               "### ZeRO Optimizations for FP16 Training\n")
DOCS_SECTION_AT = 2
DOCS_SECTION = os.path.join(HERE, "config-json-section.md")


def deepspeed_version(root: str) -> str:
    """The release of the DeepSpeed under ``root``: a checkout's version.txt, or the installed package's."""
    checkout_version = os.path.join(root, "version.txt")
    if os.path.isfile(checkout_version):
        with open(checkout_version, encoding="utf-8") as handle:
            return handle.read().strip()
    installed = os.path.join(root, "deepspeed", "git_version_info_installed.py")
    if os.path.isfile(installed):
        with open(installed, encoding="utf-8") as handle:
            found = re.search(r"^version\s*=\s*['\"]([^'\"]+)['\"]", handle.read(), re.MULTILINE)
        if found:
            return found.group(1)
    raise ValueError(f"{root}: cannot tell the DeepSpeed release (no version.txt, no "
                     "deepspeed/git_version_info_installed.py)")


def installed_deepspeed_root() -> str:
    """The directory that holds the installed ``deepspeed`` package."""
    import deepspeed

    return os.path.dirname(os.path.dirname(os.path.abspath(deepspeed.__file__)))


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def upstream_modules() -> List[str]:
    """The package's modules (and the C++ source of its host kernel) that go upstream, as paths relative to
    the package."""
    found = []
    for folder, dirs, names in os.walk(PACKAGE_DIR):
        dirs[:] = sorted(name for name in dirs if name not in ("upstream", "__pycache__"))
        for name in sorted(names):
            relative = os.path.relpath(os.path.join(folder, name), PACKAGE_DIR).replace(os.sep, "/")
            if os.path.splitext(name)[1] in SOURCE_SUFFIXES and relative not in NOT_UPSTREAM:
                found.append(relative)
    return found


# --- the call sites -------------------------------------------------------------------------------


def _class(tree: ast.Module, site: CallSite) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == site.cls:
            return node
    raise LookupError(f"{site.path}: no class {site.cls}")


def _method(tree: ast.Module, site: CallSite) -> ast.FunctionDef:
    for item in _class(tree, site).body:
        if isinstance(item, ast.FunctionDef) and item.name == site.method:
            return item
    raise LookupError(f"{site.path}: no method {site.cls}.{site.method}")


def _single_return(method: ast.FunctionDef) -> Optional[ast.Return]:
    returns = [node for node in ast.walk(method) if isinstance(node, ast.Return)]
    if not returns:
        return None
    if len(returns) > 1 or returns[0] is not method.body[-1]:
        raise ValueError(f"{method.name} returns in more than one place; a call at its end would be skipped")
    return returns[0]


def _argument_names(method: ast.FunctionDef, site: CallSite, wanted: Tuple[str, ...]) -> List[str]:
    """``wanted``, checked against the method's parameters (``RETURNED``: the name it returns)."""
    parameters = [arg.arg for arg in method.args.args + method.args.kwonlyargs]
    names = []
    for name in wanted:
        if name == RETURNED:
            returned = _single_return(method)
            if site.where != RESULT or returned is None or not isinstance(returned.value, ast.Name):
                raise ValueError(f"{site.cls}.{site.method} must end with 'return <name>' to pass what it returns")
            name = returned.value.id
        elif name not in parameters:
            raise ValueError(f"{site.cls}.{site.method}({', '.join(parameters)}) has no parameter {name!r}")
        names.append(name)
    return names


def _statement_lines(site: CallSite, method: ast.FunctionDef, indent: str) -> List[str]:
    """The lines a call site adds inside ``method``."""
    statement = site.statement
    arguments = ", ".join(_argument_names(method, site, statement.arguments))
    if isinstance(statement, AdapterCall):
        return [f"{indent}if self.{ATTRIBUTE} is not None:\n",
                f"{indent}    self.{ATTRIBUTE}.{statement.name}({arguments})\n"]
    value = "None" if statement.function is None else f"layer_grad_norms.{statement.function.__name__}({arguments})"
    return [f"{indent}self.{statement.attribute} = {value}\n"]


def _method_text(site: CallSite, indent: str) -> List[str]:
    """A new method that hands over to the package's function."""
    function = site.statement.function
    parameters = list(inspect.signature(function).parameters.values())[1:]
    signature = ", ".join(["self"] + [p.name if p.default is p.empty else f"{p.name}={p.default!r}"
                                      for p in parameters])
    arguments = ", ".join(["self"] + [p.name if p.default is p.empty else f"{p.name}={p.name}" for p in parameters])
    summary = inspect.getdoc(function).split("\n\n")[0].replace("\n", f"\n{indent}    ")
    return [
        "\n", f"{indent}def {site.method}({signature}):\n", f'{indent}    """{summary}"""\n',
        f"{indent}    return layer_grad_norms.{function.__name__}({arguments})\n"
    ]


def _insertion(tree: ast.Module, lines: List[str], site: CallSite) -> Tuple[int, List[str]]:
    """``(line index to insert before, lines)`` for one call site."""
    if site.where == METHOD:
        cls = _class(tree, site)
        indent = " " * cls.body[0].col_offset
        return cls.end_lineno, _method_text(site, indent)
    method = _method(tree, site)
    first = method.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        first = method.body[1]  # after the docstring
    indent = " " * first.col_offset
    new_lines = _statement_lines(site, method, indent)
    if site.where == START:
        top = first.lineno - 1
        while top - 1 >= method.lineno and lines[top - 1].strip().startswith("#"):
            top -= 1  # above the comments that open the body
        return top, new_lines
    returned = _single_return(method)
    if site.where == END:
        if returned is not None:
            raise ValueError(f"{site.cls}.{site.method} returns a value; use RESULT")
        return method.end_lineno, new_lines
    if site.where == RESULT:
        if returned is None:
            raise ValueError(f"{site.cls}.{site.method} must end with a return")
        return returned.lineno - 1, new_lines
    raise ValueError(f"unknown call-site position {site.where!r}")


def _needs_import(site: CallSite) -> bool:
    return isinstance(site.statement, Method) or (isinstance(site.statement, Assign)
                                                  and site.statement.function is not None)


def _import_insertion(tree: ast.Module) -> int:
    """After the last import that precedes the first class or function."""
    last = 0
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            break
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            last = node.end_lineno
    return last


def patch_source(source: str, sites: List[CallSite]) -> str:
    """``source`` with the ``sites`` (and, where they call the package, its import) written in."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    insertions = [_insertion(tree, lines, site) for site in sites]
    if any(_needs_import(site) for site in sites):
        insertions.insert(0, (_import_insertion(tree), [IMPORT_LINE + "\n"]))
    # bottom up, so that earlier line numbers stay valid; at one line, in table order
    for index, new_lines in sorted(insertions, key=lambda item: item[0], reverse=True):
        lines[index:index] = new_lines
    return "".join(lines)


# --- the whole patch ------------------------------------------------------------------------------


def upstream_files(deepspeed_root: str) -> Dict[str, Tuple[Optional[str], str]]:
    """``{path: (original text or None for a new file, new text)}`` of every file the patch touches,
    except the docs page."""
    files: Dict[str, Tuple[Optional[str], str]] = {}
    for name in upstream_modules():
        text = _read(os.path.join(PACKAGE_DIR, name))
        if not text.startswith(SOURCE_SUFFIXES[os.path.splitext(name)[1]]):
            raise ValueError(f"deepspeed_patch/{name} lacks DeepSpeed's license header")
        files[f"{UPSTREAM_PACKAGE}/{name}"] = (None, text)
    for folder, _, names in os.walk(TREE):
        for name in names:
            path = os.path.join(folder, name)
            files[os.path.relpath(path, TREE).replace(os.sep, "/")] = (None, _read(path))
    files[ZERO_TESTS[len("tree:"):]] = (None, _read(series_tree_file(ZERO_TESTS)))  # the series' test, whole
    by_path: Dict[str, List[CallSite]] = {}
    release = of_source_tree(os.path.join(deepspeed_root, "deepspeed"), deepspeed_version(deepspeed_root))
    for site in sites_for(release):
        by_path.setdefault(f"deepspeed/{site.path}", []).append(site)
    for path, sites in by_path.items():
        original = _read(os.path.join(deepspeed_root, path))
        files[path] = (original, patch_source(original, sites))
    return files


def _diff(path: str, original: Optional[str], new: Optional[str]) -> str:
    """The git diff of ``path`` from ``original`` to ``new`` (``None``: the file does not exist)."""
    header = f"diff --git a/{path} b/{path}\n"
    if original is None:
        header += "new file mode 100644\n"
    if new is None:
        header += "deleted file mode 100644\n"
    body = difflib.unified_diff([] if original is None else original.splitlines(keepends=True),
                                [] if new is None else new.splitlines(keepends=True),
                                "/dev/null" if original is None else f"a/{path}",
                                "/dev/null" if new is None else f"b/{path}")
    return header + "".join(body)


def docs_line(deepspeed_root: str) -> int:
    """The line the docs anchor starts at: found on the checkout's page or, for an installed package
    (which has no docs), the one the series recorded from its generation against a master checkout.
    ``git apply`` places the hunk by its content anyway; the number keeps the hunk honest for a reader."""
    page = os.path.join(deepspeed_root, DOCS_PAGE)
    if os.path.isfile(page):
        text = _read(page)
        start = text.find("".join(DOCS_ANCHOR))
        if start < 0:
            raise ValueError(f"{page}: the lines the docs section goes among are not there: {DOCS_ANCHOR}")
        return text.count("\n", 0, start) + 1
    with open(SERIES_FACTS, encoding="utf-8") as handle:
        return json.load(handle)["docs_line"]


def docs_among_anchor(section: str) -> str:
    """The anchor's lines with the docs section at ``DOCS_SECTION_AT``, one blank line after it."""
    return "".join(DOCS_ANCHOR[:DOCS_SECTION_AT]) + section + "\n" + "".join(DOCS_ANCHOR[DOCS_SECTION_AT:])


def _docs_diff(deepspeed_root: str) -> str:
    """The docs section, as a hunk located by its surrounding lines."""
    section = _read(DOCS_SECTION).splitlines(keepends=True)
    context = len(DOCS_ANCHOR)
    start = docs_line(deepspeed_root)
    lines = [f" {line}" for line in DOCS_ANCHOR[:DOCS_SECTION_AT]] + [f"+{line}" for line in section + ["\n"]]
    lines += [f" {line}" for line in DOCS_ANCHOR[DOCS_SECTION_AT:]]
    return (f"diff --git a/{DOCS_PAGE} b/{DOCS_PAGE}\n--- a/{DOCS_PAGE}\n+++ b/{DOCS_PAGE}\n"
            f"@@ -{start},{context} +{start},{context + len(section) + 1} @@\n" + "".join(lines))


def make_patch(deepspeed_root: Optional[str] = None) -> str:
    """The whole patch, against the DeepSpeed under ``deepspeed_root`` (default: the installed one)."""
    root = deepspeed_root or installed_deepspeed_root()
    files = upstream_files(root)
    diffs = [_diff(path, *files[path]) for path in sorted(files)]
    return "".join(sorted(diffs + [_docs_diff(root)], key=lambda diff: diff.split(" ", 3)[2]))


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed", help="the directory holding the deepspeed package (default: installed)")
    # a file, not stdout: DeepSpeed logs to stdout from its import on (deepspeed_patch imports it)
    parser.add_argument("-o", "--output", required=True, help="the file to write")
    args = parser.parse_args(argv)
    patch = make_patch(args.deepspeed)
    with open(args.output, "w", encoding="utf-8") as handle:
        handle.write(patch)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
