"""``hookloop new-plugin``: the skeleton of a plugin package, one per role.

:func:`new_plugin` writes ``hookloop-<name>/`` with a small plugin that works as
generated (``hookloop check <name>`` reports ok and its role's conformance suite passes),
so an author starts from green and changes one thing at a time::

    hookloop-<name>/
        pyproject.toml                   the distribution and its entry point
        README.md                        install, enable, options, test, publish
        src/hookloop_<name>/__init__.py  the plugin
        tests/test_<name>.py             the role's conformance suite (hookloop.testing)

The package is written into a temporary folder beside the target and renamed into place
at the end, so a failure leaves nothing behind that would block the next attempt.
"""

from __future__ import annotations

import difflib
import keyword
import os
import re
import shutil
import uuid
from pathlib import Path
from importlib import resources
from string import Template

from hookloop.contract.errors import ConfigurationError

#: The roles ``new-plugin`` writes a skeleton for.
ROLES = ("strategy", "precision", "observer", "devices", "extension")
#: A plugin name: what users type in ``--plugins``, and the suffix of the module
#: ``hookloop_<name>``, so it must be a Python identifier; lowercase, as entry-point
#: names are compared as typed.
NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*")


# ---------------------------------------------------------------------------------------
# The files: package data, ``hookloop/tools/templates/*.tmpl``, read as they are.
# ``string.Template`` rather than ``str.format``: the generated code is full of braces
# (dicts, f-strings) that would all need doubling.
# ---------------------------------------------------------------------------------------


def _template(name: str) -> Template:
    """The template ``templates/<name>`` of this package (package data)."""
    return Template(resources.files("hookloop.tools").joinpath("templates", name).read_text(encoding="utf-8"))


PYPROJECT = _template("pyproject.toml.tmpl")

README = _template("README.md.tmpl")

TEST = _template("test_plugin.py.tmpl")

STRATEGY = _template("strategy.py.tmpl")

PRECISION = _template("precision.py.tmpl")

OBSERVER = _template("observer.py.tmpl")

DEVICES = _template("devices.py.tmpl")

EXTENSION = _template("extension.py.tmpl")

#: What differs between the roles: the code, the summary and option of the README, the
#: conformance suite and its settings, and what the package depends on besides hookloop.
_ROLE_FILES = {
    "strategy": dict(
        code=STRATEGY,
        description="A data-parallel strategy for hookloop, built on hookloop-ddp",
        summary="A data-parallel strategy built on hookloop-ddp's `DDP`: one process per device,\n"
                "gradients all-reduced by DistributedDataParallel, wrapped by its own `configure_ddp`.",
        use=Template("""\
    hookloop run --plugins $name --devices 2 train.py
    # or in code:
    Trainer(plugins=["$name"], devices=2)
    Trainer(plugins=[hookloop.plugin("$name", verbose=True)], devices=2)
"""),
        example="verbose=True",
        options="- `verbose` (False): print, on global rank 0, which wrapper `configure_ddp` put\n"
                "  around the model.\n- every option of `ddp` (`process_group_backend`, "
                "`find_unused_parameters`, `timeout` ...).\n",
        suite="StrategyConformance",
        attributes="",
        # The base class comes from hookloop-ddp; hookloop itself is its dependency too.
        requires=["hookloop-ddp"],
    ),
    "precision": dict(
        code=PRECISION,
        description="bf16 mixed precision (autocast) for hookloop",
        summary="bf16 mixed precision: with `--precision bf16-mixed` every step runs under\n"
                "`torch.autocast(dtype=torch.bfloat16)`; weights and optimizer stay fp32.",
        use=Template("""\
    hookloop run --plugins $name --precision bf16-mixed train.py
    # or in code:
    Trainer(plugins=["$name"], precision="bf16-mixed")
"""),
        example="cache_enabled=False",
        options="- `cache_enabled` (True): passed to `torch.autocast`; False saves the memory of\n"
                "  the bf16 weight copies a step makes.\n",
        suite="PrecisionConformance",
        attributes='    precision = "bf16-mixed"  # the setting the plugin applies\n',
        requires=[],
    ),
    "observer": dict(
        code=OBSERVER,
        description="Counts the training batches and epochs of a hookloop run",
        summary="An observer that counts the training batches and epochs of a run, prints the\n"
                "counts every `every` batches, and keeps them in checkpoints.",
        use=Template("""\
    hookloop run --plugins $name --plugin-option $name.every=10 train.py
    # or in code:
    Trainer(plugins=[hookloop.plugin("$name", every=10)])
"""),
        example="every=10",
        options="- `every` (0): print the counts on global rank 0 every `every` training batches;\n"
                "  0 never does.\n",
        suite="ObserverConformance",
        attributes="",
        requires=[],
    ),
    "devices": dict(
        code=DEVICES,
        description="Chooses the first GPUs (or the CPU) of a hookloop run",
        summary="A devices plugin: the run uses the first `count` GPUs, one process each, or the\n"
                "CPU on a machine without CUDA.",
        use=Template("""\
    hookloop run --plugins $name train.py
    # the first 2 GPUs, one process each (run by a strategy: ddp here):
    hookloop run --plugins $name,ddp --plugin-option $name.count=2 train.py
    # or in code:
    Trainer(plugins=[hookloop.plugin("$name", count=2), "ddp"])
"""),
        example="count=2",
        options="- `count` (None): how many GPUs, the first ones; None takes as many as `devices`\n"
                "  asks for.\n",
        suite="DevicesConformance",
        attributes="",
        requires=[],
    ),
    "extension": dict(
        code=EXTENSION,
        description="A linear learning-rate warm-up for hookloop",
        summary="An extension that warms the learning rates up linearly over the first\n"
                "`warmup_steps` optimizer steps, and keeps its step count in checkpoints.",
        use=Template("""\
    hookloop run --plugins $name --plugin-option $name.warmup_steps=100 train.py
    # or in code:
    Trainer(plugins=[hookloop.plugin("$name", warmup_steps=100)])
"""),
        example="warmup_steps=100",
        options="- `warmup_steps` (20): the optimizer steps the warm-up lasts.\n",
        suite="ExtensionConformance",
        attributes="",
        requires=[],
    ),
}


# ---------------------------------------------------------------------------------------
# Checking the request
# ---------------------------------------------------------------------------------------


def class_name(name: str) -> str:
    """The plugin's class name for ``name``: ``my_plugin`` -> ``MyPlugin``."""
    cls = "".join(part[:1].upper() + part[1:] for part in name.split("_") if part)
    # none/true/false would give None/True/False, which cannot name a class.
    return cls + "Plugin" if keyword.iskeyword(cls) else cls


def check_name(name: str) -> None:
    """Raise :class:`ConfigurationError` unless ``name`` can name a new plugin."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        suggestion = re.sub(r"[^a-z0-9_]+", "_", str(name).strip().lower()).strip("_")
        suggestion = re.sub(r"^[0-9_]+", "", suggestion)
        hint = f" (e.g. {suggestion!r})" if suggestion and suggestion != name else ""
        raise ConfigurationError(
            f"plugin name {name!r} is not a lowercase identifier: use letters a-z, digits and "
            f"underscores, starting with a letter{hint}. It is what users type in --plugins, and "
            f"the package is hookloop_<name>"
        )
    if name == "hookloop" or name.startswith("hookloop_"):
        rest = name[len("hookloop"):].lstrip("_")
        raise ConfigurationError(
            f"plugin name {name!r} starts with 'hookloop', but the distribution is named "
            f"hookloop-<name> already: use {rest!r}" if rest else
            f"plugin name {name!r} would make a distribution named hookloop-hookloop: pick the "
            f"name of your technique"
        )
    _check_not_taken(name)


def _check_not_taken(name: str) -> None:
    # Two distributions registering one entry-point name make `--plugins NAME` load
    # whichever Python finds first, and hookloop_<name> would shadow (or be shadowed by)
    # the installed plugin's module. hookloop's own plugins are named hookloop-<name>
    # too, so an installed hookloop-<name> cannot be told from an earlier run of this
    # command: both are refused, the fix naming both.
    from hookloop.contract.registry import installed_plugins

    info = installed_plugins().get(name)
    if info is None:
        return
    distribution = info.distribution or info.value
    fix = "pick another name (`hookloop plugins` lists the names taken)"
    if re.sub(r"[-_.]+", "-", distribution).lower() == f"hookloop-{name}".replace("_", "-"):
        fix += f", or, if {distribution} is your own earlier package, pip uninstall {distribution} first"
    raise ConfigurationError(f"a plugin named {name!r} is installed already, from {distribution}: {fix}")


def check_role(role: str) -> None:
    """Raise :class:`ConfigurationError` unless ``new-plugin`` writes ``role``."""
    if role in ROLES:
        return
    close = difflib.get_close_matches(str(role), ROLES, n=1)
    raise ConfigurationError(
        f"role {role!r} is not one new-plugin writes"
        + (f" (did you mean {close[0]!r}?)" if close else "")
        + f": use --role {'|'.join(ROLES)}"
    )


# ---------------------------------------------------------------------------------------
# Writing the package
# ---------------------------------------------------------------------------------------


def render(name: str, role: str) -> dict[str, str]:
    """The files of the package for ``name`` and ``role``: ``{relative path: text}``."""
    check_role(role)
    spec = _ROLE_FILES[role]
    cls = class_name(name)
    values = dict(name=name, role=role, cls=cls, suite=spec["suite"], attributes=spec["attributes"],
                  description=spec["description"], summary=spec["summary"],
                  example=spec["example"], options=spec["options"],
                  dependencies=", ".join(f'"{r}"' for r in ["hookloop", *spec["requires"]]))
    values["use"] = spec["use"].substitute(values)
    return {
        "pyproject.toml": PYPROJECT.substitute(values),
        "README.md": README.substitute(values),
        f"src/hookloop_{name}/__init__.py": spec["code"].substitute(values),
        f"tests/test_{name}.py": TEST.substitute(values),
    }


def new_plugin(name: str, role: str, directory: str | os.PathLike | None = None) -> Path:
    """Write the package ``hookloop-<name>/`` for a plugin of ``role`` into ``directory``
    (default: the current one) and return its path.

    Raises :class:`ConfigurationError`, before writing anything, for a name that is not
    a lowercase identifier or is taken by an installed plugin, a role other than
    strategy/precision/observer/devices/extension, or a target folder that exists already.
    """
    check_name(name)
    check_role(role)
    parent = Path(directory if directory is not None else ".")
    if parent.exists() and not parent.is_dir():
        raise ConfigurationError(
            f"{str(parent)!r} is a file, not a folder: give (--dir) the folder to write hookloop-{name}/ into"
        )
    target = parent / f"hookloop-{name}"
    if target.exists():
        raise ConfigurationError(
            f"{str(target)!r} exists already; new-plugin never overwrites: remove it, or write "
            f"elsewhere with --dir PATH"
        )
    files = render(name, role)
    parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: its folder is private (0700), and the package gets the
    # user's usual permissions.
    staging = parent / f".hookloop-{name}-{uuid.uuid4().hex[:8]}.partial"
    staging.mkdir()
    try:
        for relative, text in files.items():
            path = staging / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def summary(package: Path, name: str) -> str:
    """What :func:`new_plugin` wrote into ``package`` and the commands to run next."""
    written = sorted(p.relative_to(package).as_posix() for p in package.rglob("*") if p.is_file())
    lines = [f"wrote {package}/"] + [f"  {path}" for path in written]
    steps = [
        (f"pip install -e {package}", "install it: registers the plugin's entry point"),
        (f"hookloop check {name}", "the hook contract, without training"),
        (f"pytest {package / 'tests'}", "its role's conformance suite (needs pytest)"),
    ]
    width = max(len(command) for command, _ in steps)
    lines += ["next:"] + [f"  {command.ljust(width)}  # {why}" for command, why in steps]
    return "\n".join(lines)
