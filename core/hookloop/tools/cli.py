"""The ``hookloop`` command: ``plugins``, ``run``, ``tune``, ``plan``, ``env``, and sub-commands that plugins add.

``hookloop.tools.cli.LightningCLI`` (Lightning's ``LightningCLI``, for scripts) lives in
:mod:`hookloop.lightning_cli` and is imported from here on first use.

Plugin distributions add sub-commands through the entry-point group
``hookloop.commands``: the entry point is a callable ``main(argv: list[str]) -> int``,
imported only when its sub-command runs (``hookloop deepspeed collate ...``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from typing import Any

from hookloop.contract import checks as contract
from hookloop.tools import plot
from hookloop.tools import scaffold
from hookloop.contract import versioning
from hookloop.contract import registry
from hookloop.contract import translators
from hookloop.engine.settings import TrainerConfig, check_devices_on_cpu, env_defaults
from hookloop.contract.errors import CheckpointError, ConfigurationError, HookloopError
from hookloop.distributed.environment import ClusterEnvironment
from hookloop.distributed.launch import is_plain_interpreter, run_command
from hookloop.distributed.mesh import check_sizes, claims, parse_mesh
from hookloop.resume.rundir import RUN_ID_ENV
from hookloop.contract.sourcescan import declared_role



def _auto_or_int(text: str) -> Any:
    """``--stop-check-every-n-steps``: ``auto`` or a whole number (checked by the Trainer's settings)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        return text  # the settings' check names it, with what to give

def _build_parser(commands: dict) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hookloop",
        description="A minimal PyTorch training loop whose techniques are plugins.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("plugins", help="list installed plugins (imports no backend)")
    p.add_argument("--load", action="store_true", help="import each plugin (never its backend) and ask its role, instead of reading it from the source")

    c = sub.add_parser(
        "check",
        help="check installed plugins against the hook contract, without training",
        description=(
            "Import the named plugins (and only those) and check each: its entry point "
            "resolves, its role is declared and known, every hook implementation names a "
            "hook of the contract with arguments that hook has, its options are documented, "
            "and its distribution's dependencies are installed. Exits 1 on any problem."
        ),
    )
    c.add_argument("names", nargs="+", metavar="NAME", help="plugin names, as `hookloop plugins` lists them")

    n = sub.add_parser(
        "new-plugin",
        help="write a plugin package skeleton (code, tests, README, pyproject) to start from",
        description=(
            "Write hookloop-NAME/ (in --dir, default here): a small working plugin of the "
            "role, its entry point, a README, and tests that run the role's conformance "
            "suite. As generated, `hookloop check NAME` reports ok and the tests pass. "
            "Never overwrites: an existing hookloop-NAME/ is an error."
        ),
    )
    n.add_argument("name", metavar="NAME", help="the plugin's name, as users type it in --plugins: a lowercase identifier")
    # Not argparse choices: scaffold checks the role, so the API and the command refuse a
    # wrong one with the same message and exit status as the other commands' errors.
    n.add_argument("--role", required=True, metavar="|".join(scaffold.ROLES), help="the kind of plugin")
    n.add_argument("--dir", default=".", metavar="PATH", help="folder to write hookloop-NAME/ into (default: the current one)")

    plot.add_parser(sub)

    r = sub.add_parser(
        "run",
        help="run SCRIPT on N processes / M nodes through torch's elastic agent",
        description=(
            "Start SCRIPT through the strategy's launcher (PyTorch's elastic agent, "
            "torch.distributed.run, by default). The options become the defaults of every "
            "Trainer the script creates; arguments given in code win."
        ),
    )
    r.add_argument("-p", "--plugins", default=None,
                   help="comma-separated plugin names, e.g. ddp,amp; no:NAME blocks one (no:lightning)")
    r.add_argument("--launcher", default=None, metavar="NAME",
                   help="what starts the workers: torchrun (the default), spawn, or an installed "
                        "launcher plugin (ray, horovodrun); the same as adding NAME to --plugins")
    r.add_argument("--devices", default=None, help="processes (devices) per node: N, -1, or a list '0,2'")
    r.add_argument("--accelerator", default=None, choices=["auto", "cpu", "cuda", "gpu"])
    r.add_argument("--precision", default=None, help="32, 16-mixed, bf16-mixed")
    r.add_argument("--max-epochs", type=int, default=None)
    r.add_argument("--max-steps", type=int, default=None)
    r.add_argument("--max-time", default=None, metavar="DD:HH:MM:SS",
                   help="stop fit once training has run this long (Lightning's max_time, e.g. 00:12:00:00)")
    r.add_argument("--accumulate-grad-batches", type=int, default=None)
    r.add_argument("--global-batch-size", type=int, default=None, metavar="N",
                   help="samples per optimizer step over all data-parallel processes: the accumulation is "
                        "N / (the loader's batch_size x data-parallel processes)")
    r.add_argument("--default-root-dir", default=None)
    r.add_argument("--nodes", default=None, metavar="N|MIN:MAX",
                   help="number of machines; MIN:MAX for an elastic job (torchrun's --nnodes): it trains on "
                        "as few as MIN, and grows back to MAX when machines join")
    r.add_argument("--node-rank", type=int, default=None, help="this machine's rank, 0..nodes-1")
    r.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of node 0's rendezvous")
    r.add_argument("--rdzv-conf", default=None, metavar="KEY=VALUE,...",
                   help="torchrun's --rdzv-conf for several nodes, e.g. join_timeout=60,last_call_timeout=5 "
                        "(seconds: how long the rendezvous waits for every node, and for more after MIN)")
    r.add_argument("--max-restarts", type=int, default=None,
                   help="restarts of failed workers (default 0; 3 for an elastic job: a lost node uses one, "
                        "a node that joins none)")
    r.add_argument("--elastic-batch", default=None, choices=["global", "per-device"],
                   help="an elastic job's batch when its world size changes: global (default) keeps the "
                        "global batch (the accumulation is recomputed), per-device keeps each process's")
    r.add_argument("--run-id", default=None, metavar="ID",
                   help="this job's id (HOOKLOOP_RUN_ID): a job started again with the same id takes the run "
                        "directory its earlier attempt marked; with several nodes, torchrun's --rdzv-id "
                        "(default: the scheduler's job id)")
    r.add_argument("--process-group-timeout", type=float, default=None, metavar="SECONDS",
                   help="seconds a collective may wait before the ranks fail (default: gloo 300, nccl 600)")
    r.add_argument("--requeue-on-preemption", action="store_true", default=None,
                   help="under SLURM, requeue the job (scontrol requeue) after a SIGTERM checkpoint")
    r.add_argument("--stop-check-every-n-steps", type=_auto_or_int, default=None, metavar="K",
                   help="the processes agree on stopping (SIGTERM, --max-time) every K optimizer steps, "
                        "without waiting; a stop comes K to 2K steps after the signal (default auto: about "
                        "once a second of steps)")
    r.add_argument("--mesh", default=None, metavar="DIM=SIZE,...",
                   help="the device mesh's sizes, e.g. dp_shard=2,tp=2 (product = processes; a claimed "
                        "dimension left out takes the rest); default: HOOKLOOP_MESH")
    r.add_argument("--plugin-option", action="append", default=[], metavar="PLUGIN.OPTION=VALUE",
                   help="an option of a plugin, e.g. amp.init_scale=1024 (repeatable; values read as JSON)")
    r.add_argument("script", help="the training script")
    r.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")

    _add_tune_parser(sub, r)
    pl = sub.add_parser(
        "plan", help="print what the plugins would do to SCRIPT's model (tp's plan), without training",
        description=("Run SCRIPT in one process with `hookloop run`'s options; its first Trainer.fit builds the "
                     "module (configure_model), prints every plugin's answer to the describe_model hook (the tp "
                     "plugin: the plan it would apply, for the tp size of --devices/--mesh) and ends the script "
                     "there: no process group, no run directory, no training."))
    for action in r._actions:  # hookloop run's options, then SCRIPT and its arguments
        if not isinstance(action, argparse._HelpAction):
            pl._add_action(action)

    e = sub.add_parser(
        "env", help="print this process's place in a job, as the launcher's variables say (torchrun, LSF, mpirun, Kubeflow, SLURM)",
        description=("Read the launcher's variables as a strategy does (hookloop.distributed.environment) and print the "
                     "source, world size, ranks, rendezvous address and port, and every variable read. Run it where "
                     "the training would run: `mpirun -np 2 hookloop env`, `srun hookloop env`. Exits 2, with the "
                     "reason, when the variables contradict each other."))
    e.add_argument("--json", action="store_true", help="print one JSON object instead of lines")

    for name in sorted(commands):
        sub.add_parser(name, help=f"sub-command from {commands[name].value.split(':')[0]}", add_help=False)
    return parser


def _add_tune_parser(sub, run_parser: argparse.ArgumentParser) -> None:
    """``hookloop tune lr|batch-size [finder options] [run options] SCRIPT``: ``hookloop run``
    whose Trainer's first ``fit`` runs the finder (:mod:`hookloop.tuner`) instead of
    training, prints the suggestion and the table on global rank 0, and ends the script."""
    t = sub.add_parser(
        "tune", help="find a learning rate or a batch size for SCRIPT (its first fit), on 1 or N processes",
        description=("Run SCRIPT as `hookloop run` does; its first Trainer.fit runs hookloop.Tuner's "
                     "lr_find or scale_batch_size (every rank agreeing) instead of training, prints the "
                     "suggestion and the table, and the script ends there."))
    finders = t.add_subparsers(dest="finder", metavar="FINDER", required=True)
    lr = finders.add_parser("lr", help="the learning-rate range test (Tuner.lr_find)")
    lr.add_argument("--min-lr", type=float, default=1e-8)
    lr.add_argument("--max-lr", type=float, default=1.0)
    lr.add_argument("--num-training", type=int, default=100, help="steps of the range test")
    lr.add_argument("--mode", choices=["exponential", "linear"], default="exponential")
    lr.add_argument("--early-stop-threshold", type=float, default=4.0,
                    help="stop when the smoothed loss passes this times the best (0: never)")
    bs = finders.add_parser("batch-size", help="the largest batch size that fits (Tuner.scale_batch_size)")
    bs.add_argument("--mode", choices=["power", "binsearch"], default="power")
    bs.add_argument("--steps-per-trial", type=int, default=3)
    bs.add_argument("--init-val", type=int, default=2)
    bs.add_argument("--max-trials", type=int, default=25)
    bs.add_argument("--max-val", type=int, default=8192, help="the largest size tried (on the CPU nothing runs out of memory)")
    bs.add_argument("--batch-arg-name", default="batch_size")
    for parser in (lr, bs):
        for action in run_parser._actions:  # hookloop run's options, then SCRIPT and its arguments
            if not isinstance(action, argparse._HelpAction):
                parser._add_action(action)


def cmd_tune(args) -> int:
    import json
    import os

    if args.finder == "lr":
        options = {"min_lr": args.min_lr, "max_lr": args.max_lr, "num_training": args.num_training,
                   "mode": args.mode, "early_stop_threshold": args.early_stop_threshold or None}
    else:
        options = {"mode": args.mode, "steps_per_trial": args.steps_per_trial, "init_val": args.init_val,
                   "max_trials": args.max_trials, "max_val": args.max_val, "batch_arg_name": args.batch_arg_name}
    check_script(args.script)
    # for the launched script only: an in-process caller (hookloop.cli.main) keeps its environment
    previous = os.environ.get("HOOKLOOP_TUNE")
    os.environ["HOOKLOOP_TUNE"] = json.dumps({"finder": args.finder, "options": options})
    try:
        return cmd_run(args)
    finally:
        if previous is None:
            os.environ.pop("HOOKLOOP_TUNE", None)
        else:
            os.environ["HOOKLOOP_TUNE"] = previous


def _parse_devices(text: str | None):
    if text is None:
        return None
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    if text == "auto":
        return text
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    parts = [t.strip() for t in text.split(",") if t.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        return text  # '2.5', 'two': the settings' check says what to give instead
    return [int(p) for p in parts]


def cmd_check(args) -> int:
    failed = False
    for name in args.names:
        plugin, problems = contract.check(name)
        if not problems:
            print(f"{name}: ok")
            note = versioning.range_note(plugin)  # accepted; said so the author can declare one
            if note:
                print(f"  note: {note}")
            continue
        failed = True
        print(f"{name}: {len(problems)} problem(s)")
        for problem in problems:
            print(f"  - {problem.where}: {problem.message}\n    fix: {problem.fix}")
    return 1 if failed else 0


def cmd_new_plugin(args) -> int:
    package = scaffold.new_plugin(args.name, args.role, args.dir)
    print(scaffold.summary(package, args.name))
    return 0


def cmd_plugins(args) -> int:
    infos = registry.installed_plugins()
    if not infos:
        print("no hookloop plugins are installed (entry-point group 'hookloop.plugins')")
        return 0
    rows = [("NAME", "DISTRIBUTION", "VERSION", "ROLE", "DEPENDENCIES")]
    problems: dict[str, list] = {}
    for name in sorted(infos):
        info = infos[name]
        missing = info.missing_requirements()
        deps = "ok" if not missing else "missing: " + ", ".join(missing)
        # Read from the source without running it; --load imports the plugin to ask it.
        role = declared_role(info.value) or "?"
        if args.load:
            plugin, found = contract.check(name)
            if plugin is not None and not contract.role_problems(plugin, name):
                role = registry.plugin_role(plugin)
            if found:
                problems[name] = found
                deps = f"{len(found)} problem(s), see below"
        built = info.build_status()  # a backend installed but not compiled, with the fix
        if built:
            deps = f"not built: {built}" if deps == "ok" else f"{deps}; not built: {built}"
        rows.append((name, info.distribution or "?", info.version or "?", role, deps))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
    for name, found in problems.items():
        print(f"\n{name}:")
        for problem in found:
            print(f"  - {problem.where}: {problem.message}\n    fix: {problem.fix}")
    return 1 if problems else 0


def check_script(script: str) -> None:
    """``hookloop run SCRIPT``: the script must be a file, checked before any process starts
    (the workers would each fail to open it); a close name in its folder is suggested."""
    import difflib
    import os
    from pathlib import Path

    path = Path(script)
    if path.is_file():
        return
    if path.is_dir():
        raise ConfigurationError(
            f"the script {script!r} is a folder, not a Python file: give the path of the training script: "
            f"hookloop run [OPTIONS] SCRIPT [ARGS]")
    folder = path.parent
    try:
        names = sorted(entry.name for entry in os.scandir(folder) if entry.is_file())
    except OSError:
        names = []
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.75)
    suggestion = (close[0] if str(folder) == "." else str(folder / close[0])) if close else None
    hint = f"; did you mean {suggestion!r}?" if suggestion else "."
    raise ConfigurationError(
        f"the script {script!r} does not exist (in {folder.absolute() if str(folder) != '.' else Path.cwd()}){hint} "
        f"Give the path of the training script: hookloop run [OPTIONS] SCRIPT [ARGS]")


def cmd_plan(args) -> int:
    """``hookloop plan``: ``hookloop run``'s checks, then SCRIPT in one plain interpreter
    whose first ``fit`` describes the model and ends (``HOOKLOOP_PLAN``)."""
    from hookloop.engine.trainer import PLAN_ENV

    previous = os.environ.get(PLAN_ENV)
    os.environ[PLAN_ENV] = "1"  # for the script's process only: an in-process caller keeps its environment
    try:
        return cmd_run(args, one_process=True)
    finally:
        if previous is None:
            os.environ.pop(PLAN_ENV, None)
        else:
            os.environ[PLAN_ENV] = previous


def cmd_run(args, one_process: bool = False) -> int:
    if args.run_id:
        os.environ[RUN_ID_ENV] = args.run_id  # this job's id, for every process it starts
    settings = env_defaults()
    explicit = {
        "devices": _parse_devices(args.devices),
        "accelerator": args.accelerator,
        "precision": args.precision,
        "max_epochs": args.max_epochs,
        "max_steps": args.max_steps,
        "max_time": args.max_time,
        "accumulate_grad_batches": args.accumulate_grad_batches,
        "global_batch_size": args.global_batch_size,
        "default_root_dir": args.default_root_dir,
        "nodes": args.nodes,
        "node_rank": args.node_rank,
        "rdzv_endpoint": args.rdzv_endpoint,
        "rdzv_conf": args.rdzv_conf,
        "max_restarts": args.max_restarts,
        "elastic_batch": args.elastic_batch,
        "process_group_timeout": args.process_group_timeout,
        "requeue_on_preemption": args.requeue_on_preemption,
        "stop_check_every_n_steps": args.stop_check_every_n_steps,
    }
    settings.update({k: v for k, v in explicit.items() if v is not None})
    if args.plugins is not None:
        settings["plugins"] = registry.split_names(args.plugins)
    if args.launcher is not None:
        settings["plugins"] = [*settings.get("plugins", []), args.launcher]
    if args.mesh is not None:
        settings["mesh"] = parse_mesh(args.mesh, "--mesh")
    if args.plugin_option:
        settings["plugin_options"] = registry.merge_plugin_options(
            settings.get("plugin_options"), registry.parse_plugin_options(args.plugin_option))
    config = TrainerConfig(**settings)
    config.validate()
    if config.max_time is not None:  # a bad --max-time fails here, not in every worker
        from hookloop.observers.timer import parse_duration

        parse_duration(config.max_time, "--max-time ...")
    # Load the named plugins (their code, not their backends) to ask how to launch.
    from hookloop.engine.defaults import Defaults

    # `-p lightning` / `no:lightning`: a compatibility layer (contract.translators), which the
    # script's Trainer turns on or off; not a plugin to load here
    compat = {t.name for t in translators.registered()}
    names = [n for n in list(config.plugins) + registry.environment_plugins(builtin=compat) if n not in compat]
    options = registry.merge_plugin_options(registry.environment_plugin_options(), config.plugin_options)
    chosen = [registry.apply_options(p, options) for p in registry.collect(names, options=options)]
    chosen += registry.default_launcher(chosen, options)  # the strategy's, when none is named
    registry.check_composition(chosen)
    if config.mesh and any(registry.plugin_role(p) == "strategy" for p in chosen):
        check_sizes(config.mesh, claims(chosen))  # a dimension no plugin claims: before launching
    pm = registry.make_plugin_manager(chosen, Defaults())
    # The devices plugin chooses (and may narrow config.devices) before processes are counted.
    pm.hook.select_devices(config=config)
    check_devices_on_cpu(config)  # after the devices plugin resolved the accelerator
    check_script(args.script)  # after the options (their errors first), before any process starts
    world = config.num_processes() * config.nodes
    if one_process or (world > 1 and not any(registry.plugin_role(p) == "strategy" for p in chosen)):
        # The script may name its strategy in code (Trainer(plugins=["ddp"])): plugins from
        # code and the command line combine, and only the script's Trainer knows them all.
        # So start it as `python train.py` starts: one plain interpreter, not a launched
        # worker, whose fit re-launches through that strategy's launcher with these options
        # as its defaults. A script that names no strategy either is refused by its Trainer.
        cmd = [sys.executable, args.script, *args.script_args]
    else:
        cmd = pm.hook.launch_command(config=config, script=args.script, script_args=list(args.script_args))
    return run_command(cmd, settings, workers=not is_plain_interpreter(cmd, args.script))


def collate_command(strategy: str, collate, argv: list[str] | None, *, help: str, description: str,
                    tag_help: str, kind: str = "") -> int:
    """``hookloop STRATEGY collate CHECKPOINT_DIR OUTPUT [--tag TAG]``: the sub-command of a
    strategy whose checkpoints are directories of shards (deepspeed, fsdp).

    A plugin's ``hookloop.commands`` entry point calls it with its own
    ``collate(checkpoint_dir, output, tag=None) -> state dict``; a ``CheckpointError`` is
    printed as ``hookloop STRATEGY: error: ...`` with exit status 2. ``kind`` is added to
    the summary line (e.g. ``", fp32"``). Returns the exit status.
    """
    parser = argparse.ArgumentParser(prog=f"hookloop {strategy}",
                                     description=f"Tools for checkpoints written by the {strategy} strategy.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    c = sub.add_parser("collate", help=help, description=description)
    c.add_argument("checkpoint_dir", help="the checkpoint directory (e.g. checkpoints/last.ckpt)")
    c.add_argument("output", help="the .pt file to write")
    c.add_argument("--tag", default=None, help=tag_help)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        state = collate(args.checkpoint_dir, args.output, tag=args.tag)
    except CheckpointError as exc:
        print(f"hookloop {strategy}: error: {exc}", file=sys.stderr)
        return 2
    n = sum(v.numel() for v in state.values() if hasattr(v, "numel"))
    print(f"wrote {args.output}: {len(state)} tensors, {n} elements{kind} (optimizer state dropped)")
    return 0


def cmd_env(args) -> int:
    """``hookloop env``: what :meth:`ClusterEnvironment.detect` reads here."""
    cluster = ClusterEnvironment.detect()
    if args.json:
        fields = {name: getattr(cluster, name) for name in (
            "source", "world_size", "global_rank", "local_rank", "local_world_size", "node_rank",
            "master_addr", "master_port")}
        print(json.dumps({**fields, "variables": dict(cluster.variables)}, indent=2))
        return 0
    rendezvous = (f"{cluster.master_addr or '(unset)'}:{cluster.master_port or '(unset)'}"
                  if cluster.world_size > 1 or cluster.master_addr else "none (a world of one)")
    print(f"source:       {cluster.source}")
    print(f"world size:   {cluster.world_size}")
    print(f"global rank:  {cluster.global_rank}")
    print(f"local rank:   {cluster.local_rank} of {cluster.local_world_size} on this node")
    print(f"node rank:    {cluster.node_rank}")
    print(f"rendezvous:   {rendezvous}")
    print("variables read:" + ("" if cluster.variables else " none"))
    for name, value in cluster.variables:
        print(f"  {name}={value}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = registry.installed_commands()
    if argv and argv[0] in commands and argv[0] not in ("plugins", "run"):
        try:
            function = commands[argv[0]].load()
        except ImportError as exc:
            print(f"hookloop: the {argv[0]!r} command could not be imported: {exc}", file=sys.stderr)
            return 2
        params = inspect.signature(function).parameters
        return int(function(argv[1:]) if params else function() or 0)
    parser = _build_parser(commands)
    args = parser.parse_args(argv)
    try:
        if args.command in ("plugins", "check"):  # every plugin checked: the metadata read once
            with registry.one_scan():
                return cmd_plugins(args) if args.command == "plugins" else cmd_check(args)
        if args.command == "new-plugin":
            return cmd_new_plugin(args)
        if args.command == "run":
            return cmd_run(args)
        if args.command == "tune":
            return cmd_tune(args)
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "plot":
            return plot.command(args)
        if args.command == "env":
            return cmd_env(args)
    except HookloopError as exc:
        print(f"hookloop: error: {exc}", file=sys.stderr)
        return 2
    parser.print_help()
    return 0 if args.command is None and argv else 1


def __getattr__(name: str):
    # Lightning's import path (lightning.pytorch.cli.LightningCLI); jsonargparse is optional.
    if name == "LightningCLI":
        from hookloop.lightning.cli import LightningCLI

        return LightningCLI
    raise AttributeError(f"module 'hookloop.cli' has no attribute {name!r}")


if __name__ == "__main__":
    raise SystemExit(main())
