"""Write docs/api.md, the API reference, from the code: the public names and their docstrings.

    python docs/gen_api.py            # rewrite docs/api.md
    python docs/gen_api.py --check    # exit 1 if docs/api.md is not what the code gives now

What is public: the names in ``__all__`` of ``minipar`` and of each family package that has one
(``tensor_parallel``, ``pipeline``, ``checkpoint``, ``recompute``, ``models``, ``kernels``). The
families that are packages of modules without exports (``core``, ``data_parallel``,
``context_parallel``, ``moe``, ``plan``) are listed module by module: each module's first docstring
line and the documented classes and functions it defines; a family package not named here yet is
listed the same way, after them. For every name: its signature and the
first paragraph of its docstring; for a class, also its documented public methods. Nothing is
written by hand, so tests/test_docs.py can check that the page is current.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import sys
from pathlib import Path

PAGE = Path(__file__).with_name("api.md")

# (package, how it is listed): "all" = its __all__; "modules" = each of its modules in turn
SECTIONS = [
    ("minipar", "all"),
    ("minipar.core", "modules"),
    ("minipar.data_parallel", "modules"),
    ("minipar.tensor_parallel", "all"),
    ("minipar.pipeline", "all"),
    ("minipar.context_parallel", "modules"),
    ("minipar.moe", "modules"),
    ("minipar.checkpoint", "all"),
    ("minipar.recompute", "all"),
    ("minipar.plan", "modules"),
    ("minipar.models", "all"),
    ("minipar.kernels", "all"),
]


def sections() -> list[tuple[str, str]]:
    """SECTIONS, then any family package of minipar it does not name yet (a new family is listed
    without an edit here: by its __all__, else module by module)."""
    import minipar
    named = {package for package, _ in SECTIONS}
    extra = []
    for info in sorted(pkgutil.iter_modules(minipar.__path__), key=lambda i: i.name):
        package = f"minipar.{info.name}"
        if info.ispkg and package not in named:
            extra.append((package, "all" if hasattr(importlib.import_module(package), "__all__") else "modules"))
    return SECTIONS + extra


def first_paragraph(obj) -> str:
    """The object's own docstring's first paragraph on one line ("(no docstring)" when it has none;
    a dataclass's generated ``Name(field, ...)`` counts as none)."""
    doc = inspect.cleandoc(obj.__doc__ or "")
    if not doc or (inspect.isclass(obj) and doc.startswith(obj.__name__ + "(")):
        return "(no docstring)"
    return " ".join(doc.split("\n\n", 1)[0].split())


class _Annotation(str):
    """An annotation kept as its source text (modules use ``from __future__ import annotations``),
    printed without quotes."""

    def __repr__(self) -> str:
        return str(self)


def signature(obj) -> str:
    """``(args) -> result``, annotations as written, object addresses removed (stable across runs)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    raw = lambda a: _Annotation(a) if isinstance(a, str) else a  # noqa: E731
    sig = sig.replace(parameters=[p.replace(annotation=raw(p.annotation)) for p in sig.parameters.values()],
                      return_annotation=raw(sig.return_annotation))
    return re.sub(r" at 0x[0-9a-f]+", "", str(sig))


def describe(qualified: str, obj, depth: str = "###") -> list[str]:
    """The lines for one public name."""
    if inspect.ismodule(obj):
        return [f"{depth} `{qualified}` (module)", "", first_paragraph(obj), ""]
    if inspect.isclass(obj) or callable(obj):
        kind = "class" if inspect.isclass(obj) else "function"
        lines = [f"{depth} `{qualified}{signature(obj)}` ({kind})", "", first_paragraph(obj), ""]
        if inspect.isclass(obj):
            for name, member in sorted(vars(obj).items()):
                if name.startswith("_") or name == "forward":
                    continue
                func = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                if not (inspect.isfunction(func) and func.__doc__):
                    continue
                sig = "" if isinstance(member, property) else signature(func).replace("(self, ", "(", 1).replace("(self)", "()", 1)
                lines += [f"- `{name}{sig}`{' (property)' if isinstance(member, property) else ''}: "
                          f"{first_paragraph(func)}"]
            if lines[-1] != "":
                lines.append("")
        return lines
    if isinstance(obj, (tuple, list, frozenset, set)) and obj and all(isinstance(v, str) for v in obj):
        what = f"One of {', '.join(map(repr, sorted(obj)))}."
    else:
        what = f"A `{type(obj).__name__}` object."
    return [f"{depth} `{qualified}` ({type(obj).__name__})", "", what, ""]


def defined_in(module) -> list[tuple[str, object]]:
    """The documented public classes and functions ``module`` itself defines, in source order."""
    out = []
    for name, obj in vars(module).items():
        if name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if getattr(obj, "__module__", None) != module.__name__ or not obj.__doc__:
            continue
        out.append((inspect.getsourcelines(obj)[1], name, obj))
    return [(name, obj) for _, name, obj in sorted(out, key=lambda t: t[0])]


def render() -> str:
    lines = ["# API reference", "",
             "Generated by `python docs/gen_api.py` from the public names and their docstrings; do not edit by hand",
             "(`tests/test_docs.py` checks that it is current). Back to the [README](../README.md).", ""]
    for package, how in sections():
        module = importlib.import_module(package)
        lines += [f"## `{package}`", "", first_paragraph(module), ""]
        if how == "all":
            for name in module.__all__:
                lines += describe(f"{package}.{name}", getattr(module, name))
            continue
        for info in sorted(pkgutil.iter_modules(module.__path__), key=lambda i: i.name):
            if info.name.startswith("_"):
                continue
            sub = importlib.import_module(f"{package}.{info.name}")
            lines += [f"### `{sub.__name__}`", "", first_paragraph(sub), ""]
            for name, obj in defined_in(sub):
                lines += [line.replace("### ", "#### ", 1) if line.startswith("### ") else line
                          for line in describe(f"{sub.__name__}.{name}", obj)]
    while lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python docs/gen_api.py")
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
