"""Decoding controls (:mod:`torch_handle.model.logits`): each equals ``transformers``' logits processor, and our
decoding with them equals ``generate`` of ``transformers`` over the same model, greedy and beam, on every path."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from transformers import GenerationConfig, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput

from tests.test_lockstep_decoding import _stopped_by_peers
from torch_handle.model import CompiledDecode, ConfigError, Transformer, TransformerConfig, beam, generate
from torch_handle.model.logits import DecodingControls, process_scores

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB, BOS, EOS, PAD = 24, 1, 2, 0
CONFIG = TransformerConfig(
    src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, d_model=32, num_heads=2, num_encoder_layers=1, num_decoder_layers=2,
    d_ff=64, dropout=0.0, max_len=64,
)  # fmt: skip
# Each control alone, and all together; the ones that draw nothing also decode end to end against generate().
CONTROLS = {
    "no_repeat_ngram_size=1": DecodingControls(no_repeat_ngram_size=1),
    "no_repeat_ngram_size=2": DecodingControls(no_repeat_ngram_size=2),
    "no_repeat_ngram_size=3": DecodingControls(no_repeat_ngram_size=3),
    "repetition_penalty=1.6": DecodingControls(repetition_penalty=1.6),
    "repetition_penalty=0.7": DecodingControls(repetition_penalty=0.7),
    "min_new_tokens=6": DecodingControls(min_new_tokens=6),
    "deterministic, all": DecodingControls(no_repeat_ngram_size=2, repetition_penalty=1.3, min_new_tokens=5),
    "temperature=0.6": DecodingControls(do_sample=True, temperature=0.6),
    "top_k=4": DecodingControls(do_sample=True, top_k=4),
    "top_p=0.7": DecodingControls(do_sample=True, top_p=0.7),
    "sampling, all": DecodingControls(
        no_repeat_ngram_size=2,
        repetition_penalty=1.3,
        min_new_tokens=3,
        do_sample=True,
        temperature=0.8,
        top_k=9,
        top_p=0.85,
    ),  # fmt: skip
}
DETERMINISTIC = [name for name, controls in CONTROLS.items() if not controls.do_sample]


class _Wrapped(PreTrainedModel, GenerationMixin):
    """Our Transformer behind ``transformers``' generation API, recomputing the whole prefix at every step (no cache),
    with padding and BOS ruled out as our decoding rules them out: ``generate`` then runs its own loops and
    processors over our model's scores."""

    config_class = PretrainedConfig

    def __init__(self, model: Transformer) -> None:
        c = model.config
        ids = {"pad_token_id": c.pad_id, "bos_token_id": c.bos_id, "eos_token_id": c.eos_id}
        super().__init__(PretrainedConfig(is_encoder_decoder=True, decoder_start_token_id=c.bos_id, **ids))
        self.ours = model

    def get_encoder(self) -> nn.Module:
        ours = self.ours

        class Encoder(nn.Module):
            main_input_name = "input_ids"

            def forward(self, input_ids: Tensor, **kwargs: Any) -> BaseModelOutput:
                return BaseModelOutput(last_hidden_state=ours.encode(input_ids))

        return Encoder()

    def forward(self, decoder_input_ids: Tensor, encoder_outputs: Any, attention_mask: Tensor, **kwargs: Any) -> Any:
        logits = self.ours.decode(decoder_input_ids, encoder_outputs[0], attention_mask == 0).float()
        logits[..., [self.config.pad_token_id, self.config.decoder_start_token_id]] = float("-inf")
        return Seq2SeqLMOutput(logits=logits)

    def prepare_inputs_for_generation(self, decoder_input_ids: Tensor, **kwargs: Any) -> dict[str, Any]:
        return {
            "decoder_input_ids": decoder_input_ids,
            **{k: kwargs.get(k) for k in ("encoder_outputs", "attention_mask")},
        }


def _model(seed: int = 0, config: TransformerConfig = CONFIG) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(config).eval()
    with torch.no_grad():
        # EOS scored as the token this random model repeats most: outputs of a few tokens to the whole limit.
        model.lm_head.weight[EOS] = model.lm_head.weight[11] + 0.5 * model.lm_head.weight[EOS]
    return model


def _sources(rows: int = 4, seed: int = 3) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    src = torch.randint(3, VOCAB, (rows, 9), generator=generator)
    src[1, 6:] = PAD  # padding, a row shorter than the rest
    return src


def _generate_config(controls: DecodingControls, beams: int, new_tokens: int, **options: Any) -> GenerationConfig:
    fields = {k: v for k, v in dataclasses.asdict(controls).items() if k != "seed"}
    fields |= {"length_penalty": 1.0, "eos_token_id": EOS} | options
    return GenerationConfig(
        max_new_tokens=new_tokens, num_beams=beams, early_stopping=True, use_cache=False,
        pad_token_id=PAD, bos_token_id=BOS, decoder_start_token_id=BOS, **fields,
    )  # fmt: skip


def _theirs(
    model: Transformer, src: Tensor, controls: DecodingControls, beams: int, new_tokens: int, **options: Any
) -> list[list[int]]:
    """``generate`` of ``transformers`` over our model; ``options``: more of its ``GenerationConfig``."""
    wrapped = _Wrapped(model).eval()
    config = _generate_config(controls, beams, new_tokens, **options)
    out = wrapped.generate(src, attention_mask=(src != PAD).long(), generation_config=config)
    return [_until_eos(row[1:], options.get("eos_token_id", EOS)) for row in out.tolist()]


def _until_eos(row: list[int], eos: int = EOS) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row


def _ours(model: Transformer, src: Tensor, controls: DecodingControls | None, beams: int, **kwargs: Any) -> list:
    return [_until_eos(row) for row in generate(model, src, 14, beams, controls=controls, **kwargs).tolist()]


@pytest.mark.parametrize("beams", [False, True], ids=["greedy", "beam"])
@pytest.mark.parametrize("name", list(CONTROLS))
def test_each_control_equals_the_transformers_logits_processor(name: str, beams: bool) -> None:
    """Random decoder inputs (few distinct tokens, so n-grams repeat) and scores, at lengths before and after the
    minimum; beam search's scores are log-probabilities, where sampling keeps two tokens. The reference is the list
    ``generate`` itself builds for these options."""
    controls = CONTROLS[name]
    wrapped = _Wrapped(_model())
    config = _generate_config(controls, 3 if beams else 1, 16)
    wrapped._prepare_special_tokens(config, kwargs_has_attention_mask=True, device="cpu")
    processors = wrapped._get_logits_processor(config, input_ids_seq_length=1, device="cpu", model_kwargs={})
    c = controls
    assert len(processors) == sum(
        (c.no_repeat_ngram_size > 0, c.repetition_penalty != 1, c.min_new_tokens > 0)
        + (c.temperature != 1, c.top_k > 0, c.top_p < 1)
    )  # one per control set
    generator = torch.Generator().manual_seed(7)
    for length in (1, 2, 4, 7, 12):
        tokens = torch.randint(3, 8, (6, length), generator=generator)
        tokens[:, 0] = BOS
        scores = torch.randn(6, VOCAB, generator=generator) * 3
        if beams:
            scores = scores.log_softmax(dim=-1)
        expected = processors(tokens, scores.clone())
        torch.testing.assert_close(process_scores(controls, tokens, scores, EOS, beams), expected, rtol=0, atol=0)


@pytest.mark.parametrize("path", ["cached", "static"])
@pytest.mark.parametrize("beams", [1, 3])
@pytest.mark.parametrize("name", DETERMINISTIC)
def test_decoding_with_each_control_equals_transformers_generate(name: str, beams: int, path: str) -> None:
    """Our greedy decoding and beam search (over a dynamic cache, or a static one, whose steps a CUDA graph replays on
    a GPU) with a control equal ``generate`` with the same option, token for token; and the control changes them."""
    model, src, controls = _model(), _sources(rows=6), CONTROLS[name]
    ours = _ours(model, src, controls, beams, cuda_graph=path == "static")
    assert ours == _theirs(model, src, controls, beams, 14)
    assert ours != _ours(model, src, None, beams)


@pytest.mark.parametrize("beams", [1, 3])
def test_without_controls_decoding_equals_generate(beams: int) -> None:
    model, src = _model(), _sources()
    assert _ours(model, src, None, beams) == _theirs(model, src, DecodingControls(), beams, 14)


def test_top_k_1_sampling_equals_greedy_decoding() -> None:
    model, src = _model(), _sources()
    greedy = _ours(model, src, None, 1)
    for seed in range(3):
        assert _ours(model, src, DecodingControls(do_sample=True, top_k=1, seed=seed), 1) == greedy
    controls = DecodingControls(do_sample=True, top_k=1, no_repeat_ngram_size=2, min_new_tokens=4)
    assert _ours(model, src, controls, 1) == _theirs(model, src, controls, 1, 14)


@pytest.mark.parametrize("beams", [1, 3])
def test_a_seed_repeats_a_sample_in_any_batch_and_other_seeds_differ(beams: int) -> None:
    """A source's sample depends on the seed and the source alone, not on the rows decoded beside it or its padding:
    what makes sampling repeatable on any number of processes, each decoding its own rows."""
    model, src = _model(), _sources(rows=6)
    controls = DecodingControls(do_sample=True, temperature=1.5, seed=11)
    first = _ours(model, src, controls, beams)
    assert _ours(model, src, controls, beams) == first
    for rows in ([0], [1], [5, 2], [3, 4, 1]):
        width = int((src[rows] != PAD).sum(dim=1).max())
        assert _ours(model, src[rows, :width], controls, beams) == [first[i] for i in rows], rows
    others = [_ours(model, src, dataclasses.replace(controls, seed=seed), beams) for seed in (12, 13)]
    assert first not in others and others[0] != others[1]
    assert _ours(model, src, dataclasses.replace(controls, seed=None), beams) != first


@pytest.mark.parametrize("name", ["deterministic, all", "sampling, all"])
@pytest.mark.parametrize("beams", [1, 3])
def test_decoding_leaves_torch_random_stream_untouched(name: str, beams: int) -> None:
    """Validation's generate calls (seed None) draw nothing from torch's global generator, sampling or not: training's
    random stream, and so its dropout, is the same with or without them, on every rank."""
    model, src = _model(), _sources()
    before = torch.random.get_rng_state()
    _ours(model, src, CONTROLS[name], beams)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_sampling_draws_each_token_with_its_probability() -> None:
    """Gumbel noise hashed from the source, step and candidate: over many sources, the share of each token drawn is
    its softmax probability after the temperature and top-k."""
    controls = DecodingControls(do_sample=True, temperature=2.0, top_k=4, seed=5)
    src = torch.arange(20_000)[:, None] + 3  # one source per draw
    step = controls.bind(src, PAD, BOS, EOS)
    assert step is not None
    logits = torch.tensor([[-1.0, 0.0, 0.5, 1.0, 2.0, -3.0]]).expand(len(src), -1)
    drawn = step.greedy(logits, torch.zeros(len(src), 4, dtype=torch.long), None, 3).argmax(dim=-1)
    shares = torch.bincount(drawn, minlength=6).double() / len(src)
    kept = (torch.tensor([0.0, 0.5, 1.0, 2.0]) / 2).softmax(dim=0)  # the top 4, over the temperature
    expected = torch.cat([torch.zeros(1), kept, torch.zeros(1)])
    torch.testing.assert_close(shares, expected.double(), atol=0.015, rtol=0)


@pytest.mark.parametrize("beams", [1, 3])
def test_outputs_hold_no_repeated_ngram_and_at_least_the_minimum_length(beams: int) -> None:
    model, src = _model(), _sources(rows=6)
    for seed in range(3):
        controls = DecodingControls(no_repeat_ngram_size=2, min_new_tokens=8, do_sample=True, seed=seed)
        for row in _ours(model, src, controls, beams):
            body = row[:-1] if row[-1] == EOS else row
            assert len(body) >= 8, row
            grams = list(zip(body, body[1:], strict=False))
            assert len(grams) == len(set(grams)), row
    assert any(len(row) <= 8 for row in _ours(model, src, None, beams)), (
        "the minimum must matter for this test to check it"
    )


@pytest.mark.slow
@pytest.mark.parametrize("beams", [1, 3])
def test_compiled_decoding_with_controls_equals_eager_decoding(beams: int) -> None:
    """The compiled step (``torch_handle.load(..., compile=True)``) returns the logits; the controls process them
    outside it, so nothing recompiles for them."""
    model, src = _model(), _sources()
    compiled = CompiledDecode(model)
    for controls in (CONTROLS["deterministic, all"], CONTROLS["sampling, all"]):
        controls = dataclasses.replace(controls, seed=3) if controls.do_sample else controls
        assert _ours(model, src, controls, beams, decode=compiled) == _ours(model, src, controls, beams)


@pytest.mark.parametrize("path", ["cached", "static"])
@pytest.mark.parametrize("beams", [1, 3])
def test_forced_eos_ends_an_output_that_the_minimum_length_keeps_open(beams: int, path: str) -> None:
    """``min_new_tokens`` up to the limit rules EOS out at the last step, where ``forced_eos_id`` forces it: forcing
    comes after the controls, as in ``transformers``, so every output ends with EOS at the limit (forcing first left
    the last step nothing)."""
    model = _model(config=dataclasses.replace(CONFIG, forced_eos_id=EOS))
    src, controls = _sources(), DecodingControls(min_new_tokens=14, repetition_penalty=1.3)
    ours = _ours(model, src, controls, beams, cuda_graph=path == "static")
    assert ours == _theirs(model, src, controls, beams, 14, forced_eos_token_id=EOS)
    assert all(len(row) == 14 and row[-1] == EOS for row in ours), ours


@pytest.mark.parametrize("path", ["cached", "static"])
def test_beam_search_finishes_no_hypothesis_scored_minus_inf(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forced BOS leaves one finite candidate at the first step; the rest of ``topk``'s 2K are -inf ties in an
    order of its own. Where an EOS ranked among the best K of them, it finished a hypothesis scored -inf, which
    counted toward the K that end a source's search: the search then ended before ``generate``'s. The EOS here is a
    token this torch's ``topk`` ranks there; a lockstep call stopped by its peers finishes none either."""
    beams, vocab, forced, rows = 8, 1000, 5, 12
    ties = torch.full((rows, beams * vocab), float("-inf"))
    ties[:, forced] = 0
    tied = (ties.topk(2 * beams).indices[0, 1:beams] % vocab).tolist()
    eos = next(t for t in tied if t not in (PAD, BOS, forced))
    config = dataclasses.replace(
        CONFIG, src_vocab_size=vocab, tgt_vocab_size=vocab, eos_id=eos, forced_bos_id=forced
    )  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(config).eval()
    with torch.no_grad():  # EOS near a likely token's score: hypotheses finish at many lengths
        model.lm_head.weight[eos] = model.lm_head.weight[11] + 2.0 * model.lm_head.weight[eos]
    src = torch.randint(3, vocab, (rows, 9), generator=torch.Generator().manual_seed(3))
    finished: list[list[tuple[float, list[int]]]] = []
    best = beam._best
    monkeypatch.setattr(beam, "_best", lambda hyps: finished.extend(hyps) or best(hyps))
    options = {"cuda_graph": path == "static"}  # a length penalty that favours the late, long hypotheses
    ours = [_until_eos(row, eos) for row in generate(model, src, 14, beams, 3.0, **options).tolist()]
    theirs = _theirs(model, src, DecodingControls(), beams, 14, eos_token_id=eos, forced_bos_token_id=forced,
                     length_penalty=3.0)  # fmt: skip
    assert ours == theirs
    for steps in (0, 1, 2, 5):
        generate(model, src, 14, beams, 3.0, _stopped_by_peers(steps), **options)
    assert len(finished) == 5 * rows and all(hyps for hyps in finished)
    assert all(score > float("-inf") for hyps in finished for score, _ in hyps)


def test_bad_controls_are_one_line_naming_the_fix() -> None:
    from torch_handle.module import Seq2SeqModule

    with pytest.raises(ValueError, match=r"^top_k=5 acts only when sampling: pass do_sample=True too$"):
        DecodingControls(top_k=5)
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\] \(1 = off\), got 1.5$"):
        DecodingControls(do_sample=True, top_p=1.5)
    with pytest.raises(ConfigError, match=r"^--model.no_repeat_ngram_size must be >= 0 \(0 = off\), got -1$"):
        Seq2SeqModule(no_repeat_ngram_size=-1)


def test_the_modules_controls_become_the_checkpoints_decoding_defaults() -> None:
    """``torch_handle.load`` and exports read a checkpoint's decoding defaults from its hyper-parameters."""
    from torch_handle.export import Decoding
    from torch_handle.module import Seq2SeqModule

    chosen = {"no_repeat_ngram_size": 3, "min_new_tokens": 2, "do_sample": True, "top_p": 0.9, "seed": 4}
    module = Seq2SeqModule(transformer=CONFIG, vocab_size=VOCAB, max_new_tokens=16, **chosen)
    assert module.controls == DecodingControls(**chosen)
    assert Decoding.read(dict(module.hparams), module.config).controls() == module.controls


def test_help_documents_the_decoding_controls(capsys: pytest.CaptureFixture[str]) -> None:
    from torch_handle.cli import main

    with pytest.raises(SystemExit):
        main(["predict", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in ("no_repeat_ngram_size", "repetition_penalty", "min_new_tokens", "do_sample", "temperature", "top_k"):
        assert f"--model.{name}" in text, name
    assert "No n-gram of this many tokens appears twice in an output" in text


def test_controls_typed_for_test_or_predict_override_the_checkpoints() -> None:
    """``--model.no_repeat_ngram_size 3`` with ``--ckpt_path``: the user's, over a checkpoint that holds another value
    and over one written before the option existed."""
    from torch_handle.hparams import merge_checkpoint_options

    parsed = {"num_beams": 4, "no_repeat_ngram_size": 3, "do_sample": False, "transformer": {"d_model": 32}}
    for saved in ({"num_beams": 2, "no_repeat_ngram_size": 0, "do_sample": False}, {"num_beams": 2}):
        checkpoint = {**saved, "transformer": {"d_model": 32}}
        merged, notes = merge_checkpoint_options(checkpoint, parsed, {"no_repeat_ngram_size"}, set(), "last.ckpt")
        assert merged == {**saved, "no_repeat_ngram_size": 3, "transformer": {"d_model": 32}} and not notes


def test_a_runs_own_command_with_ckpt_path_resumes_it_despite_init_from() -> None:
    """``fit --model.init_from FOLDER`` killed, then the same command with ``--ckpt_path last``: the checkpoint's
    weights supersede the folder (it keeps ``init_from=None``), so the option is no contradiction, and unused: one
    note says so (typed or in a config)."""
    from torch_handle.hparams import merge_checkpoint_options

    checkpoint = {"init_from": None, "transformer": {"d_model": 32}}
    parsed = {"init_from": "bart-base/", "transformer": {"d_model": 32}}
    for typed, in_configs in (({"init_from"}, set()), (set(), {"init_from"})):
        merged, notes = merge_checkpoint_options(checkpoint, parsed, typed, in_configs, "last.ckpt")
        assert merged == checkpoint and notes == ["its weights, not init_from=bart-base/"]
    merged, notes = merge_checkpoint_options(checkpoint, checkpoint, set(), set(), "last.ckpt")
    assert merged == checkpoint and not notes


@pytest.mark.parametrize(("processes", "seed", "expected"), [(1, None, None), (2, None, 12345), (2, 7, 7)])
def test_seedless_sampling_on_several_processes_takes_rank_zeros_seed(
    processes: int, seed: int | None, expected: int | None
) -> None:
    """Ranks that split one source (tensor or context parallelism) must draw the same tokens: without a seed, each
    loop takes the one rank 0 broadcasts; one process keeps drawing afresh at each call; a given seed stays."""
    from types import SimpleNamespace

    from torch_handle.module import Seq2SeqModule

    module = Seq2SeqModule(transformer=CONFIG, vocab_size=VOCAB, max_new_tokens=16, do_sample=True, seed=seed)
    broadcast = SimpleNamespace(broadcast=lambda obj, src=0: 12345)  # what rank 0 sent
    module._trainer = SimpleNamespace(world_size=processes, strategy=broadcast)  # type: ignore[assignment]
    module.on_predict_epoch_start()
    assert module.decoding_controls.seed == expected
    assert module.decoding_controls == dataclasses.replace(module.controls, seed=expected)
