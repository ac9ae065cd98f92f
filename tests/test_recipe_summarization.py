"""``benchmarks/recipe_summarization.py``: issue 39's recipe (pretrain, fine-tune from it and from scratch, test each
once) runs end to end on a few real stories, hands the pretrained weights to fine-tuning, and writes what it scored."""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT
from torch_handle.cli import main as torch_handle
from torch_handle.data.tokenizer import Tokenizer
from torch_handle.module import Seq2SeqModule

sys.path.insert(0, str(ROOT / "benchmarks"))
import recipe_summarization as recipe  # noqa: E402 - a script folder, not a package

TINY_FIT = [
    "--model.transformer.d_model=32", "--model.transformer.num_heads=2", "--model.transformer.d_ff=64",
    "--model.transformer.num_encoder_layers=1", "--model.transformer.num_decoder_layers=1",
    "--trainer.limit_val_batches=1", "--data.init_args.max_tokens=2048", "--data.init_args.bpe_vocab_size=400",
]  # fmt: skip


def _squality(shared_data: Path, out: Path) -> None:
    """Three stories a split, cut short, in the files ``torch-handle prepare squality`` writes (test: dev's)."""
    out.mkdir(parents=True)
    for split, source in (("train", "train_plot"), ("dev", "dev_plot"), ("test", "dev_plot")):
        rows = [json.loads(line) for line in (shared_data / "squality" / f"{source}.jsonl").open()][:3]
        rows = [
            {**row, "document": row["document"][:3000], "summary": row["summary"][:500], "summaries": row["summaries"]}
            for row in rows
        ]
        questions = [{**row, "query": "What is the plot of the story?"} for row in rows]
        for name, lines in ((f"{split}_plot", rows), (f"{split}_all", questions)):
            (out / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in lines), encoding="utf-8")


def _in_process(args: list[str], log: Path) -> str:
    """``torch-handle ARGS`` in this process, so the test can watch the weights each run starts from."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        torch_handle(args)
    log.write_text(output.getvalue(), encoding="utf-8")
    return output.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_recipe_pretrains_fine_tunes_both_ways_and_scores_each_last_checkpoint_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_data: Path
) -> None:
    _squality(shared_data, tmp_path / "data" / "squality")
    monkeypatch.chdir(tmp_path)
    first: dict[str, dict[str, torch.Tensor]] = {}  # each fit's weights as training starts
    start = Seq2SeqModule.on_train_start

    def record(module: Seq2SeqModule) -> None:
        weights = {name: value.detach().clone() for name, value in module.state_dict().items()}
        first[Path(module.trainer.default_root_dir).name] = weights
        start(module)

    monkeypatch.setattr(Seq2SeqModule, "on_train_start", record)
    results = tmp_path / "RESULTS.md"
    args = ["--corpora", "squality", "--pretrain-steps", "2", "--finetune-steps", "2", "--results", str(results)]
    args += [f"--fit-arg={arg}" for arg in TINY_FIT] + ["--test-arg=--model.max_new_tokens=8"]
    recipe.main(args, cli=_in_process)

    runs = tmp_path / "runs" / "recipe"
    assert sorted(first) == ["pretrain", "pretrained", "scratch"]
    # Fine-tuning starts from the pretraining run's last weights, and reads its tokenizer, <mask> included.
    pretrained = torch.load(runs / "pretrain" / "checkpoints" / "last.ckpt", weights_only=True)
    weights = {name: value for name, value in pretrained["state_dict"].items() if name.startswith("model.")}
    assert weights and weights.keys() <= first["pretrained"].keys()
    for name, value in weights.items():
        torch.testing.assert_close(first["pretrained"][name], value, rtol=0, atol=0, msg=name)
    assert any(not torch.equal(first["scratch"][name], value) for name, value in weights.items())
    for start_, has_mask in (("pretrained", True), ("scratch", False)):
        tuned = torch.load(runs / "squality" / start_ / "checkpoints" / "last.ckpt", weights_only=True)
        assert tuned["global_step"] == 2 and tuned["hyper_parameters"]["init_from"] is None
        assert (Tokenizer.from_str(tuned["SummarizationDataModule"]["tokenizer"]).mask_id is not None) == has_mask

    # The section holds what each test printed, on the last checkpoint, beside the same inputs' baselines.
    section = results.read_text().split("<!-- recipe_summarization:start -->\n", 1)[1]
    section = section.split("<!-- recipe_summarization:end -->", 1)[0]
    for start_, label in (("pretrained", "pretrained, fine-tuned"), ("scratch", "from scratch")):
        log = (runs / "logs" / f"squality_{start_}_test.log").read_text()
        assert re.search(rf"^checkpoint: .*{start_}/checkpoints/last\.ckpt$", log, re.M), log
        printed = re.search(
            r"^model \(long documents cut\): ROUGE-1 (\S+)  ROUGE-2 (\S+)  ROUGE-L (\S+)  ROUGE-Lsum \S+  GM (\S+)$",
            log,
            re.M,
        )
        assert printed, log
        row = re.search(rf"^\| squality: {label} \| (.*?) \| (\S+) \| (\S+) \| (\S+) \| (\S+) \|$", section, re.M)
        assert row and row.groups()[1:] == printed.groups(), section
    assert re.search(r"^\| squality: pretrained, fine-tuned \| pretraining 2 steps, [\d.]+ min, then fine-tuning 2 "
                     r"steps, [\d.]+ min \|", section, re.M), section  # fmt: skip
    assert re.search(
        r"^\| squality: Lead-100 baseline \| none \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", section, re.M
    )
    assert re.search(r"^\| squality: naive baseline \(SCROLLS: .*\) \| none \|", section, re.M), section
    assert re.search(r"^squality: the pretrained model's GM against naive and Lead: (above|[\d.]+ GM short of the .*); "
                     r"pretraining's gain over the same fine-tuning budget from scratch: [-+][\d.]+ GM\. ROUGE alone "
                     r"does not say whether a summary depends on its document: `benchmarks/rouge_control.py` scores "
                     r"it against another document's references too\.$", section, re.M), section  # fmt: skip
    assert f"python benchmarks/recipe_summarization.py {' '.join(args[:8])} --fit-arg=--model" in section
    assert "Budgets: pretraining 2 steps, then each fine-tuning 2 steps" in section
    assert "torch-handle fit --config=pretrain --trainer.default_root_dir=runs/recipe/pretrain" in section
    assert "--model.init_from=runs/recipe/pretrain" in section and "test --config=summarization" in section


def test_missing_files_and_a_used_run_folder_are_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        recipe.main(["--data", str(tmp_path), "--corpora", "qmsum"])
    assert exit_info.value.code == (
        f"error: {tmp_path}/qmsum/train.jsonl not found: run torch-handle prepare qmsum --out {tmp_path}"
    )
    for name in ("train_plot", "dev_plot", "train_all", "dev_all", "test_all"):
        (tmp_path / "squality").mkdir(exist_ok=True)
        (tmp_path / "squality" / f"{name}.jsonl").touch()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "pretrain").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        recipe.main(["--data", str(tmp_path), "--corpora", "squality", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == (
        f"error: {tmp_path}/out is not empty: pass a new --out folder, or --resume to continue it"
    )


def test_an_interrupted_recipe_resumes_where_it_stopped(tmp_path: Path) -> None:
    """Killed during the second fine-tuning: ``--resume`` keeps the recorded stages, continues that fit from its
    ``last.ckpt``, tests both runs, and says in the section which stages the first invocation ran."""
    for name in ("train_plot", "dev_plot", "train_all", "dev_all", "test_all"):
        (tmp_path / "data" / "squality").mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / "squality" / f"{name}.jsonl").touch()
    calls: list[list[str]] = []

    def cli(args: list[str], log: Path) -> str:
        calls.append(args)
        root = Path(next(a.split("=", 1)[1] for a in args if a.startswith("--trainer.default_root_dir=")))
        if args[0] == "test":
            scores = "ROUGE-1 20.00  ROUGE-2 4.00  ROUGE-L 10.00  ROUGE-Lsum 18.00  GM 9.28"
            return f"checkpoint: {root}/checkpoints/last.ckpt\nmodel: {scores}\nLead-100 baseline: {scores}\n"
        (root / "checkpoints").mkdir(parents=True, exist_ok=True)
        torch.save({"global_step": 2}, root / "checkpoints" / "last.ckpt")
        if root.name == "scratch" and "--ckpt_path=last" not in args:
            raise SystemExit("killed")  # after its first checkpoint
        return "trained"

    options = ["--data", str(tmp_path / "data"), "--corpora", "squality", "--out", str(tmp_path / "out")]
    options += ["--pretrain-steps", "2", "--finetune-steps", "2", "--results", str(tmp_path / "RESULTS.md")]
    with pytest.raises(SystemExit, match="^killed$"):
        recipe.main(options, cli=cli)
    recorded = json.loads((tmp_path / "out" / "stages.json").read_text())
    assert [stage["name"] for stage in recorded["stages"]] == ["pretrain", "squality/pretrained"]
    with pytest.raises(SystemExit, match="not empty: pass a new --out folder, or --resume to continue it$"):
        recipe.main(options, cli=cli)
    calls.clear()
    recipe.main([*options, "--resume"], cli=cli)
    assert [(args[0], args[2].rsplit("/", 1)[1]) for args in calls] == [
        ("fit", "scratch"), ("test", "pretrained"), ("test", "scratch"),
    ]  # fmt: skip
    assert calls[0][-1] == "--ckpt_path=last"
    section = (tmp_path / "RESULTS.md").read_text()
    assert "(resumed: pretrain, squality/pretrained kept from the first invocation)." in section
    assert recorded["machine"] in section
    with pytest.raises(SystemExit, match=f"^error: {tmp_path}/new holds no stages.json: run without --resume"):
        recipe.main([*options[:4], "--out", str(tmp_path / "new"), "--resume"], cli=cli)


def test_budgets_become_fit_options() -> None:
    assert recipe.budget(None, None, 80).args() == ["--trainer.max_time=00:01:20:00"]
    assert recipe.budget(90.5, 300, 80).args() == [
        "--trainer.max_time=00:01:30:30", "--trainer.max_steps=300", "--trainer.max_epochs=-1",
    ]  # fmt: skip
    assert str(recipe.budget(None, 300, 80)) == "300 steps" and str(recipe.budget(None, None, 40)) == "40 min"
    with pytest.raises(SystemExit, match="^error: a budget must be positive: pass minutes > 0 or steps > 0$"):
        recipe.budget(0, None, 80)
