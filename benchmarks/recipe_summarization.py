"""Issue 39's summarization recipe in one command: denoising pretraining, fine-tuning from it, the same fine-tuning
budget from scratch, and ``test`` once on each run's last checkpoint, on QMSum and SQuALITY test.

    torch-handle prepare qmsum --out data && torch-handle prepare squality --out data
    python benchmarks/recipe_summarization.py --data data        # the issue's 2 hours: 80 min, then 40 min
    python benchmarks/recipe_summarization.py --data data --pretrain-steps 2000 --finetune-steps 500 --text books/

Every stage is a ``torch-handle`` command as a user would type it, in a process of its own, its output in
``OUT/logs/``: ``fit --config pretrain`` once on the corpora's training documents and summaries (each document once)
and any ``--text``; then, for each corpus, ``fit --config summarization --model.init_from OUT/pretrain`` and the same
``fit`` from scratch, on the SCROLLS-style files ``prepare`` writes (every query or question before its document);
then ``test --ckpt_path last`` on each, which prints ROUGE-1/2/L, GM and the naive and Lead baselines of the same
inputs. Nothing is selected on test: each run is scored once, on its last checkpoint. The section written into
``benchmarks/RESULTS.md`` holds the table, the budgets, the steps each run reached, the device, the load average and
every command.

A budget is a time limit (``--trainer.max_time``, the learning-rate schedule still spanning the config's epochs), a
step count (``--trainer.max_steps``, which the schedule then spans), or both (whichever ends first). Options for every
``fit`` or every ``test`` go through ``--fit-arg``/``--test-arg`` (e.g. ``--test-arg=--model.num_beams=1``).

Each finished stage is recorded in ``OUT/stages.json``. ``--resume`` (the same command, on the same ``--out``) keeps
the stages recorded with the same arguments, resumes an unfinished ``fit`` from its run's ``last.ckpt``
(``--ckpt_path=last``, exact, its time budget counting the time already trained), and runs the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_line, markdown_table, write_section  # noqa: E402

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
SECTION = "recipe_summarization"
PRETRAIN_MINUTES, FINETUNE_MINUTES = 80.0, 40.0  # the setting: pretraining then fine-tuning in 2 hours
SCORES = ("ROUGE-1", "ROUGE-2", "ROUGE-L", "GM")
_SCORE_LINE = re.compile(r"^(?P<label>.+?): (?P<scores>ROUGE-1 \S+.*)$", re.M)
_CHECKPOINT_LINE = re.compile(r"^checkpoint: (?P<path>.+)$", re.M)
STAGES = "stages.json"

Cli = Callable[[list[str], Path], str]
"""Runs ``torch-handle ARGS``, its output also into the log file given; returns that output."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Where ``torch-handle prepare NAME --out DATA`` puts a corpus's files, and the setting they pose."""

    name: str
    setting: str
    documents: str  # each training document once, for pretraining
    documents_val: str
    train: str  # every query (question) before its document, as SCROLLS poses QMSum
    val: str
    test: str


CORPORA = {
    "qmsum": Corpus(
        "qmsum",
        "QMSum test: every query (general and specific) before its transcript, as SCROLLS poses it",
        "train.jsonl",
        "val.jsonl",
        "train_all.jsonl",
        "val_all.jsonl",
        "test_all.jsonl",
    ),
    "squality": Corpus(
        "squality",
        "SQuALITY test: the five questions of each story before it, scored against the best of its 4 references",
        "train_plot.jsonl",
        "dev_plot.jsonl",
        "train_all.jsonl",
        "dev_all.jsonl",
        "test_all.jsonl",
    ),
}


def torch_handle_process(args: list[str], log: Path) -> str:
    """``torch-handle ARGS`` in a child process (this checkout's package), its output into ``log``."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "torch_handle.cli", *args]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    log.write_text(result.stdout, encoding="utf-8")
    if result.returncode:
        raise SystemExit(f"error: torch-handle {args[0]} exited with {result.returncode}: its output is in {log}")
    return result.stdout


@dataclasses.dataclass(frozen=True)
class Budget:
    """One stage's budget: minutes of wall time, optimizer steps, or both."""

    minutes: float | None
    steps: int | None

    def args(self) -> list[str]:
        """The ``fit`` options that impose it."""
        args = []
        if self.minutes is not None:
            seconds = round(self.minutes * 60)
            days, rest = divmod(seconds, 86400)
            args.append(f"--trainer.max_time={days:02d}:{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}")
        if self.steps is not None:
            args += [f"--trainer.max_steps={self.steps}", "--trainer.max_epochs=-1"]
        return args

    def __str__(self) -> str:
        minutes = f"{self.minutes:g} min" if self.minutes is not None else None
        return " or ".join(filter(None, [minutes, f"{self.steps} steps" if self.steps else None]))


def budget(minutes: float | None, steps: int | None, default_minutes: float) -> Budget:
    if minutes is None and steps is None:
        minutes = default_minutes
    if (minutes is not None and minutes <= 0) or (steps is not None and steps <= 0):
        raise SystemExit("error: a budget must be positive: pass minutes > 0 or steps > 0")
    return Budget(minutes, steps)


@dataclasses.dataclass
class Stage:
    """One ``torch-handle`` command the recipe ran, how long it took, and what it left."""

    name: str
    args: list[str]
    seconds: float
    output: str

    @property
    def command(self) -> str:
        return shlex.join(["torch-handle", *self.args])


class Recipe:
    """Runs the stages in order, each logged, timed, kept for the section and recorded in ``OUT/stages.json``."""

    def __init__(self, out: Path, cli: Cli, machine: str, resume: bool = False) -> None:
        self.out = out
        self.cli = cli
        self.machine = machine  # the first invocation's, kept by a resumed one
        self.stages: list[Stage] = []
        self.done: dict[str, Stage] = {}
        if resume:
            record = json.loads((out / STAGES).read_text(encoding="utf-8"))
            self.machine = record["machine"]
            self.done = {stage["name"]: Stage(**stage) for stage in record["stages"]}

    def run(self, name: str, args: list[str]) -> Stage:
        kept = self.done.get(name)
        if kept is not None and kept.args == args:
            log.info("%s: kept from %s", name, self.out / STAGES)
            self.stages.append(kept)
            return kept
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        root = next((Path(a.split("=", 1)[1]) for a in args if a.startswith("--trainer.default_root_dir=")), None)
        resumed = args[0] == "fit" and root is not None and (root / "checkpoints" / "last.ckpt").exists()
        command = [*args, "--ckpt_path=last"] if resumed else args  # an interrupted fit continues exactly
        log.info("%s %s: %s", time.strftime("%H:%M:%S"), name, shlex.join(["torch-handle", *command]))
        start = time.perf_counter()
        output = self.cli(command, self.out / "logs" / f"{name.replace('/', '_')}.log")
        self.stages.append(Stage(name, args, time.perf_counter() - start, output))
        stages = list({stage.name: stage for stage in [*self.done.values(), *self.stages]}.values())
        record = {"machine": self.machine, "stages": [dataclasses.asdict(stage) for stage in stages]}
        (self.out / f"{STAGES}.tmp").write_text(json.dumps(record, indent=1), encoding="utf-8")
        os.replace(self.out / f"{STAGES}.tmp", self.out / STAGES)  # never a half-written record
        return self.stages[-1]


def test_scores(output: str) -> dict[str, dict[str, float]]:
    """``{label: {ROUGE-1: .., GM: ..}}`` of the lines ``torch-handle test`` prints (model, Lead, naive)."""
    found = {}
    for match in _SCORE_LINE.finditer(output):
        label = "model" if match["label"].startswith("model") else match["label"]  # "model (long documents cut)"
        found[label] = {name: float(value) for name, value in re.findall(r"(\S+) ([\d.]+)", match["scores"])}
    if "model" not in found:
        raise SystemExit("error: torch-handle test printed no scores: see its log")
    return found


def global_step(run: Path) -> int:
    """The optimizer steps that the run's last checkpoint records."""
    import torch

    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True, mmap=True)
    return int(checkpoint["global_step"])


def _row(system: str, training: str, scores: dict[str, float]) -> list[str]:
    return [system, training, *(f"{scores[name]:.2f}" for name in SCORES)]


def _verdict(corpus: Corpus, tested: dict[str, dict[str, dict[str, float]]]) -> str:
    """The issue's goal, in figures: the pretrained model's GM against the better baseline, and against scratch."""
    pretrained, scratch = tested["pretrained"]["model"]["GM"], tested["scratch"]["model"]["GM"]
    baselines = {label: s["GM"] for label, s in tested["pretrained"].items() if label != "model"}
    best_label = max(baselines, key=baselines.__getitem__)
    best = baselines[best_label]
    met = "above" if pretrained > best else f"{best - pretrained:.2f} GM short of the {best_label}"
    return (
        f"{corpus.name}: the pretrained model's GM against naive and Lead: {met}; pretraining's gain over the same "
        f"fine-tuning budget from scratch: {pretrained - scratch:+.2f} GM. ROUGE alone does not say whether a summary "
        "depends on its document: `benchmarks/rouge_control.py` scores it against another document's references too."
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data"), help="where torch-handle prepare wrote (--out)")
    parser.add_argument("--corpora", nargs="+", choices=sorted(CORPORA), default=sorted(CORPORA))
    parser.add_argument("--text", nargs="*", default=[], help="more pretraining text: files, folders of .txt, JSONL")
    parser.add_argument("--pretrain-minutes", type=float, help=f"pretraining's time (default {PRETRAIN_MINUTES:g})")
    parser.add_argument("--pretrain-steps", type=int, help="pretraining's optimizer steps")
    parser.add_argument("--finetune-minutes", type=float, help=f"each fine-tuning's time ({FINETUNE_MINUTES:g})")
    parser.add_argument("--finetune-steps", type=int, help="each fine-tuning's optimizer steps")
    parser.add_argument("--out", type=Path, default=Path("runs/recipe"), help="a new folder for the runs and logs")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "RESULTS.md", help="where to write")
    parser.add_argument("--fit-arg", action="append", default=[], help="an option for every fit, e.g. =--seed=1")
    parser.add_argument("--test-arg", action="append", default=[], help="an option for every test")
    parser.add_argument(
        "--resume", action="store_true", help=f"continue an interrupted recipe in --out (its {STAGES}): see above"
    )
    return parser


def _check_files(data: Path, corpora: list[Corpus], out: Path, resume: bool) -> None:
    """Refuses, in one line, a missing input file, a used run folder, or one with nothing to resume, before anything
    runs."""
    for corpus in corpora:
        for name in (corpus.documents, corpus.documents_val, corpus.train, corpus.val, corpus.test):
            if not (data / corpus.name / name).is_file():
                raise SystemExit(
                    f"error: {data / corpus.name / name} not found: run torch-handle prepare {corpus.name} --out {data}"
                )
    if resume and not (out / STAGES).is_file():
        raise SystemExit(f"error: {out} holds no {STAGES}: run without --resume, on a new --out folder")
    if not resume and out.exists() and any(out.iterdir()):
        raise SystemExit(f"error: {out} is not empty: pass a new --out folder, or --resume to continue it")


def main(argv: Sequence[str] | None = None, cli: Cli = torch_handle_process) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    options = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    budgets = (
        budget(options.pretrain_minutes, options.pretrain_steps, PRETRAIN_MINUTES),
        budget(options.finetune_minutes, options.finetune_steps, FINETUNE_MINUTES),
    )
    corpora = [CORPORA[name] for name in options.corpora]
    _check_files(options.data, corpora, options.out, options.resume)
    recipe = Recipe(options.out, cli, _machine(), options.resume)
    quiet = ["--trainer.enable_progress_bar=false"]
    pretrain = options.out / "pretrain"
    texts = [str(options.data / c.name / c.documents) for c in corpora] + options.text
    recipe.run(
        "pretrain",
        [
            "fit", "--config=pretrain", f"--trainer.default_root_dir={pretrain}",
            f"--data.init_args.train_files={json.dumps(texts)}",
            f"--data.init_args.val_files={json.dumps([str(options.data / c.name / c.documents_val) for c in corpora])}",
            *budgets[0].args(), *quiet, *options.fit_arg,
        ],
    )  # fmt: skip
    runs = {c.name: {start: options.out / c.name / start for start in ("pretrained", "scratch")} for c in corpora}
    for corpus in corpora:
        folder = options.data / corpus.name
        for start, run in runs[corpus.name].items():
            recipe.run(
                f"{corpus.name}/{start}",
                [
                    "fit", "--config=summarization", f"--trainer.default_root_dir={run}",
                    *([f"--model.init_from={pretrain}"] if start == "pretrained" else []),
                    f"--data.init_args.train_file={folder / corpus.train}",
                    f"--data.init_args.val_file={folder / corpus.val}", "--data.init_args.query_field=query",
                    "--model.generate_every_n_val_epochs=0", *budgets[1].args(), *quiet, *options.fit_arg,
                ],
            )  # fmt: skip
    tested: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for corpus in corpora:
        folder = options.data / corpus.name
        tested[corpus.name] = {}
        for start, run in runs[corpus.name].items():
            stage = recipe.run(
                f"{corpus.name}/{start}/test",
                [
                    "test", "--config=summarization", f"--trainer.default_root_dir={run}", "--ckpt_path=last",
                    f"--data.init_args.train_file={folder / corpus.train}",
                    f"--data.init_args.test_file={folder / corpus.test}", "--data.init_args.query_field=query",
                    *quiet, *options.test_arg,
                ],
            )  # fmt: skip
            tested[corpus.name][start] = test_scores(stage.output)
            checkpoint = _CHECKPOINT_LINE.search(stage.output)
            if checkpoint is None or Path(checkpoint["path"]).name != "last.ckpt":
                raise SystemExit(f"error: {stage.name} did not score {run}'s last.ckpt: see its log")
        (options.out / "scores.json").write_text(json.dumps(tested, indent=1), encoding="utf-8")
    write_section(SECTION, _section(argv, options, corpora, recipe, runs, tested, budgets), options.results)
    log.info("wrote the %s section of %s", SECTION, options.results)


def _machine() -> str:
    """The device line, with the load average and the time at the start."""
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return machine_line(torch.get_num_threads(), torch.__version__, gpu)


def _section(
    argv: list[str],
    options: argparse.Namespace,
    corpora: list[Corpus],
    recipe: Recipe,
    runs: dict[str, dict[str, Path]],
    tested: dict[str, dict[str, dict[str, dict[str, float]]]],
    budgets: tuple[Budget, Budget],
) -> str:
    """The RESULTS section: budgets, device, table, verdicts and commands."""
    seconds = {stage.name: stage.seconds for stage in recipe.stages}
    kept = [stage.name for stage in recipe.stages if recipe.done.get(stage.name) is stage]
    pretrained_steps = global_step(options.out / "pretrain")
    rows = []
    for corpus in corpora:
        for start, run in runs[corpus.name].items():
            steps, minutes = global_step(run), seconds[f"{corpus.name}/{start}"] / 60
            training = f"fine-tuning {steps} steps, {minutes:.1f} min"
            if start == "pretrained":
                pre = f"pretraining {pretrained_steps} steps, {seconds['pretrain'] / 60:.1f} min"
                training = f"{pre}, then {training}"
            label = "pretrained, fine-tuned" if start == "pretrained" else "from scratch"
            rows.append(_row(f"{corpus.name}: {label}", training, tested[corpus.name][start]["model"]))
        for label, scores in tested[corpus.name]["pretrained"].items():
            if label != "model":
                rows.append(_row(f"{corpus.name}: {label}", "none", scores))
    load_end = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    commands = [shlex.join(["python", "benchmarks/recipe_summarization.py", *argv])]
    commands += [stage.command for stage in recipe.stages]
    return "\n\n".join(
        [
            "## Summarization recipe: denoising pretraining, then fine-tuning, against the same budget from scratch",
            f"{recipe.machine} Finished {time.strftime('%Y-%m-%d %H:%M %Z')}, load average {load_end}"
            + (f" (resumed: {', '.join(kept)} kept from the first invocation)." if kept else "."),
            f"Budgets: pretraining {budgets[0]}, then each fine-tuning {budgets[1]}; from scratch, the same "
            f"fine-tuning budget. Test files from `{options.data}` (`torch-handle prepare qmsum|squality`); each run "
            "scored once on its last checkpoint (no selection on test). Settings: "
            + "; ".join(corpus.setting for corpus in corpora)
            + ". Minutes: each command's wall time, start-up and tokenization included (a time budget counts "
            "training only). Scores: ROUGE F1 on 0-100 and GM (their geometric mean), as `torch-handle test` prints "
            "them; the baselines are those of the same inputs.",
            markdown_table(["system", "training", *SCORES], rows),
            "\n".join(_verdict(corpus, tested[corpus.name]) for corpus in corpora),
            "Commands:\n\n```bash\n" + "\n".join(commands) + "\n```",
        ]
    )


if __name__ == "__main__":
    main()
