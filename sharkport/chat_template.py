"""Chat templates (Jinja2, as Hugging Face renders them) from a model file, which is a stranger's
file: rendered in Jinja2's immutable sandbox with limits on the work a template may do.

A render stops with one SharkportError when the template's code runs more than MAX_STEPS lines
or MAX_SECONDS, when a string or list it builds (by `+`, `*`, `~`, a filter) or its output would
pass MAX_CHARS characters, or when it recurses past Python's limit. Templates cannot reach
files: `include`, `import` and `extends` have no loader.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from datetime import datetime
from typing import Any

from .errors import SharkportError

MAX_STEPS = 2_000_000  # lines of template code; a real chat template runs a few thousand
MAX_SECONDS = 10.0
MAX_CHARS = 4_000_000


class TemplateFailed(Exception):
    """`raise_exception(...)` called by the template itself."""


class _Limit(Exception):
    pass


def compile_template(source: str) -> Any:
    """The sandboxed, limited Jinja2 template of `source` (render it with `render`)."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - jinja2 is a dependency
        raise SharkportError("rendering tokenizer.chat_template needs jinja2: pip install jinja2") from None

    class Environment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "+", "**", "%"})

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

    def raise_exception(message: str) -> None:
        raise TemplateFailed(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.filters = {name: _bounded(f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        template = env.from_string(source)
    except jinja2.TemplateError as e:
        raise SharkportError(f"tokenizer.chat_template is not a valid Jinja2 template: {' '.join(str(e).split())}") from None
    names = template.root_render_func.__globals__  # the compiled module's: `~` joins through these
    for join in ("str_join", "markup_join"):
        if join in names:
            names[join] = _bounded_join(names[join])
    return template


def render(template: Any, **values: Any) -> str:
    """`template` rendered with `values` under the limits; SharkportError on any failure."""
    deadline, steps = time.monotonic() + MAX_SECONDS, 0

    def count(frame, event, arg):
        nonlocal steps
        if event == "line":
            steps += 1
            if steps > MAX_STEPS:
                raise _Limit(f"ran more than {MAX_STEPS:,} steps")
            if steps % 4096 == 0 and time.monotonic() > deadline:
                raise _Limit(f"ran longer than {MAX_SECONDS:g} s")
        return count

    def trace(frame, event, arg):
        return count if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        out, size = [], 0
        for piece in template.generate(**values):
            size += len(piece)
            if size > MAX_CHARS:
                raise _Limit(f"wrote more than {MAX_CHARS:,} characters")
            out.append(piece)
        return "".join(out)
    except _Limit as e:
        raise SharkportError(f"tokenizer.chat_template {e}, past what a chat template needs; "
                             "the model file's template is broken or hostile") from None
    except RecursionError:
        raise SharkportError("tokenizer.chat_template recursed past Python's limit; the model file's "
                             "template is broken or hostile") from None
    except Exception as e:  # raise_exception(...), undefined names, include without a loader, ...
        raise SharkportError(f"tokenizer.chat_template failed on these messages: {' '.join(str(e).split())}") from None
    finally:
        sys.settrace(previous)


def _size(x: Any) -> int | None:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else None


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if _size(seq) is not None and isinstance(n, int) and _size(seq) * n > MAX_CHARS:
                raise _Limit(f"would build a sequence of {_size(seq) * n:,} items")
    elif operator == "+" and _size(left) is not None and _size(right) is not None:
        if _size(left) + _size(right) > MAX_CHARS:
            raise _Limit(f"would build a sequence of {_size(left) + _size(right):,} items")
    elif operator == "**" and isinstance(right, (int, float)) and abs(right) > 1024:
        raise _Limit(f"raises to the power {right}")
    elif operator == "%" and isinstance(left, str) and re.search(r"%[-+ #0]*\d{7,}", left):
        raise _Limit("formats a field wider than a chat needs")


def _bounded(f):
    """A filter that refuses numbers past MAX_CHARS (widths, counts) and results past it."""

    @functools.wraps(f)
    def bounded(*args, **kwargs):
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_CHARS:
                raise _Limit(f"passes {a:,} to the filter {f.__name__}")
        result = f(*args, **kwargs)
        if _size(result) is not None and _size(result) > MAX_CHARS:
            raise _Limit(f"built {_size(result):,} characters with the filter {f.__name__}")
        return result

    return bounded


def _bounded_join(join):
    def bounded(seq):
        result = join(seq)
        if len(result) > MAX_CHARS:
            raise _Limit(f"built a string of {len(result):,} characters")
        return result

    return bounded
