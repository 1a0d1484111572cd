"""`mugrpo`: the command line of the μ-GRPO stack.

    mugrpo train --config configs/demo_cpu.yaml --run-dir runs/demo [section.key=value ...]
    mugrpo train --resume runs/demo
    mugrpo generate --run-dir runs/demo --stage 1          # phase 1 of one stage only (also under torchrun)
    torchrun --nproc_per_node 2 -m megatron_mugrpo.cli train --config configs/demo_async_cpu.yaml --run-dir runs/async
    mugrpo optimize --run-dir runs/demo --stage 1          # phase 2 only, on the stored D_1
    mugrpo eval --run-dir runs/demo [--checkpoint STEP_DIR]
    mugrpo score --config C --data FILE --responses RESP.jsonl    # given responses through the reward
    mugrpo report runs/mu_grpo runs/grpo --out reports/cmp
    mugrpo sweep experiments/f1_mu_vs_grpo.yaml --out runs/sweeps/f1 --parallel 2
    mugrpo convert {hf-to-megatron,megatron-to-hf,verify} ...
    mugrpo plan --config configs/paper/qwen2.5_math_7b__mu_grpo.yaml --gpus 8 --gpu h100 [--json]
    mugrpo serve-search --corpus corpus.jsonl --port 8000   # BM25 retrieval for env.search.url

Multi-GPU and multi-node runs go through launch/torchrun.sh and launch/slurm.sbatch, which call
`python -m megatron_mugrpo.cli train ...` on every rank. Errors in the input (config, run
directory, checkpoint, data) print one `error:` line and exit with status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_mugrpo.asynchronous.liveness import RankFailedError
from megatron_mugrpo.errors import InputError
from megatron_mugrpo.loop import preemption
from megatron_mugrpo.loop.opening import Opening

if TYPE_CHECKING:
    from megatron_mugrpo.asynchronous.roles import ProcessRole
    from megatron_mugrpo.config import RunConfig
    from megatron_mugrpo.rundir import Claim

EXIT_BAD_INPUT = 2
EXIT_RANK_FAILED = 1


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="run YAML under configs/ (e.g. configs/demo_cpu.yaml)")
    parser.add_argument(
        "overrides",
        nargs="*",
        help="dotted overrides applied after the YAML, e.g. algo.mu_grpo.clip_high=5 stages.num_stages=2",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mugrpo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    train = verbs.add_parser(
        "train",
        help="run the staged loop (generate D_k → μ updates → checkpoint → eval, per stage)",
        description="Run all stages. With --resume, continue RUN_DIR from its latest checkpoint and its "
        "stored rollout datasets (a complete D_k is never regenerated).",
    )
    _add_config_args(train)
    train.add_argument("--run-dir", type=Path, help="directory for everything the run writes")
    train.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue an existing run directory")

    for name, text in (
        ("generate", "phase 1 only: generate (or finish) the rollout dataset D_k of one stage"),
        ("optimize", "phase 2 only: make the μ updates of one stage on its stored D_k, then checkpoint"),
    ):
        verb = verbs.add_parser(name, help=text, description=text + ". Uses the run's latest checkpoint.")
        _add_config_args(verb)
        verb.add_argument("--run-dir", type=Path, required=True, help="run directory (created with --config if new)")
        verb.add_argument("--stage", type=int, required=True, help="stage index k (0-based)")

    ev = verbs.add_parser("eval", help="evaluate a checkpoint on the configured benchmarks (pass@1 over k samples)")
    _add_config_args(ev)
    ev.add_argument("--run-dir", type=Path, required=True, help="run directory")
    ev.add_argument("--checkpoint", type=Path, help="step directory (default: the latest checkpoint, else the base)")

    score = verbs.add_parser(
        "score",
        help="score given responses through the configured reward (sandbox included) and print one JSON line each",
        description='Score RESP.jsonl (rows {"id": <problem id or row number>, "response": "..."}) against '
        "the problems of --data, read as data.format says, through reward.kind with its options: a check of a data "
        "set, an answer format or the sandbox before a run. Prints id, reward, reason, tests passed/total, seconds.",
    )
    _add_config_args(score)
    score.add_argument("--data", type=Path, required=True, help="problems file (.jsonl/.json/.parquet)")
    score.add_argument("--responses", type=Path, required=True, help='JSONL of {"id": ..., "response": "..."}')

    report = verbs.add_parser("report", help="PNG plots comparing run directories (accuracy vs wall clock, ...)")
    report.add_argument("run_dirs", nargs="+", type=Path, help="run directories holding metrics.jsonl")
    report.add_argument("--out", type=Path, help="output directory (default: FIRST_RUN/report)")

    _add_sweep_parser(verbs)
    from megatron_mugrpo.conversion.cli import add_convert_parser

    add_convert_parser(verbs)
    from megatron_mugrpo.plan.command import add_plan_parser

    add_plan_parser(verbs)
    from megatron_mugrpo.envs.server import add_serve_search_parser

    add_serve_search_parser(verbs)
    return parser


def _add_sweep_parser(verbs: argparse._SubParsersAction) -> None:
    sweep = verbs.add_parser(
        "sweep",
        help="run a sweep file's variants × seeds (resumable) and summarise them as mean ± std over seeds",
        description="Run every variant × seed of a sweep file under DIR/<variant>/seed_<s>, skipping finished runs "
        "and resuming interrupted ones, then write DIR/summary.{csv,md} and band plots. The file format is "
        "documented in megatron_mugrpo/sweep.py and experiments/README.md. Exit status 1 when a run failed.",
    )
    sweep.add_argument("file", type=Path, help="sweep YAML (e.g. experiments/f1_mu_vs_grpo.yaml)")
    sweep.add_argument("--out", type=Path, required=True, help="sweep directory (run directories, summary)")
    sweep.add_argument("--parallel", type=int, default=1, help="runs at once; the CPUs are split between them")
    sweep.add_argument("--report-dir", type=Path, help="where summary.{csv,md} and the plots go (default: --out)")
    sweep.add_argument("--dry-run", action="store_true", help="check the file and print each run's state and command")
    sweep.add_argument("overrides", nargs="*", help="dotted overrides applied to every run (after the file's own)")


def cmd_sweep(args: argparse.Namespace) -> int:
    from megatron_mugrpo.sweep import load_sweep, run_sweep

    spec = load_sweep(args.file, args.overrides)
    from megatron_mugrpo.config import load_config

    return run_sweep(
        spec, args.out, parallel=args.parallel, report_dir=args.report_dir, dry_run=args.dry_run, load=load_config
    )


class _UsageError(InputError, ValueError):
    """A command-line mistake: printed as one `error:` line, exit status 2."""


@dataclass(frozen=True)
class Resolved:
    """The config a verb runs with, and the history entry to record for it (None: config unchanged)."""

    cfg: RunConfig
    record: str | None


def resolve_config(args: argparse.Namespace, run_dir: Path, verb: str, *, persist: bool = True) -> Resolved:
    """A new run: the YAML plus overrides. An existing run: its config.yaml plus the overrides that the
    resume policy allows (``resume.py``), recorded in its history when ``persist``. Reads only."""
    from megatron_mugrpo.config import load_config
    from megatron_mugrpo.resume import continue_config
    from megatron_mugrpo.rundir import is_run

    if not is_run(run_dir):
        if args.config is None:
            raise _UsageError(f"{run_dir} is not a run (no config.yaml): pass --config C to start a new run there")
        return Resolved(load_config(args.config, args.overrides), _created(verb, args))
    if args.config is not None:
        raise _UsageError(
            f"{run_dir} already holds a run, whose config.yaml is used: drop --config (overrides may follow) "
            "or choose another --run-dir"
        )
    cfg, changes = continue_config(run_dir, args.overrides, load=load_config)
    return Resolved(cfg, f"{verb}: {' '.join(changes)}" if changes and persist else None)


def _created(verb: str, args: argparse.Namespace) -> str:
    return " ".join([f"{verb}: created from {args.config}", *args.overrides])


def cmd_train(args: argparse.Namespace) -> int:
    # Imports stay light until the role is known: async mode's rollout workers never need Megatron.
    from megatron_mugrpo.asynchronous.roles import role_from_env
    from megatron_mugrpo.config import load_config

    run_dir = _train_run_dir(args)
    new = load_config(args.config, args.overrides) if args.resume is None else None  # reads the YAML only
    if new is not None and _preempted_run(run_dir, new):  # a requeued job repeats its first command
        args.resume, args.config, args.run_dir, args.overrides, new = run_dir, None, None, [], None
    with locked_run_dir(run_dir, replace_failed_start=new is not None) as claimed:  # the lock, then the judging
        if new is not None:  # a run that produced something was refused as the lock was taken
            cfg, opening = new, Opening.new(_created("train", args))
        else:
            cfg, opening = _resumed(args)
        model_parallel = cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel
        role = role_from_env(mode=cfg.mode, rollout_ranks=cfg.async_.rollout_ranks, model_parallel=model_parallel)
    if role.is_worker:  # async mode's rollout ranks: no Megatron, no process group, only the run directory
        from megatron_mugrpo.asynchronous.worker import run_worker

        run_worker(cfg, run_dir, role)
        return 0
    from megatron_mugrpo.asynchronous.files import AsyncPaths
    from megatron_mugrpo.asynchronous.liveness import beating
    from megatron_mugrpo.loop.lost_ranks import rank_heartbeat
    from megatron_mugrpo.plan.run_plan import write_measured

    # Async mode: rank 0 beats for the trainer from here (before Megatron is even imported) to the end; the
    # last beat says done, or failed with the error, and the workers stop on reading it. Every other trainer
    # rank of a multi-rank run beats too, so a rank whose collective fails can name the one that was lost.
    async_rank0 = role.rank == 0 and role.num_workers > 0
    with (
        beating(AsyncPaths(run_dir).trainer_heartbeat, enabled=async_rank0),
        rank_heartbeat(run_dir, role.rank, world_size=role.trainer_world, beats_elsewhere=async_rank0),
    ):
        run, result = _train_rank(cfg, run_dir, role, claimed, opening)
    if run.is_writer:
        write_measured(run_dir, run.policy, updates=int(result["updates"]))  # for report's plan against actual
        print_summary(result)
        if cfg.logging.report:
            from megatron_mugrpo.report import write_report

            write_report([run_dir], run_dir / "report")
    return 0


def _train_rank(cfg: RunConfig, run_dir: Path, role: ProcessRole, claimed: Claim | None, opening: Opening) -> tuple:
    """A trainer rank's run: open it, train, close it; a preemption or a lost peer ends it as they should."""
    from megatron_mugrpo.asynchronous.files import AsyncPaths
    from megatron_mugrpo.asynchronous.liveness import doing
    from megatron_mugrpo.loop.asynchronous import train_async
    from megatron_mugrpo.loop.lost_ranks import beat_path, collective_error, is_peer_loss, is_timeout
    from megatron_mugrpo.loop.setup import open_run
    from megatron_mugrpo.loop.staged import train
    from megatron_mugrpo.plan.run_plan import write_run_plan

    if role.rank == 0:  # the plan of this launch on this device, before any model is built (plan/run_plan.py)
        write_run_plan(cfg, run_dir, world_size=role.world_size, processes_per_node=_local_world(role), verb="train")
    run = open_run(cfg, run_dir, opening, claimed=claimed, world_size=role.trainer_world)
    if run.is_writer:
        preemption.clear_marker(run_dir)  # resumed: the marker no longer describes the run
    preemption.install(grace_s=cfg.checkpoint.preempt_grace_s, run_dir=run_dir if run.is_writer else None)
    preempted = None
    try:
        try:
            result = train_async(run, role) if cfg.mode == "async" else train(run)
        finally:
            run.close()  # publishes a background checkpoint: a collective, which a lost peer fails too
    except preemption.Preempted as exc:  # checkpointed at a safe point; run.close() published it
        preempted = exc
    except RuntimeError as exc:  # a collective whose peer died or hangs: name it and the phase, not an address
        if role.trainer_world <= 1 or not (is_peer_loss(exc) or is_timeout(exc)):
            raise
        beats = {r: beat_path(run_dir, r) for r in range(role.trainer_world) if r != role.rank}
        if role.num_workers > 0 and role.rank != 0:
            beats[0] = AsyncPaths(run_dir).trainer_heartbeat  # async rank 0 beats for the workers
        timeout_s = cfg.parallel.timeout_s
        raise collective_error(beats, me=role.rank, doing=doing() or "working", exc=exc, timeout_s=timeout_s) from exc
    if preempted is not None:
        preemption.finished()
        if run.is_writer:
            preemption.write_marker(run_dir, preempted)
        raise preempted
    return run, result


def _local_world(role: ProcessRole) -> int:
    """Processes of the launch on this host (torchrun's LOCAL_WORLD_SIZE; all of them without torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", role.world_size))


def _train_run_dir(args: argparse.Namespace) -> Path:
    """The directory `train` writes; checks only the arguments (the directory is judged under its lock)."""
    if args.resume is not None:
        if args.config is not None or args.run_dir is not None:
            raise _UsageError("--resume RUN_DIR takes neither --config nor --run-dir (the run's config.yaml is used)")
        if not args.resume.is_dir():
            raise _UsageError(f"--resume {args.resume}: no such run directory")
        return args.resume
    if args.config is None or args.run_dir is None:
        raise _UsageError("train needs --config C and --run-dir DIR (or --resume RUN_DIR)")
    return args.run_dir


def _preempted_run(run_dir: Path, new: RunConfig) -> bool:
    """Whether ``train --config C --run-dir R`` continues R: R was preempted (``loop.preemption``'s
    marker) and C with its overrides is the config R runs with. So a requeued Slurm job, which repeats
    its first command, resumes without a new flag; a different config is refused, naming the keys."""
    from megatron_mugrpo.resume import changed_keys, reference_config

    if preemption.read_marker(run_dir) is None:
        return False
    reference = reference_config(run_dir)
    differ = changed_keys(reference, new.to_dict()) if reference is not None else []
    if differ:
        raise _UsageError(
            f"{run_dir} was preempted and is resumed by the command that started it, but this config differs "
            f"in {', '.join(differ[:8])}: run `mugrpo train --resume {run_dir}` (with the overrides resume allows)"
        )
    return True


def _resumed(args: argparse.Namespace) -> tuple[RunConfig, Opening]:
    """`train --resume`: the run's config and how to open it (called with the directory locked)."""
    from megatron_mugrpo.rundir import is_run

    if not is_run(args.resume):
        raise _UsageError(f"{args.resume} is not a run (no config.yaml): start one with --config C --run-dir DIR")
    resolved = resolve_config(args, args.resume, "train --resume")
    return resolved.cfg, Opening.resumed(resolved.record)


@contextmanager
def locked_run_dir(run_dir: Path, *, replace_failed_start: bool = False) -> Iterator[Claim | None]:
    """Rank 0 of the launch (torchrun's RANK) locks ``run_dir`` before the verb judges it.

    So a second process is told who holds the directory, never a verdict drawn from a directory the
    holder is still setting up. With ``replace_failed_start`` (a new `train`) a start that failed
    before producing anything is cleared and one that produced something refused, under the lock.
    An error inside the block abandons the claim (unlock; remove the directory if the claim created
    it); otherwise the claim goes on to ``open_run``, which holds it until the run closes.
    """
    from megatron_mugrpo.rundir import claim

    rank0 = int(os.environ.get("RANK", "0")) == 0
    claimed = claim(run_dir, replace_failed_start=replace_failed_start) if rank0 else None
    try:
        yield claimed
    except BaseException:
        if claimed is not None:
            claimed.abandon()
        raise


def print_summary(result: dict[str, float]) -> None:
    """The one-screen summary; its last line is machine-readable."""
    print("\n==== μ-GRPO run summary ====")
    print(
        f"eval accuracy (avg pass@1): before {result['acc_before']:.3f}  after {result['acc_after']:.3f}  "
        f"best {result['best_acc']:.3f}"
    )
    print(
        f"time: rollout {result['t_rollout_s']:.1f}s  optimize {result['t_optimize_s']:.1f}s  "
        f"eval {result['t_eval_s']:.1f}s  total {result['t_total_s']:.1f}s"
    )
    print(f"updates {int(result['updates'])}  trained response tokens {int(result['train_tokens'])}")
    if "consumed_groups" in result:  # async mode
        print(
            f"rollout queue: {int(result['consumed_groups'])} groups consumed ({int(result['dropped_groups'])} "
            f"dropped as too old), {int(result['left_in_queue'])} left unconsumed"
        )
    print(
        f"acc_before={result['acc_before']:.4f} acc_after={result['acc_after']:.4f} t_total_s={result['t_total_s']:.1f}"
    )


def cmd_phase(args: argparse.Namespace) -> int:
    from megatron_mugrpo.loop.setup import open_run
    from megatron_mugrpo.loop.staged import optimize_stage, rollout_phase
    from megatron_mugrpo.rollout.manifest import is_complete

    with locked_run_dir(args.run_dir) as claimed:
        resolved = resolve_config(args, args.run_dir, args.verb)
        cfg = resolved.cfg
        if cfg.mode != "staged":
            raise _UsageError(
                f"mugrpo {args.verb} replays one phase of the staged loop; a mode: {cfg.mode} run has no stage "
                "datasets: run it with `mugrpo train`"
            )
        if not 0 <= args.stage < cfg.stages.num_stages:
            raise _UsageError(f"--stage {args.stage} is outside [0, stages.num_stages={cfg.stages.num_stages})")
    # `optimize` continues from the latest checkpoint and redoes the updates logged after it.
    run = open_run(cfg, args.run_dir, Opening.phase(args.verb, resolved.record), claimed=claimed)
    try:
        if args.verb == "generate":
            rollout_phase(run, args.stage)
            if run.is_writer:
                print(f"rollout dataset complete: {run.rollout_dir(args.stage)}")
            return 0
        if not is_complete(run.rollout_dir(args.stage)):
            raise _UsageError(
                f"{run.rollout_dir(args.stage)} is not a complete rollout dataset: run "
                f"`mugrpo generate --run-dir {args.run_dir} --stage {args.stage}` first"
            )
        optimize_stage(run, args.stage)
    finally:
        run.close()
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from megatron_mugrpo.loop.actions import run_evaluation
    from megatron_mugrpo.loop.setup import open_run

    if args.checkpoint is not None and not (args.checkpoint / "metadata.json").is_file():
        raise _UsageError(f"--checkpoint {args.checkpoint} is not a checkpoint step directory (no metadata.json)")
    with locked_run_dir(args.run_dir) as claimed:
        # Overrides (e.g. eval.benchmarks.0.k=16) apply to this evaluation only: the run's config is kept.
        resolved = resolve_config(args, args.run_dir, "eval", persist=False)
        if not resolved.cfg.eval.benchmarks:
            raise _UsageError("no benchmarks configured: add eval.benchmarks to the config")
    run = open_run(resolved.cfg, args.run_dir, Opening.evaluation(args.checkpoint, resolved.record), claimed=claimed)
    try:
        metrics = run_evaluation(run)
    finally:
        run.close()
    for key, value in sorted(metrics.items()):
        print(f"{key} = {value:.4f}")
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    from megatron_mugrpo.config import config_values, load_config
    from megatron_mugrpo.rewards.registry import RewardSet
    from megatron_mugrpo.scoring import detect_format, read_responses, reference_answers, score_responses

    if args.config is None:
        raise _UsageError("score needs --config (the run config whose reward and data format to use)")
    if not args.data.is_file():
        raise _UsageError(f"--data {args.data} does not exist")
    # The data file as the run's training data: the config checks that reward.kind can score its format,
    # which the rows' fields decide unless data.format is given on the command line.
    overrides = [*args.overrides, f"data.train_path={args.data}"]
    if not any(o.startswith("data.format=") for o in args.overrides):
        data = config_values(args.config, overrides)["data"]  # unchecked: the reward may not fit it yet
        found, note = detect_format(
            args.data, data["format"], prompt_field=data["prompt_field"], answer_field=data["answer_field"]
        )
        if note:
            print(f"note: {note}", file=sys.stderr)
            overrides.append(f"data.format={found}")
    cfg = load_config(args.config, overrides)
    answers = reference_answers(args.data, cfg.data.format, cfg.data.answer_field)
    responses = read_responses(args.responses, answers)  # every row checked before anything runs
    rewards = RewardSet(cfg.reward)
    try:
        for scored in score_responses(rewards, answers, responses):
            print(scored.to_json(), flush=True)
    finally:
        rewards.close()
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from megatron_mugrpo.config import load_config
    from megatron_mugrpo.plan.command import run_plan

    return run_plan(args, load=load_config)


def cmd_report(args: argparse.Namespace) -> int:
    from megatron_mugrpo.report import write_report

    out = args.out or args.run_dirs[0] / "report"
    if out.exists() and not out.is_dir():
        raise _UsageError(f"--out {out} is a file; give a directory for the report")
    for path in write_report(args.run_dirs, out):
        print(path)
    return 0


def cmd_serve_search(args: argparse.Namespace) -> int:
    from megatron_mugrpo.envs.server import run_serve_search

    return run_serve_search(args)


def quiet_libraries() -> None:
    """Keep the console for our progress bars and metrics: library chatter only from WARNING up.

    megatron-core logs every DDP bucket and optimizer setting at INFO and warns at import that Apex
    / Transformer Engine are absent (expected on CPU: the local implementations are used).
    """
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for name in ("megatron", "torch.distributed", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed.*")
    warnings.filterwarnings("ignore", message=".*torch_dtype.*is deprecated.*")


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    args = build_parser().parse_args(argv)
    if args.verb == "convert":
        from megatron_mugrpo.conversion.cli import run_convert

        return run_convert(args)
    handlers = {
        "train": cmd_train,
        "generate": cmd_phase,
        "optimize": cmd_phase,
        "eval": cmd_eval,
        "report": cmd_report,
        "score": cmd_score,
        "sweep": cmd_sweep,
        "plan": cmd_plan,
        "serve-search": cmd_serve_search,
    }
    try:
        return handlers[args.verb](args)
    except InputError as exc:  # bad input: one line, exit 2; anything else is a bug and keeps its traceback
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RankFailedError as exc:  # async mode: another rank died; its name and what to do, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_RANK_FAILED
    except preemption.Preempted as exc:  # stopped as asked: not an error, but not finished either
        print(f"{exc}; continue with the same command or `mugrpo train --resume RUN_DIR`", file=sys.stderr)
        return preemption.EXIT_PREEMPTED


if __name__ == "__main__":
    sys.exit(main())
