"""The shipped configs, stacked with each strategy, end to end on two CPU processes with real data.

Each data config (``demo``, ``multi30k``, ``summarization``, ``summarization_32k``, ``summarization_cp``) is stacked
with a strategy config and run through ``fit`` -> ``test`` -> ``predict`` -> export -> ``predict`` from the export,
with only size fields overridden. The data are small subsets of ``../shared/data`` cut to make the shards uneven: fewer
validation batches than ranks, an odd number of test batches, short documents mixed with documents longer
than ``max_source_tokens`` (summarized in windows), a prediction line longer than ``max_len``. ``test`` on two
processes must report the metrics of one process of the default strategy on the same checkpoint (which merges a
sharded one), and the exported model must predict what the checkpoint predicts. The one-process runs of the default
strategy (the reference ``test``, ``predict`` from the export) run inside the test process: a launch's start-up each
saved, where the strategy's own code is not what they check.

Every combination is its own set of test ids, one per step (``demo-zero3-test``), so a CI report reads as a
table of combination x step. A step reuses its combination's trained run; a step whose run failed fails too.
The matrix covers every data config with DDP (Multi30k with the weight average, ``--config ema``, stacked on it),
every strategy with the demo, and the riskiest cross pairs
(``fsdp2_tp`` needs 4 processes: ``tests/test_tensor_parallel.py`` trains it against one process).
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, STRATEGY_CONFIGS, TINY_MODEL, cli
from tests.one_process import in_this_process
from torch_handle.data.demo import demo_corpus
from torch_handle.export.__main__ import main as export_main

SHARED = ROOT.parent / "shared" / "data"
TIMEOUT = 300  # seconds for one launch: ten times the slowest measured on a busy 2-core machine
STEP_TIMEOUT = 1800  # a step may first train its combination's run, then launch twice

MODEL = [
    *TINY_MODEL,
    "--model.max_new_tokens", "8",
]  # fmt: skip
TRAINER = [
    "--trainer.accelerator", "cpu",
    "--trainer.max_epochs", "1",
    "--trainer.limit_train_batches", "4",
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
]  # fmt: skip

COMBOS = [
    *[(data, "ddp") for data in ("demo", "summarization", "summarization_32k")],
    *[("demo", strategy) for strategy in STRATEGY_CONFIGS if strategy != "ddp"],
    ("summarization_32k", "zero3"),
    ("multi30k", "fsdp"),
    ("multi30k", "ddp+ema"),  # the weight average on two processes: test, predict and export read the average
    ("summarization", "zero2"),
    ("summarization_cp", "ddp"),  # context parallelism: both processes encode halves of each source
    ("summarization_cp", "zero3"),
    ("demo", "tp"),  # tensor parallelism: both processes hold half of every layer's heads and units
    ("summarization", "tp"),  # ... with local attention, ALiBi slopes per rank's heads, pooled memory
    ("demo", "pp"),  # pipeline parallelism: the encoder layer on one process, the decoder layer on the other
    ("summarization", "pp"),  # ... the pooled memory of a local-attention ALiBi encoder carried to the decoder stage
]
STEPS = ["fit", "test", "predict", "export"]
STRATEGIES = {*STRATEGY_CONFIGS, "tp", "pp"}


@dataclass
class Data:
    """A data config's size overrides and data-file overrides, and the file to predict from."""

    args: list[str]
    predict_file: Path


def _words(text: str, n: int) -> str:
    return " ".join(text.split()[:n])


def _jsonl(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _documents(path: Path, short: int, long: int, count: int) -> list[dict[str, str]]:
    """``count`` real records, alternately cut to ``short`` words (under ``max_source_tokens``) and to ``long``
    words (over it, but few windows), summaries cut to 40 words."""
    rows = [json.loads(line) for line in path.read_text().splitlines()][:count]
    return [
        {"document": _words(r["document"], short if i % 2 else long), "summary": _words(r["summary"], 40)}
        for i, r in enumerate(rows)
    ]


def _demo(folder: Path) -> Data:
    sources = [source for source, _ in demo_corpus("test", 5, seed=1)]
    predict = folder / "predict.txt"
    predict.write_text("\n".join([*sources, " ".join(sources * 12)]) + "\n")  # the last line is over max_len
    args = ["--data.init_args.demo_size", "400", "--data.init_args.bpe_vocab_size", "300"]
    return Data([*args, "--data.init_args.max_tokens", "1024", "--trainer.limit_val_batches", "2"], predict)


def _multi30k(folder: Path) -> Data:
    data = folder / "multi30k"
    data.mkdir()
    sizes = {"train": 300, "val": 3, "test_2016_flickr": 25}  # 3 validation pairs: one batch for two ranks
    for split, size in sizes.items():
        for lang in ("en", "de"):
            lines = (SHARED / "multi30k" / f"{split}.{lang}").read_text().splitlines()[:size]
            (data / f"{split}.{lang}").write_text("\n".join(lines) + "\n")
    sources = (SHARED / "multi30k" / "test_2016_flickr.en").read_text().splitlines()
    predict = folder / "predict.en"
    predict.write_text("\n".join([*sources[100:104], " ".join(sources[:40])]) + "\n")  # the last is over max_len
    args = [
        "--data.init_args.data_dir", str(data),
        "--data.init_args.bpe_vocab_size", "300",
        "--data.init_args.max_tokens", "256",
    ]  # fmt: skip
    return Data(args, predict)


def _summarization(folder: Path, test: Path, source_tokens: int, window: int, per_batch: int) -> Data:
    """SQuALITY stories to train on, cut to ``source_tokens``, ``per_batch`` of them to a batch (the long-document
    configs are built for one: under context parallelism its processes then hold parts of one row)."""
    squality = SHARED / "squality"
    train = _jsonl(folder / "train.jsonl", _documents(squality / "train_plot.jsonl", 5000, 5000, 8))
    val = _jsonl(folder / "val.jsonl", _documents(squality / "dev_plot.jsonl", 60, 300, 3))
    test_file = _jsonl(folder / "test.jsonl", _documents(test, 30, 250, 5))
    predict = _jsonl(folder / "predict.jsonl", _documents(test, 30, 250, 3)[::-1])
    args = [
        "--data.init_args.train_file", str(train),
        "--data.init_args.val_file", str(val),
        "--data.init_args.test_file", str(test_file),
        "--data.init_args.bpe_vocab_size", "300",
        "--data.init_args.max_tokens", str(per_batch * source_tokens),
        "--data.init_args.max_source_tokens", str(source_tokens),
        "--data.init_args.max_target_tokens", "64",
        "--model.transformer.window", str(window),
        "--model.chunk_overlap", str(source_tokens // 8),
        "--model.long_documents", "windows",  # summarization.yaml cuts them; the windows are what ranks split unevenly
    ]  # fmt: skip
    return Data(args, predict)


def _data(name: str, folder: Path) -> Data:
    if name == "demo":
        return _demo(folder)
    if name == "multi30k":
        return _multi30k(folder)
    if name == "summarization":
        return _summarization(folder, SHARED / "squality" / "dev_plot.jsonl", 128, 16, per_batch=4)
    # QMSum meetings, ALiBi (32k and cp), one long document per batch as these configs are built for
    return _summarization(folder, SHARED / "qmsum" / "val.jsonl", 256, 32, per_batch=1)


@dataclass
class Run:
    """One combination's run folder, data and outcome of each step so far."""

    root: Path
    data: Data
    config: list[str]  # --config options: the data config, the strategy config, any stacked on them (ema)
    without_strategy: list[str]  # the same without the strategy config
    fit_error: str | None = None
    predictions: list[str] | None = None

    def args(
        self, subcommand: str, *extra: str, devices: int | None = None, config: list[str] | None = None
    ) -> list[str]:
        """``cli.py SUBCOMMAND`` arguments: the stacked configs (or ``config``), the size overrides, then ``extra``."""
        config = self.config if config is None else config
        chosen = [] if devices is None else ["--trainer.devices", str(devices)]
        if devices == 1:  # one process splits nothing (the context-parallel config asks for 2)
            chosen += ["--model.context_parallel", "1"]
        root = ["--trainer.default_root_dir", str(self.root)]
        return [subcommand, *config, *TRAINER, *chosen, *MODEL, *self.data.args, *root, *extra]


_runs: dict[tuple[str, str], Run] = {}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"shared data directory {SHARED} is absent")
    return tmp_path_factory.mktemp("matrix")


def _first_error(run: subprocess.CompletedProcess) -> str:
    """The line that says what went wrong: an ``error:`` line, else the first exception raised (Python's, or
    a C++ one that aborted a rank), which in a multi-process run is the cause: the other rank's connection
    errors follow it."""
    lines = run.stderr.splitlines()
    exception = re.compile(r"^(\[rank\d+\]: )?([\w.]*(Error|Exception|Interrupt)\b|\s*what\(\):)")  # what(): C++
    return next(
        (line for line in lines if line.startswith("error:")),
        next((line for line in lines if exception.match(line)), f"exit {run.returncode}"),
    )


def _launch(args: list[str]) -> subprocess.CompletedProcess:
    """One ``cli.py`` run that must succeed; a hang past :data:`TIMEOUT` fails with the output so far."""
    try:
        run = cli(args, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as err:
        output = err.stderr.decode() if isinstance(err.stderr, bytes) else err.stderr or ""
        print(output[-6000:])
        pytest.fail(f"{args[0]} timed out after {TIMEOUT} s (a hang: ranks disagree on a collective?)")
    if run.returncode != 0:
        print(run.stderr[-6000:])
        pytest.fail(f"{args[0]} exited {run.returncode}: {_first_error(run)}")
    return run


def _fitted(data: str, strategy: str, base: Path) -> Run:
    """The combination's run, trained by its ``fit`` step (or here, when a step runs alone)."""
    key = (data, strategy)
    if key not in _runs:
        folder = base / f"{data}-{strategy}"
        folder.mkdir()
        config = ["--config", str(ROOT / "configs" / f"{data}.yaml")]  # then the strategy's, any stacked ("ddp+ema")
        without_strategy = list(config)
        for name in strategy.split("+"):
            stacked = ["--config", str(ROOT / STRATEGY_CONFIGS.get(name, f"configs/{name}.yaml"))]
            config += stacked
            without_strategy += [] if name in STRATEGIES else stacked
        run = _runs[key] = Run(folder / "run", _data(data, folder), config, without_strategy)
        try:
            _launch(run.args("fit"))
            last = run.root / "checkpoints" / "last.ckpt"
            if not last.exists():
                pytest.fail("fit wrote no checkpoints/last.ckpt")
            if "ema" in strategy.split("+"):  # every step of the 2 processes went into the average
                averaged = torch.load(last, weights_only=True)["averaging_state"]["n_averaged"].item()
                assert averaged == 4, f"the average holds {averaged} steps, not the run's 4"
        except pytest.fail.Exception as err:
            run.fit_error = str(err).splitlines()[0]
            raise
    run = _runs[key]
    if run.fit_error is not None:
        pytest.fail(f"fit failed: {run.fit_error}")
    return run


def _test_metrics(run: Run, devices: int) -> dict[str, float]:
    """``test`` metrics of the run's last checkpoint, from Lightning's CSV logger: on ``devices`` processes of the
    strategy config, or (one) in this process by the default strategy."""
    logs = run.root.parent / f"test-{devices}"
    logger = ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(logs)]
    if devices == 1:
        last = ["--ckpt_path", str(run.root / "checkpoints" / "last.ckpt")]
        one_process = run.args("test", *logger, *last, devices=1, config=run.without_strategy)
        in_this_process(one_process, run.root.parent / "one-process")
    else:
        _launch(run.args("test", *logger, devices=devices))
    (metrics,) = logs.rglob("metrics.csv")
    with metrics.open() as f:
        rows = list(csv.DictReader(f))
    return {k: float(v) for row in rows for k, v in row.items() if k.startswith("test/") and v}


def _predict(run: Run, name: str, *extra: str, exported: bool = False) -> list[str]:
    """Predictions on one process: of the strategy config, launched, or from an export (``extra`` names it) in this
    process, by the data config alone."""
    output = run.root.parent / f"{name}.txt"
    files = ["--data.init_args.predict_file", str(run.data.predict_file), "--prediction_writer.output", str(output)]
    if exported:
        in_this_process(run.args("predict", *files, *extra, devices=1, config=run.config[:2]), output.with_suffix(""))
    else:
        _launch(run.args("predict", *files, *extra, devices=1))
    return output.read_text().splitlines()


def _inputs(run: Run) -> int:
    return len(run.data.predict_file.read_text().splitlines())


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(STEP_TIMEOUT)
@pytest.mark.parametrize(
    ("data", "strategy", "step"),
    [
        pytest.param(data, strategy, step, marks=pytest.mark.xdist_group(f"matrix-{data}-{strategy}"))
        for data, strategy in COMBOS
        for step in STEPS
    ],
    ids=[f"{data}-{strategy}-{step}" for data, strategy in COMBOS for step in STEPS],
)
def test_shipped_config(data: str, strategy: str, step: str, base: Path) -> None:
    run = _fitted(data, strategy, base)
    if step == "test":
        # The reference: one process of the default strategy, which merges a sharded checkpoint.
        two, one = _test_metrics(run, devices=2), _test_metrics(run, devices=1)
        scores = {"test/bleu"} if data in ("demo", "multi30k") else {"test/rouge1", "test/rougeL", "test/lead_rouge1"}
        assert scores | {"test/loss"} <= one.keys(), f"test logged {sorted(one)}"
        assert two == pytest.approx(one, rel=1e-5, abs=1e-6), "test metrics on 2 processes differ from 1 process"
    elif step == "predict":
        run.predictions = _predict(run, "predictions")
        assert len(run.predictions) == _inputs(run)
    elif step == "export":
        exported = run.root.parent / "model.safetensors"
        try:
            export_main([str(run.root / "checkpoints" / "last.ckpt"), str(exported)])
        except SystemExit as err:
            pytest.fail(f"export exited: {err}")
        from_export = _predict(run, "exported", "--ckpt_path", str(exported), exported=True)
        assert len(from_export) == _inputs(run)
        assert run.predictions is not None, "no predictions from the checkpoint (its predict step failed)"
        assert from_export == run.predictions, "the exported model predicts differently from its checkpoint"
