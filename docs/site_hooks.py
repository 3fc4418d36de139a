"""mkdocs hooks: the reference pages generated at build time (mkdocs.yml, ``hooks:``).

* ``reference/hook-specs.md``: every hook specification of the contract, read from the
  module itself: its phase (the module's ``# N. Title`` banners), its signature with
  whatever annotations the spec carries, its markers (``firstresult``, ``historic``,
  ``warn_on_impl``) and its docstring.
* ``reference/cli.md``: ``hookloop --help`` and every sub-command's ``--help``, as the
  entry point prints them (run in this process, whichever module holds the parser).

Nothing here is written to ``docs/``: the pages exist only in the built site.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import os
import re
from types import ModuleType
from typing import Any

from mkdocs.structure.files import File, Files

HOOK_PAGE = "reference/hook-specs.md"
CLI_PAGE = "reference/cli.md"


def hookspec_module() -> ModuleType:
    """The hook specifications (``hookloop.contract.hookspecs``)."""
    return importlib.import_module("hookloop.contract.hookspecs")


def rst_to_markdown(text: str) -> str:
    """The docstrings' reStructuredText, as far as they use it, in Markdown."""
    text = re.sub(r":(?:class|func|meth|attr|mod|data|exc):`~?([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    lines: list[str] = []
    in_field = False
    for line in text.splitlines():
        field = re.match(r":(param|returns?|raises?)\s*([^:]*):\s*(.*)", line)
        if field:
            kind, name, rest = field.groups()
            label = f"`{name.strip()}`" if kind == "param" else kind.rstrip("s").capitalize() + "s"
            lines.append(f"- **{label}**: {rest}")
            in_field = True
        elif in_field and line.startswith("    "):
            lines.append("  " + line.strip())
        else:
            in_field = False if line.strip() == "" or not line.startswith(" ") else in_field
            lines.append(line)
    return "\n".join(lines)


def hook_specs_page() -> str:
    module = hookspec_module()
    source = inspect.getsource(module)
    phases: dict[str, str] = {}  # hook name -> phase title
    phase = "Hooks"
    for line in source.splitlines():
        banner = re.match(r"# (\d+\. .+)$", line)
        if banner:
            phase = banner.group(1)
        defined = re.match(r"def (\w+)\(", line)
        if defined:
            phases[defined.group(1)] = phase
    specs = [(name, obj) for name, obj in vars(module).items()
             if inspect.isfunction(obj) and hasattr(obj, "hookloop_spec")]
    intro = rst_to_markdown(inspect.cleandoc(module.__doc__ or ""))
    out = ["# Hook specifications", "",
           f"All {len(specs)} hooks of the contract, generated from `{module.__name__}` when the "
           "site is built: each signature as the specification declares it (its type "
           "annotations included), its markers and its docstring. The order in which the "
           "loop calls them, and which in-tree plugin implements which, is "
           "[Hooks and their order](../hooks.md).", "", intro, ""]
    current = None
    for name, function in specs:
        if phases.get(name) != current:
            current = phases.get(name, "Hooks")
            out += [f"## {current}", ""]
        marks = [key for key, value in sorted(function.hookloop_spec.items())
                 if value is True]
        signature = str(inspect.signature(function))
        out += [f"### `{name}`", "", "```python", f"def {name}{signature}", "```", ""]
        if marks:
            out += ["Markers: " + ", ".join(f"`{m}`" for m in marks), ""]
        out += [rst_to_markdown(inspect.getdoc(function) or "(no docstring)"), ""]
    return "\n".join(out)


def _cli_main() -> Any:
    """``hookloop``'s entry point (``hookloop.tools.cli.main``)."""
    return importlib.import_module("hookloop.tools.cli").main


def _help(args: list[str]) -> tuple[list[str], str]:
    """What ``hookloop ARGS --help`` prints, run in this process (argparse's help exits)."""
    out = io.StringIO()
    os.environ["COLUMNS"] = "100"
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            _cli_main()([*args, "--help"])
        except SystemExit:
            pass
    return args, out.getvalue()


def _sub_commands(help_text: str) -> list[str]:
    """The COMMAND names of an argparse help text (its indented, lower-case first words)."""
    section = help_text.split("positional arguments:", 1)[-1].split("options:", 1)[0]
    return [m.group(1) for m in re.finditer(r"^ {4}([a-z][\w-]*)", section, re.M)]


def cli_page() -> str:
    top = _help([])[1]
    commands = [[name] for name in _sub_commands(top)]
    helps = [_help(args) for args in commands]
    helps += [_help([*args, name]) for args, text in list(helps)
              if args[0] in ("tune", "deepspeed", "fsdp") for name in _sub_commands(text)]
    helps.sort(key=lambda item: item[0])
    out = ["# The command line", "",
           "Generated when the site is built from `hookloop --help` and each sub-command's "
           "`--help` (the sub-commands of installed plugins included).", "",
           "```text", top.rstrip(), "```", ""]
    for args, text in helps:
        out += [f"## `hookloop {' '.join(args)}`", "", "```text", text.rstrip(), "```", ""]
    return "\n".join(out)


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, HOOK_PAGE, content=hook_specs_page()))
    files.append(File.generated(config, CLI_PAGE, content=cli_page()))
    return files
