"""The `tidal` command."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import sys
from pathlib import Path

import msgspec

from tidal.core.errors import ConfigError, PluginError, PluginNotFound
from tidal.core.plugin_options import NONZERO, declared, options_text
from tidal.core.plugins import KINDS, registry
from tidal.core.protocol import PROTOCOL_VERSION
from tidal.integration.signal_watch import EXIT_NOTHING_LEARNED, NOTHING_LEARNED


def _versions() -> dict[str, str]:
    out = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or ""
        if name == "tidal" or name.startswith("tidal-"):
            out[name] = dist.version
    return dict(sorted(out.items()))


def _options_line(kind: str, name: str) -> str:
    """What the recipe's `options = {...}` of this plugin takes (a weight transport: its sender's and
    receiver's)."""
    try:
        if kind == "weight_transport":
            t = registry.create(kind, name)
            return f"sender options: {options_text(t.sender_options())}\n      receiver options: {options_text(t.receiver_options())}"
        line = f"options: {options_text(registry.options(kind, name))}"
        spec = declared(registry.get(kind, name))
        acts = [f"{o} only with " + ", ".join(f"{k} = {'nonzero' if v == NONZERO else repr(v)}" for k, v in needs.items())
                for o, needs in spec.acts_with.items()]
        if acts:
            line += f"\n      acts: {'; '.join(acts)}"
        if spec.metric_only:
            line += f"\n      metric only: {', '.join(spec.metric_only)}"
        return line
    except Exception as e:  # its module does not import here: say so, keep listing
        return f"options: cannot be read here ({type(e).__name__}: {e})"


def cmd_plugins(args: argparse.Namespace) -> int:
    table = registry.table()
    kinds = [args.kind] if args.kind else list(KINDS)
    for kind in kinds:
        if kind not in table:
            print(f"unknown kind {kind!r}; kinds are: {', '.join(KINDS)}", file=sys.stderr)
            return 2
        entries = table[kind]
        print(f"{kind}:")
        if not entries:
            print("  (none installed)")
        for name, provider in entries.items():
            print(f"  {name:<24} from {provider}")
            print(f"      {_options_line(kind, name)}")
    for name, error in registry.failed.items():
        print(f"plugin {name} failed to load: {error}", file=sys.stderr)
    return 0


def cmd_version(args: argparse.Namespace) -> int:
    print(f"Tidal wire protocol {PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}")
    for name, version in _versions().items():
        print(f"{name} {version}")
    return 0


def _logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S")


def cmd_run(args: argparse.Namespace) -> int:
    # each command's own modules load when it runs, so that `tidal --help` and `tidal plugins` stay quick
    from tidal.integration.recipe import check_models, default_run_dir, load_recipe
    from tidal.integration.report import report
    from tidal.integration.resume import RunFolderBusy, check_resumable, resume_command
    from tidal.integration.run import run

    _logging(args.log_level)
    resume = Path(args.resume) if args.resume else None
    overrides = ([args.recipe] if resume is not None and args.recipe else []) + list(args.overrides)
    if resume is None and not args.recipe:
        print("tidal run: give a recipe (tidal run RECIPE.toml) or a run folder to continue "
              "(tidal run --resume RUN_DIR)", file=sys.stderr)
        return 2
    try:  # refused here: no run folder made, no process started
        if resume is not None:
            if not (resume / "config.json").is_file():
                raise ConfigError(f"{resume} holds no run to resume (no config.json); start one with "
                                  f"tidal run RECIPE run_dir={resume}")
            cfg = load_recipe(resume / "config.json", overrides, run_folder=True)
            why = check_resumable(resume, cfg.budget.versions)
            if why:
                print(f"tidal run: {why}", file=sys.stderr)
                return 0 if "completed" in why else 2
        else:
            cfg = load_recipe(args.recipe, overrides)
            folder = default_run_dir(cfg)
            if (folder / "config.json").is_file() and (folder / "metrics.jsonl").is_file():
                raise ConfigError(f"{folder} already holds a run: continue it with {resume_command(folder)} "
                                  f"(overrides may follow), or give another run_dir")
        check_models(cfg)
    except (ConfigError, PluginNotFound, PluginError) as e:  # PluginError: the pre-flight's first task is unusable
        print(f"tidal run: {e}", file=sys.stderr)
        return 2
    if args.check:  # every check a run makes before it starts anything: passed; the config it would run
        print(msgspec.json.format(msgspec.json.encode(cfg)).decode())
        print(f"tidal run --check: {resume or args.recipe} is valid; nothing was started", file=sys.stderr)
        return 0
    try:
        result = run(cfg, run_dir=resume, nproc_learner=args.nproc, resume=resume is not None, overrides=overrides)
    except (ConfigError, PluginNotFound, PluginError, RunFolderBusy) as e:  # before any role started
        print(f"tidal run: {e}", file=sys.stderr)
        return 2
    png = report(result.run_dir)
    first = f"; first trained step {result.first_step_s:.1f} s after launch" if result.first_step_s is not None else ""
    print(f"run {result.status}: {result.versions} versions in {result.wall_s / 60:.1f} min{first}; report {png}")
    if result.status.startswith(NOTHING_LEARNED):
        return EXIT_NOTHING_LEARNED
    if result.status != "completed":
        print(f"continue it with: {resume_command(result.run_dir)}")
    return 0 if result.status == "completed" else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from tidal.integration.demo import demo  # loaded when the command runs (as every command's modules)

    _logging(args.log_level)
    try:
        return demo(args.out if args.out else f"runs/demo{'' if args.task == 'arithmetic' else '-' + args.task}",
                    args.overrides, task=args.task)
    except (ConfigError, PluginNotFound, PluginError) as e:
        print(f"tidal demo: {e}", file=sys.stderr)
        return 2


def cmd_sft(args: argparse.Namespace) -> int:
    # loaded when the command runs, as every command's modules (sft_stage: torch): `tidal --help` stays quick
    from tidal.integration.recipe import check_models, load_recipe
    from tidal.integration.sft_stage import sft_stage

    _logging(args.log_level)
    try:
        cfg = load_recipe(args.recipe, args.overrides)
        check_models(cfg)
        out = Path(args.out or f"runs/{cfg.name}-sft")
        print(f"tidal sft: {cfg.model} -> {out}", flush=True)
        stage = sft_stage(cfg, out, steps=args.steps, batch=args.batch, lr=args.lr, data=args.data or None,
                          say=lambda line: print(line, flush=True))
    except (ConfigError, PluginNotFound, PluginError) as e:
        print(f"tidal sft: {e}", file=sys.stderr)
        return 2
    rest = "".join(f" {o}" for o in args.overrides if not o.startswith("model="))
    print(f"the warm-started model is {stage.out}; its RL stage: tidal run {args.recipe}{rest} model=\"{stage.out}\"")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    # loaded when the command runs, as every command's modules: `tidal --help` stays quick
    from tidal.integration.monitor import read_metrics
    from tidal.integration.report import report, summarize

    try:
        png = report(args.run_dir)
    except FileNotFoundError as e:
        print(f"tidal report: {e}", file=sys.stderr)
        return 2
    s = summarize(read_metrics(args.run_dir))
    print(f"{png}\n{s['versions']} versions, {s['samples_trained']:.0f} samples trained, {s['wall_s'] / 60:.1f} min, "
          f"lag mean {s['lag_mean']:.2f} (max {s['lag_max']})")
    from tidal.integration.samples import summary as samples_summary  # (the command's own module)

    t = samples_summary(args.run_dir)
    if t["count"]:
        print(f"{t['count']} transcripts ({t['failed']} failed) in {t['dir']}: tidal samples {args.run_dir}")
    for ev in s["eval"]:
        print(f"  eval at version {ev['version']:>4}  ({ev['elapsed_s'] / 60:5.1f} min)  accuracy {100 * ev['accuracy']:.1f}%")
    for v in s["eval_unscored"]:
        print(f"  eval at version {v:>4}  unscored: no problem could be scored (see eval/failed)")
    return 0


def cmd_samples(args: argparse.Namespace) -> int:
    # loaded when the command runs, as every command's modules: `tidal --help` stays quick
    from tidal.integration.samples import show

    if not os.path.isdir(args.run_dir):
        print(f"tidal samples: {args.run_dir} is not a folder (give the run folder `tidal run` printed)", file=sys.stderr)
        return 2
    rc, text = show(args.run_dir, version=args.version, domain=args.domain, failed=args.failed, n=args.n,
                    as_json=args.json)
    print(text, file=sys.stdout if rc == 0 else sys.stderr)
    return rc


def cmd_export(args: argparse.Namespace) -> int:
    # loaded when the command runs, as every command's modules: `tidal --help` stays quick
    from tidal.integration.export import export_run

    try:
        out = export_run(args.run_dir, args.checkpoint, args.out or None)
    except (FileNotFoundError, ValueError) as e:
        print(f"tidal export: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    # loaded when the command runs, as every command's modules: `tidal --help` stays quick
    from tidal.integration.health import format_health, run_health
    from tidal.integration.monitor import read_metrics

    root = Path(args.run_dir) if args.run_dir else None
    if root is None:
        runs = sorted((p for p in Path("runs").glob("*") if (p / "metrics.jsonl").is_file()),
                      key=lambda p: (p / "metrics.jsonl").stat().st_mtime) if Path("runs").is_dir() else []
        if not runs:
            print("no runs under ./runs; pass a run folder: tidal status RUN_DIR", file=sys.stderr)
            return 2
        root = runs[-1]
    if not (root / "final.json").is_file() and not (root / "metrics.jsonl").is_file():
        print(f"tidal status: {root} holds neither final.json nor metrics.jsonl: is it a tidal run folder "
              "(what `tidal run` printed)?", file=sys.stderr)
        return 2
    print("\n".join(format_health(run_health(root))))
    try:
        rows = read_metrics(root)
    except FileNotFoundError:
        return 0
    latest: dict[str, dict] = {}
    for r in rows:
        latest[r["source"]] = r
    if rows:
        print(f"  latest numbers ({len(rows)} metric lines):")
    for source, r in sorted(latest.items()):
        keys = [k for k in r["scalars"] if any(k.startswith(p) for p in (
            "train/version", "reward/mean", "loss/total", "eval/accuracy", "depth/ready", "rollout/samples",
            "rollout/tokens_per_s", "controller/", "staleness/lag_mean", "staleness/mismatch_kl"))]
        if keys:
            print(f"    {source:<12} " + "  ".join(f"{k}={r['scalars'][k]:.4g}" for k in keys[:8]))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tidal",
        description="Tidal: asynchronous RL post-training for LLMs.",
        epilog="Run `tidal COMMAND --help` for the options of a command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("plugins", help="list the installed plugins of every kind and who provides them")
    p.add_argument("kind", nargs="?", help=f"only this kind ({', '.join(KINDS)})")
    p.set_defaults(func=cmd_plugins)
    p = sub.add_parser("version", help="show the protocol version and the installed tidal packages")
    p.set_defaults(func=cmd_version)
    log_level = os.environ.get("TIDAL_LOG_LEVEL", "INFO")
    p = sub.add_parser(
        "run", help="run a recipe: rollout workers, buffer, learner and controller, until its budget is spent",
        description="Start every role of RECIPE.toml through its launcher (default: local processes), "
                    "show live progress, write metrics.jsonl, TensorBoard files and report.png into the run folder. "
                    "The run folder is runs/NAME-DATE-TIME under the current directory (NAME: the recipe's `name`), "
                    "or the recipe's run_dir (run_dir=PATH on the command line); it holds the roles' configs and logs, "
                    "checkpoints/ and, once the learner stops (the end of the budget, or Ctrl-C), model/: the trained "
                    "policy as a Hugging Face folder (tidal export writes one from any kept checkpoint). "
                    "A recipe with a mistake (an unknown field, a negative learning rate, a model folder that holds "
                    "no model, ...) is refused before any process starts or the run folder is made.",
        epilog="Overrides use dotted TOML syntax: workers=4 learner.backend.options.optim.lr=1e-4 "
               "budget.versions=200 mode=sync domains='[{env={name=\"countdown\"}}]'. Every plugin choice is "
               "{ name = \"...\", options = { ... } }: learner.backend.name=\"fsdp2\", "
               "learner.weights.transport.name=\"shm\". Exit codes: 0 completed; 1 interrupted, stalled or failed "
               "(final.json's status says why; tidal run --resume continues it); 2 refused before anything started; "
               "3 completed but learned nothing: almost no trained sample carried a learning signal (every group's "
               "rewards equal), see final.json's status and `signal`")
    p.add_argument("recipe", nargs="?", default="", help="the run's TOML recipe (see integration/recipes/)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value settings applied on top of the recipe")
    p.add_argument("--nproc", type=int, default=1, help="learner ranks (torch.distributed): processes on this "
                   "machine, or with launcher.name=ray one Ray actor each, on the nodes Ray picks")
    p.add_argument("--check", action="store_true",
                   help="check the recipe and overrides as a run does before it starts (fields, values, plugins "
                        "and their options, each domain's first task, model folders), print the effective config "
                        "as JSON (what the run writes to RUN_DIR/config.json) and exit: nothing is started, no run "
                        "folder made. A mistake exits 2 with its message")
    p.add_argument("--resume", metavar="RUN_DIR", default="",
                   help="continue the run in RUN_DIR (interrupted, stalled, failed, or its driver killed): its "
                        "recipe from RUN_DIR/config.json, overrides applied on top and recorded; versions, group "
                        "numbering, evaluation history and elapsed time carry on. Refused while another driver "
                        "runs that folder; a completed run has nothing to resume unless budget.versions is raised")
    p.add_argument("--log-level", default=log_level)
    p.set_defaults(func=cmd_run)
    _add_demo_command(sub)
    _add_sft_command(sub)
    _add_report_command(sub)
    _add_status_command(sub)
    _add_samples_command(sub)
    _add_export_command(sub)
    return parser


def _add_demo_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo", help="build a tiny model, warm-start it with SFT, then run async GRPO on arithmetic "
                     "(CPU, about 1 minute on 2 cores)",
        description="The whole system on one CPU machine: a locally built tiny model and tokenizer, a short SFT "
                    "warm start, then asynchronous GRPO with rollout workers (1 on 2 cores, where it is the faster "
                    "loop; 2 on more), the buffer, the learner and the controller as real processes: about 1 minute "
                    "on 2 CPU cores, most of it the warm start. Prints held-out accuracy before and after and the "
                    "report's path; the trained model is written to OUT/run/model.",
        epilog="Its RL phase is the recipe integration/recipes/arithmetic.toml (tools.toml with --task tools, "
               "selfplay.toml with --task selfplay), "
               "shipped in the package. Overrides: any recipe field (budget.versions=30 workers=1 mode=sync), "
               "model_build.* (hidden, layers, ...) and sft.* (steps, batch, lr).")
    p.add_argument("overrides", nargs="*", help="dotted.key=value settings")
    p.add_argument("--task", default="arithmetic", choices=["arithmetic", "tools", "selfplay"],
                   help="arithmetic (single turn, the default); tools: multi-turn episodes where the model learns "
                        "to call a calculator for 3x2-digit products (about 3 minutes; its RL "
                        "phase stops after 7 min at most); selfplay: the model plays nim against a pool of its "
                        "own snapshots and is evaluated by its win-rate against a scripted player (10 min)")
    p.add_argument("--out", default="", help="folder for the model, the warm start and the run "
                                             "(default runs/demo, or runs/demo-TASK)")
    p.add_argument("--log-level", default="WARNING")
    p.set_defaults(func=cmd_demo)


def _add_sft_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sft", help="warm-start the recipe's model with supervised fine-tuning (the first stage: SFT, then RL)",
        description="Fit RECIPE's model on demonstrations, the loss on the answers only, and write a model folder "
                    "that `tidal run RECIPE model=OUT` takes: RL improves only what a model sometimes gets right, "
                    "and a model that never earns a reward learns nothing from GRPO. The demonstrations are the "
                    "reference answers of the recipe's first domain (its train split; single-turn environments "
                    "whose tasks carry Task.answer) or, with --data, a JSONL file of {\"prompt\", \"completion\"} "
                    "or {\"messages\": [...]} records (the last message, the assistant's, is trained; the rest "
                    "goes through the tokenizer's chat template). Each answer ends with the recipe's first "
                    "sampling.stop. Held-out accuracy (greedy, the environment's eval split) is printed before "
                    "and after. Runs in this process (on 2 CPU cores the tiny demo model's 300 steps take ~20 s).",
        epilog="Example: tidal sft my_recipe.toml --steps 500 && tidal run my_recipe.toml model=\"runs/NAME-sft\"")
    p.add_argument("recipe", help="the run's TOML recipe: its model, tokenizer, first domain, stop and eval size")
    p.add_argument("overrides", nargs="*", help="dotted.key=value settings applied on top of the recipe")
    p.add_argument("--data", default="", help="a JSONL file of demonstrations instead of the environment's answers")
    p.add_argument("--out", default="", help="the model folder to write (default runs/NAME-sft, NAME the recipe's)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--batch", type=int, default=64, help="demonstrations per step (default 64)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate, warm-up then cosine to 10 %% "
                   "(default 1e-3: a warm start moves further than an RL step)")
    p.add_argument("--log-level", default=os.environ.get("TIDAL_LOG_LEVEL", "WARNING"))
    p.set_defaults(func=cmd_sft)


def _add_report_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "report", help="write RUN_DIR/report.png and summary.json from its metrics.jsonl",
        description="Plot a run (finished, or still going) from its metrics.jsonl: RUN_DIR/report.png (training "
                    "reward and held-out accuracy over time and samples, the lag of trained tokens, the "
                    "sampler-learner mismatch KL) and RUN_DIR/summary.json; prints the "
                    "totals and every evaluation.")
    p.add_argument("run_dir", help="the run folder (what `tidal run` printed; runs/<name>-<date>-<time> by default)")
    p.set_defaults(func=cmd_report)


def _add_status_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "status", help="a run's health and latest metrics (default: the newest under ./runs)",
        description="The run's state (running, interrupted, completed, stalled, failed: from final.json and "
                    "whether the roles in pids.json are alive), its version, restarts per role, the gate's "
                    "capacity, the buffer's depth, each role's last error and, for a run that can go on, the "
                    "`tidal run --resume RUN_DIR` command; then one line per role with its latest numbers "
                    "(learner version, reward, loss, held-out accuracy, rollout throughput, staleness), read from "
                    "RUN_DIR/metrics.jsonl. Works while the run goes on, from another terminal, and after it ended.")
    p.add_argument("run_dir", nargs="?", help="the run folder (default: the newest under ./runs)")
    p.set_defaults(func=cmd_status)


def _add_samples_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "samples", help="print what the model wrote: transcripts the rollout workers sampled (RUN_DIR/samples)",
        description="Each rollout worker writes a sample of transcripts to RUN_DIR/samples/<worker>.jsonl: every "
                    "sample of every Nth group (rollout.transcripts.every, default 10) and every episode that failed "
                    "or was split (rollout.transcripts.failed). This prints the last N that match, oldest first: a "
                    "header (domain, policy version, final reward, episode id, the error of a failed one), then "
                    "each message as `user:` / `assistant:` / `tool[name]:` with its text, the tools an action "
                    "called (→ name(...)) and its step reward. Works while the run goes on.",
        epilog="Examples: tidal samples runs/tools-20261204-101500 --failed;  "
               "tidal samples RUN_DIR --domain unitconv --version 12 -n 2;  tidal samples RUN_DIR --json | jq .reward")
    p.add_argument("run_dir", help="the run folder (what `tidal run` printed)")
    p.add_argument("--version", type=int, default=None, help="only transcripts with tokens of this policy version")
    p.add_argument("--domain", default=None, help="only this recipe domain (its name, or its env's)")
    p.add_argument("--failed", action="store_true", help="only episodes that failed (with their error)")
    p.add_argument("-n", type=int, default=5, help="how many, the newest (default 5; 0 = all)")
    p.add_argument("--json", action="store_true", help="the raw records, one JSON object a line")
    p.set_defaults(func=cmd_samples)


def _add_export_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "export", help="write a run's checkpoint as a Hugging Face model folder (transformers, vLLM)",
        description="Offline, without a running run: the weights of a kept checkpoint of RUN_DIR (its "
                    "checkpoints/ folder) as a Hugging Face folder: model.safetensors, config.json, the "
                    "tokenizer and generation config of the model the run started from. A learner that stops "
                    "cleanly (its last version, or Ctrl-C / SIGTERM to `tidal run`) already writes RUN_DIR/model. "
                    "Checkpoints of the deepspeed backend and of expert parallelism are in their own format and "
                    "cannot be exported here. LoRA (learner.lora): the checkpoint's adapters are merged into the "
                    "starting model's weights, so the folder is a whole model.",
        epilog="Example: tidal export runs/arith-20261204-101500 --checkpoint best --out /models/arith-best")
    p.add_argument("run_dir", help="the run folder")
    p.add_argument("--checkpoint", default="latest",
                   help="latest (default), a step number (kept ones: learner.keep_checkpoints = N keeps the newest N), "
                        "or best: the kept checkpoint whose version scored the highest held-out accuracy")
    p.add_argument("--out", default="", help="the folder to write (default RUN_DIR/model-<checkpoint>, e.g. model-latest)")
    p.set_defaults(func=cmd_export)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # overrides may come after an option too (`tidal run R.toml --nproc 2 workers=4`): argparse leaves those
    # unparsed once the positionals were taken, so they join the overrides here
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
