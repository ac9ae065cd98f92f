"""``export --format ctranslate2`` of imported models: the Hugging Face folder we write, converted by CTranslate2's own
converter, scores and translates as transformers' model of the original folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.test_pretrained import TEXTS, _save
from tests.test_pretrained_marian import _folder
from tests.test_pretrained_t5 import _save as _save_t5
from torch_handle.export.__main__ import main as export_main
from torch_handle.pretrained import load_pretrained
from torch_handle.pretrained.ctranslate2 import write_converted
from torch_handle.pretrained.writer import export_folder

ctranslate2 = pytest.importorskip("ctranslate2")


def _built(family: str, tmp_path: Path) -> tuple[Path, object, object]:
    if family == "marian":  # an opus-mt folder, its <pad> row zero as in opus-mt's: CTranslate2 starts from zeros
        path, hf, tok = _folder(tmp_path / "in", tmp_path / "spm", pad_bias=-20.0)
        with torch.no_grad():
            hf.get_decoder().embed_tokens.weight[hf.config.pad_token_id] = 0
        hf.save_pretrained(path)
        return path, hf, tok
    if family == "t5":
        return _save_t5("t5-v1.0", tmp_path / "in")
    return _save(family, "safetensors", tmp_path / "in")


@pytest.mark.parametrize("family", ["bart", "mbart", "marian", "pegasus", "t5"])
def test_a_converted_imported_model_scores_and_translates_as_transformers(family: str, tmp_path: Path) -> None:
    path, hf, tok = _built(family, tmp_path)
    out = write_converted(*load_pretrained(path), tmp_path / "ct2")
    translator = ctranslate2.Translator(str(out))
    sources = [tok.convert_ids_to_tokens(ids) for ids in tok(TEXTS)["input_ids"]]
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    config = hf.generation_config
    expected = hf.generate(**batch, num_beams=1, forced_eos_token_id=None)  # CTranslate2 forces no end
    specials = {config.pad_token_id, config.eos_token_id, config.decoder_start_token_id}
    targets = [[i for i in row.tolist()[1:] if i not in specials] for row in expected]
    with torch.no_grad():  # the log-probability of every target token, teacher-forced
        rows = [[config.decoder_start_token_id, *t] for t in targets]
        width = max(map(len, rows))
        inputs = torch.tensor([r + [config.pad_token_id] * (width - len(r)) for r in rows])
        log_probs = hf(**batch, decoder_input_ids=inputs).logits.log_softmax(-1)
    scored = translator.score_batch(sources, [tok.convert_ids_to_tokens(t) for t in targets])
    for i, (target, result) in enumerate(zip(targets, scored, strict=True)):
        reference = [float(log_probs[i, j, token]) for j, token in enumerate(target)]
        assert result.log_probs[: len(target)] == pytest.approx(reference, abs=1e-4)
    # Translation: a forced first token (BART's <s>, mBART's language code) is a target prefix in CTranslate2.
    forced = [] if config.forced_bos_token_id is None else [config.forced_bos_token_id]
    start = [] if translator_has_start(out) else [config.decoder_start_token_id]
    prefix = [tok.convert_ids_to_tokens(start + forced)] * len(sources) if start + forced else None
    length = config.max_length - 1
    options = {"beam_size": 1, "max_decoding_length": length, "min_decoding_length": 0}
    results = translator.translate_batch(sources, target_prefix=prefix, **options)
    got = [tok.convert_tokens_to_ids(r.hypotheses[0][len(start) :]) for r in results]
    assert got == [
        [i for i in row.tolist()[1:] if i not in (config.pad_token_id, config.eos_token_id)] for row in expected
    ]


def translator_has_start(out: Path) -> bool:
    """Whether CTranslate2 starts the decoder itself (mBART's converter leaves the start to the target prefix)."""
    return json.loads((out / "config.json").read_text()).get("decoder_start_token") is not None


@pytest.mark.parametrize("source", ["folder", "export"])
@pytest.mark.parametrize("kind", ["marian-separate", "t5-v1.1", "mt5-tied"])
def test_what_ctranslate2_converts_apart_is_refused_in_one_line(kind: str, source: str, tmp_path: Path) -> None:
    """Marian with separate vocabularies (one vocabulary in CTranslate2) and a T5 whose output is not scaled
    (converted, its outputs were scaled: measured with CTranslate2 4.8.5) are refused with CTranslate2's reason
    before anything is written, from the Hugging Face folder and from an export of it (as a fine-tuned run's)."""
    if kind == "marian-separate":
        path, _, _ = _folder(tmp_path / "in", tmp_path / "spm", pad_bias=-20.0, separate=True)
        reason = "separate source and target vocabularies: CTranslate2's Marian converter writes one vocabulary; "
    else:
        path, _, _ = _save_t5(kind, tmp_path / "in")
        reason = "scale_decoder_output=False (T5 v1.1, Flan-T5, mT5): CTranslate2 4.8 scales T5's output when "
    if source == "export":
        path = export_folder(path, tmp_path / "model.safetensors")
    with pytest.raises(SystemExit) as error:
        export_main([str(path), str(tmp_path / "ct2"), "--format", "ctranslate2"])
    assert str(error.value.code).startswith(f"error: {reason}"), error.value.code
    assert "\n" not in str(error.value.code) and not (tmp_path / "ct2").exists()
