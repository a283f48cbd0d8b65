"""``install()``'s placing of the call sites (``hooks.CALL_SITES``) in the installed DeepSpeed, at run time.

Each call site's method is replaced by a wrapper that runs the site's statement where the site says (before the
original, or after it, with its return value) and the original itself. The parameters a statement names are
located in the method's signature once per site (``_argument_reader``), the signature read through DeepSpeed's
``instrument_w_nvtx`` decoration (``_undecorated``). ``check_call_sites`` first names every method or parameter the
installed release lacks. The upstream patch places the same statements as source edits instead
(``upstream/build.py``), so this module stays in the package.
"""

import functools
import importlib
import inspect
from typing import Callable, Optional, Tuple, Union

from .capabilities import Capabilities
from .hooks import ATTRIBUTE, END, RESULT, RETURNED, START, AdapterCall, Assign, CallSite, Method, sites_for


def _argument_reader(signature: inspect.Signature, names: Tuple[str, ...]) -> Callable[..., list]:
    """``read(args, kwargs, returned)``: the values of the parameters ``names`` in a call ``(args, kwargs)`` of
    a method of ``signature``. Where each parameter is passed (its position, its keyword, its default) is
    worked out here, once per call site, so that a hooked call only indexes its arguments."""
    parameters = list(signature.parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    places = []
    for name in names:
        if name == RETURNED:
            places.append(None)
            continue
        parameter = signature.parameters[name]
        index = parameters.index(parameter) if parameter.kind in positional else None
        default = None if parameter.default is inspect.Parameter.empty else parameter.default
        places.append((name, index, default))

    def read(args: tuple, kwargs: dict, returned=None) -> list:
        values = []
        for place in places:
            if place is None:
                values.append(returned)
                continue
            name, index, default = place
            if index is not None and index < len(args):
                values.append(args[index])
            else:
                values.append(kwargs.get(name, default))
        return values

    return read


def _wrapped(original: Callable, where: str, statement: Union[AdapterCall, Assign]) -> Callable:
    """``original`` with ``statement`` run where the call site says."""
    arguments = _argument_reader(inspect.signature(_undecorated(original)), statement.arguments)

    def run(args: tuple, kwargs: dict, returned=None) -> None:
        self = args[0]
        if isinstance(statement, Assign):
            setattr(self, statement.attribute, statement.function(*arguments(args, kwargs)))
            return
        adapter = getattr(self, ATTRIBUTE)
        if adapter is not None:
            getattr(adapter, statement.name)(*arguments(args, kwargs, returned))

    def wrapper(*args, **kwargs):
        if where == START:
            run(args, kwargs)
        result = original(*args, **kwargs)
        if where in (END, RESULT):
            run(args, kwargs, result)
        return result

    return functools.wraps(original)(wrapper)


def _undecorated(method: Callable) -> Callable:
    """``method`` as written: DeepSpeed's ``instrument_w_nvtx`` wraps without ``functools.wraps``, hiding the
    parameters a call site names behind ``(*args, **kwargs)``. A method ``install()`` already wrapped is seen
    through first."""
    method = inspect.unwrap(method)
    if method.__qualname__ == "instrument_w_nvtx.<locals>.wrapped_fn":
        return method.__closure__[method.__code__.co_freevars.index("func")].cell_contents
    return method


def _problem(site: CallSite) -> Optional[str]:
    """What the installed DeepSpeed lacks for ``site``, or ``None``."""
    where = f"{site.module}.{site.cls}"
    cls = getattr(importlib.import_module(site.module), site.cls, None)
    if cls is None:
        return f"no class {where}"
    if isinstance(site.statement, Method):
        return None
    method = getattr(cls, site.method, None)
    if method is None:
        return f"no method {where}.{site.method}"
    method = _undecorated(method)
    parameters = inspect.signature(method).parameters
    missing = [name for name in site.statement.arguments if name not in parameters and name not in ("self", RETURNED)]
    return f"{where}.{site.method}{inspect.signature(method)} has no parameter {missing[0]!r}" if missing else None


def check_call_sites(capabilities: Capabilities) -> None:
    """Raise ``RuntimeError`` naming each method or parameter the installed DeepSpeed lacks."""
    problems = [problem for problem in map(_problem, sites_for(capabilities)) if problem]
    if problems:
        raise RuntimeError(f"layer-grad-norms cannot hook into DeepSpeed {capabilities.release}: " +
                           "; ".join(problems))


def apply(capabilities: Capabilities) -> bool:
    """Place every call site of the installed DeepSpeed (described by ``capabilities``) once; returns False
    when they were already placed."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    marker = "_layer_grad_norms_installed"
    if getattr(DeepSpeedEngine, marker, False):
        return False
    for site in sites_for(capabilities):
        cls = getattr(importlib.import_module(site.module), site.cls)
        statement = site.statement
        if isinstance(statement, Method):
            setattr(cls, site.method, statement.function)
            continue
        if isinstance(statement, Assign):
            setattr(cls, statement.attribute, None)  # the default, also for objects made before install()
        if not isinstance(statement, Assign) or statement.function is not None:
            setattr(cls, site.method, _wrapped(getattr(cls, site.method), site.where, statement))
    setattr(DeepSpeedEngine, marker, True)
    return True
