"""Real opus-mt folders (``source.spm``, ``target.spm``, ``vocab.json``, no tokenizer.json) against transformers'
``MarianTokenizer`` and ``MarianMTModel``, on tiny sentencepiece models trained here in milliseconds."""

from __future__ import annotations

import io
import json
import random
import re
import sys
from pathlib import Path

import huggingface_hub
import pytest
import sentencepiece as spm
import torch
import transformers

import torch_handle
from tests.test_pretrained import (
    TARGETS,
    TEXTS,
    WORDS,
    _save,
    assert_generate_matches,
    assert_generate_matches_transformers,
    assert_logits_match,
    assert_round_trip,
    marian_model,
)
from torch_handle.checkpoints import CheckpointError
from torch_handle.cli import main
from torch_handle.data import TranslationDataModule
from torch_handle.data.marian import PieceTokenizer
from torch_handle.data.tokenizer import Tokenizer
from torch_handle.errors import DataError
from torch_handle.export.__main__ import main as export_main
from torch_handle.module import Seq2SeqModule
from torch_handle.pretrained import pretrained_tokenizer

# Beyond TEXTS: an unknown character (one <unk> for the run), repeated spaces, a language code and a piece that
# vocab.json lacks (<unk> too, as in MarianTokenizer).
MORE_TEXTS = ["w1  w2 ß w3", " w100 w101 ", ">>de<< w7 w8", "w119w118"]
DROPPED = "w5"  # the source model's pieces of this word are left out of vocab.json


def _spm(sentences: list[str], vocab_size: int) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size, model_type="unigram",
        unk_id=0, eos_id=1, bos_id=-1, pad_id=-1, hard_vocab_limit=False, minloglevel=2,
    )  # fmt: skip
    return model.getvalue()


def _tokenizer(folder: Path, separate: bool = False) -> transformers.MarianTokenizer:
    """Source and target sentencepiece models of different sizes (so they cut a text differently) over one
    ``vocab.json`` of both models' pieces, Marian's layout: ``</s>`` 0, ``<unk>`` 1, ``<pad>`` last. ``separate``:
    ``vocab.json`` of the source model's pieces and ``target_vocab.json`` of the target model's, ``<pad>`` 2 in both."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    pieces: dict[str, dict[str, None]] = {}
    dropped: set[str] = set()
    for name, size in (("source.spm", 150), ("target.spm", 60)):
        sentences = [" ".join(rng.choices(WORDS, k=6)) for _ in range(400)]
        (folder / name).write_bytes(_spm(sentences, size))
        model = spm.SentencePieceProcessor(model_file=str(folder / name))
        pieces[name] = dict.fromkeys(model.id_to_piece(i) for i in range(model.get_piece_size()))
        if name == "source.spm":
            dropped = set(model.encode(DROPPED, out_type=str))

    def vocab(*models: str) -> dict[str, int]:
        words = [p for m in models for p in pieces[m] if p not in ("<unk>", "</s>", *dropped)]
        tokens = (
            ["</s>", "<unk>", "<pad>", ">>de<<", *words] if separate else ["</s>", "<unk>", ">>de<<", *words, "<pad>"]
        )
        return {token: i for i, token in enumerate(dict.fromkeys(tokens))}

    files = [str(folder / name) for name in ("source.spm", "target.spm", "vocab.json")]
    if not separate:
        (folder / "vocab.json").write_text(json.dumps(vocab("source.spm", "target.spm")))
        return transformers.MarianTokenizer(*files)
    (folder / "vocab.json").write_text(json.dumps(vocab("source.spm")))
    (folder / "target_vocab.json").write_text(json.dumps(vocab("target.spm")))
    return transformers.MarianTokenizer(
        *files, target_vocab_file=str(folder / "target_vocab.json"), separate_vocabs=True
    )


def _folder(
    path: Path, spm_folder: Path, pad_bias: float, positions: int = 64, separate: bool = False
) -> tuple[Path, object, object]:
    """A tiny opus-mt folder as the hub holds it; ``pad_bias`` added to ``<pad>``'s logit (a trained model's is far
    below the rest: padding is never a target, and opus-mt's ``bad_words_ids`` rules it out)."""
    build = lambda: marian_model(_tokenizer(spm_folder, separate), positions)  # noqa: E731
    path, hf, tok = _save("marian", "safetensors", path, build)
    with torch.no_grad():
        hf.final_logits_bias[0, tok.pad_token_id] += pad_bias
    hf.save_pretrained(path)
    assert not (path / "tokenizer.json").exists() and (path / "source.spm").is_file()
    return path, hf, tok


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, object]:
    return _folder(tmp_path_factory.mktemp("opus-mt"), tmp_path_factory.mktemp("spm"), pad_bias=-20.0)


@pytest.fixture(scope="module")
def separate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, object]:
    """An opus-mt folder with separate vocabularies: ``vocab.json`` for sources, ``target_vocab.json`` for targets."""
    path = tmp_path_factory.mktemp("opus-mt-separate")
    return _folder(path, tmp_path_factory.mktemp("spm-separate"), pad_bias=-20.0, separate=True)


def test_sources_and_targets_encode_as_marian_tokenizer(folder: tuple[Path, object, object]) -> None:
    path, _, tok = folder
    tokenizer = pretrained_tokenizer(path)
    assert isinstance(tokenizer, PieceTokenizer) and tokenizer.vocab_size == len(tok)
    texts = TEXTS + MORE_TEXTS
    eos = [tok.eos_token_id]
    assert [ids + eos for ids in tokenizer.encode_batch(texts)] == tok(texts)["input_ids"]
    assert [ids + eos for ids in tokenizer.encode_target_batch(texts)] == tok(text_target=texts)["input_ids"]
    assert tokenizer.encode_batch(texts) != tokenizer.encode_target_batch(texts)  # two models, cut apart
    unk = tok.unk_token_id
    assert unk in tokenizer.encode(MORE_TEXTS[0]) and unk in tokenizer.encode(DROPPED)  # a character, a dropped piece
    assert tokenizer.encode(MORE_TEXTS[2])[0] == tok.convert_tokens_to_ids(">>de<<")
    rows = [ids + eos + [tok.pad_token_id] for ids in tokenizer.encode_target_batch(texts)]
    assert tokenizer.decode_batch(rows) == tok.batch_decode(rows, skip_special_tokens=True)
    restored = Tokenizer.from_str(tokenizer.to_str())  # as checkpoints keep it
    assert restored.specials == tokenizer.specials
    assert restored.encode_target_batch(texts) == tokenizer.encode_target_batch(texts)


def test_a_forged_marian_tokenizer_in_a_checkpoint_is_one_line(folder: tuple[Path, object, object]) -> None:
    """A checkpoint's tokenizer JSON with a piece id that would size a table of billions, or spm bytes that are not
    base64, is refused in one line."""
    saved = json.loads(pretrained_tokenizer(folder[0]).to_str())
    forged = json.loads(json.dumps(saved))
    forged["marian"]["vocab"]["<pad>"] = 2**40
    with pytest.raises(DataError, match=r"^not a tokenizer JSON \(piece '<pad>' has id 1099511627776, outside"):
        Tokenizer.from_str(json.dumps(forged))
    saved["marian"]["models"]["target.spm"] = "not base64!"
    with pytest.raises(DataError, match=r"^not a tokenizer JSON \(a sentencepiece model that is not base64: "):
        Tokenizer.from_str(json.dumps(saved))


def test_separate_vocabularies_encode_decode_and_translate_as_transformers(
    separate: tuple[Path, object, object], tmp_path: Path
) -> None:
    """Sources take their ids from ``vocab.json``, targets from ``target_vocab.json``; outputs decode through the
    target's; the model (two embeddings) translates as ``generate`` does, and ``--format hf`` writes it back."""
    path, hf, tok = separate
    assert hf.config.vocab_size != hf.config.decoder_vocab_size and not hf.config.share_encoder_decoder_embeddings
    tokenizer = pretrained_tokenizer(path)
    texts, eos = TEXTS + MORE_TEXTS, [tok.eos_token_id]
    assert [ids + eos for ids in tokenizer.encode_batch(texts)] == tok(texts)["input_ids"]
    assert [ids + eos for ids in tokenizer.encode_target_batch(texts)] == tok(text_target=texts)["input_ids"]
    assert tokenizer.vocab_size == hf.config.decoder_vocab_size
    rows = tok(text_target=texts)["input_ids"]
    assert tokenizer.decode_batch(rows) == tok.batch_decode(rows, skip_special_tokens=True)
    restored = Tokenizer.from_str(tokenizer.to_str())
    assert restored.encode_target_batch(texts) == tokenizer.encode_target_batch(texts)
    assert_logits_match(*separate, length=6)
    assert_generate_matches_transformers(separate, num_beams=4)
    assert_round_trip(*separate, tmp_path / "out")
    assert (tmp_path / "out" / "target_vocab.json").is_file()


def test_separate_vocabularies_without_target_vocab_json_is_one_line(
    separate: tuple[Path, object, object], tmp_path: Path
) -> None:
    for file in separate[0].iterdir():
        if file.name != "target_vocab.json":
            (tmp_path / file.name).write_bytes(file.read_bytes())
    with pytest.raises(DataError, match="^.* has separate vocabularies but no target_vocab.json: download the model"):
        torch_handle.load(tmp_path)


def test_logits_match_transformers(folder: tuple[Path, object, object]) -> None:
    assert_logits_match(*folder, length=6)


@pytest.mark.parametrize("num_beams", [1, 4])
def test_translate_matches_generate(folder: tuple[Path, object, object], num_beams: int) -> None:
    expected = assert_generate_matches_transformers(folder, num_beams)
    assert len({int((row != folder[2].pad_token_id).sum()) for row in expected}) > 1, "outputs of one length"


def test_hf_export_writes_marian_s_tokenizer_files(folder: tuple[Path, object, object], tmp_path: Path) -> None:
    """--format hf writes source.spm, target.spm and vocab.json back: transformers' MarianTokenizer reads them, and its
    model generates as the original."""
    assert_round_trip(*folder, tmp_path / "out")
    assert isinstance(transformers.AutoTokenizer.from_pretrained(tmp_path / "out"), transformers.MarianTokenizer)


def test_beam_search_scores_a_likely_pad_as_transformers(tmp_path: Path) -> None:
    """``bad_words_ids`` leave the other tokens' log-probabilities as they were (transformers rules them out after
    normalizing): with a likely ``<pad>``, renormalizing would change the beams' scores and order."""
    path, hf, tok = _folder(tmp_path / "opus-mt", tmp_path / "spm", pad_bias=0.0)
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    assert_generate_matches(path, tok, hf.generate(**batch, num_beams=4)[:, 1:], num_beams=4)


def test_init_from_data_encodes_targets_with_target_spm(folder: tuple[Path, object, object], tmp_path: Path) -> None:
    """``fit --model.init_from FOLDER``: the data module reads the folder's tokenizer, and its rows are the batch
    ``MarianTokenizer(sources, text_target=targets)`` makes."""
    path, _, tok = folder
    files = _data(tmp_path / "data")
    data = TranslationDataModule(str(files), tokenizer_path=str(path), max_source_tokens=64, max_target_tokens=64)
    data.setup("fit")
    batch = data.collator(data.dataset("train").examples)
    reference = tok(TEXTS, text_target=TARGETS, return_tensors="pt", padding=True)
    assert torch.equal(batch["src"], reference["input_ids"])
    assert torch.equal(batch["tgt"][:, 1:], reference["labels"])
    assert data.vocab_size == len(tok) and data.tokenizer.encode_batch(TARGETS) != data.tokenizer.encode_target_batch(
        TARGETS
    )


@pytest.mark.parametrize(
    "damage",
    [lambda b: b[: len(b) // 2], lambda b: b"\x80\x04\x95" + b"\x00" * 40, lambda b: b""],
    ids=["truncated", "pickle", "empty"],
)
def test_a_damaged_spm_is_one_line(folder: tuple[Path, object, object], tmp_path: Path, damage: object) -> None:
    path, _, _ = folder
    for file in path.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    (tmp_path / "target.spm").write_bytes(damage((path / "target.spm").read_bytes()))  # type: ignore[operator]
    with pytest.raises(DataError) as error:
        torch_handle.load(tmp_path)
    assert "\n" not in str(error.value) and "target.spm" in str(error.value), str(error.value)


def stand_in_opus_mt(path: Path) -> Path:
    """A tiny opus-mt folder at ``path`` where configs/translation_opus_mt.yaml expects Helsinki-NLP/opus-mt-en-de,
    which cannot be downloaded here: its positions hold the config's max_new_tokens."""
    return _folder(path, path.with_name(f"{path.name}-spm"), pad_bias=-20.0, positions=128)[0]


HUB_ID = "Helsinki-NLP/opus-mt-en-de"  # translation_opus_mt.yaml's init_from


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache, offline: nothing reaches the network."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))  # read at import: set it too
    return cache


def _cache(folder: Path, cache: Path, repo_id: str) -> None:
    """``folder`` as the hub cache holds a download of ``repo_id``: links in ``snapshots/REV`` into ``blobs/``, and
    ``refs/main`` naming ``REV``."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    revision = "0" * 40
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / revision).mkdir(parents=True)
    for i, file in enumerate(sorted(folder.iterdir())):
        blob = repo / "blobs" / f"{i:064x}"
        blob.write_bytes(file.read_bytes())
        (repo / "snapshots" / revision / file.name).symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


@pytest.mark.parametrize("how", ["load", "init_from"])
def test_a_hub_id_offline_and_not_cached_is_one_line(hub_cache: Path, how: str) -> None:
    fix = f"download it where the hub is reachable (hf download {HUB_ID} --local-dir FOLDER) and pass that folder"
    option = "torch_handle.load" if how == "load" else "--model.init_from"
    with pytest.raises(CheckpointError) as error:
        torch_handle.load(HUB_ID) if how == "load" else Seq2SeqModule(vocab_size=100, init_from=HUB_ID)
    assert str(error.value) == (
        f"{option} {HUB_ID} is not a local path, and the Hugging Face hub cache does not hold it (HF_HUB_OFFLINE is "
        f"set): {fix}"
    )


def test_a_missing_path_that_no_hub_id_spells_is_missing(hub_cache: Path) -> None:
    with pytest.raises(CheckpointError, match="^--model.init_from runs--x/y does not exist: pass "):
        Seq2SeqModule(vocab_size=100, init_from="runs--x/y")  # the hub refuses "--" in ids


def test_a_cached_hub_id_loads_offline(folder: tuple[Path, object, object], hub_cache: Path) -> None:
    path, _, _ = folder
    _cache(path, hub_cache, HUB_ID)
    assert torch_handle.load(HUB_ID).translate(TEXTS) == torch_handle.load(path).translate(TEXTS)


def _data(folder: Path) -> Path:
    """Translation files of TEXTS and TARGETS for every split (Multi30k's test split too)."""
    folder.mkdir()
    for split in ("train", "val", "test", "test_2016_flickr"):
        (folder / f"{split}.en").write_text("\n".join(TEXTS) + "\n")
        (folder / f"{split}.de").write_text("\n".join(TARGETS) + "\n")
    return folder


QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


def test_validate_test_predict_with_ckpt_path_a_folder(
    folder: tuple[Path, object, object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--ckpt_path FOLDER`` evaluates the folder's model with its tokenizer, as ``torch_handle.load`` decodes it;
    ``fit`` refuses it in one line."""
    path, _, _ = folder
    data, out = _data(tmp_path / "data"), tmp_path / "out.txt"
    common = [f"--data.init_args.data_dir={data}", f"--trainer.default_root_dir={tmp_path / 'run'}", *QUIET]
    args = [*common, "--model.max_new_tokens=11", f"--ckpt_path={path}"]
    main(["validate", *args])
    main(["test", *args])
    assert f"checkpoint: {path}\n" in capsys.readouterr().out
    main(["predict", *args, f"--data.init_args.predict_file={data / 'test.en'}", f"--prediction_writer.output={out}"])
    assert out.read_text().splitlines() == torch_handle.load(path).translate(TEXTS, num_beams=4, max_new_tokens=11)
    with pytest.raises(SystemExit) as error:
        main(["fit", *common, f"--ckpt_path={path}"])
    assert error.value.code == f"error: {path} is a Hugging Face model folder: start from it with --model.init_from"


def test_fit_init_from_a_cached_hub_id_then_export_back(hub_cache: Path, tmp_path: Path) -> None:
    """``configs/translation_opus_mt.yaml`` as shipped, its hub id served offline by the cache (a tiny model standing
    in): fit starts from the folder's weights and tokenizer, and the run exports back to files MarianTokenizer reads
    (test_configs trains every config that starts from a folder; this is the hub id's path)."""
    _cache(stand_in_opus_mt(tmp_path / "opus-mt"), hub_cache, HUB_ID)
    run = tmp_path / "run"
    config = str(Path(__file__).resolve().parents[1] / "configs" / "translation_opus_mt.yaml")
    data = f"--data.init_args.data_dir={_data(tmp_path / 'data')}"
    main(["fit", f"--config={config}", data, f"--trainer.default_root_dir={run}", "--trainer.max_steps=2", *QUIET])
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 2 and checkpoint["hyper_parameters"]["init_from"] is None
    assert checkpoint["hyper_parameters"]["transformer"]["sinusoid_layout"] == "halves"  # Marian's, from the folder
    export_main([str(run / "checkpoints" / "last.ckpt"), str(tmp_path / "hf"), "--format", "hf"])
    original = transformers.AutoTokenizer.from_pretrained(tmp_path / "opus-mt")
    back = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert back(TEXTS, text_target=TARGETS)["labels"] == original(TEXTS, text_target=TARGETS)["labels"]


def test_without_the_pretrained_extra_a_spm_folder_is_one_line(
    folder: tuple[Path, object, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No transformers, or one whose converter ignores the sentencepiece model's normalizer settings (before 5.24)."""
    expected = "reading source.spm needs transformers>=5.24 and sentencepiece: pip install 'torch-handle[pretrained]'"
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "transformers.convert_slow_tokenizer", None)  # as if not installed
        with pytest.raises(DataError, match=f"^{re.escape(expected)}$"):
            pretrained_tokenizer(folder[0])
    # transformers' lazy module replaces itself in sys.modules once loaded: patch the one imports find
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.23.0")
    with pytest.raises(DataError, match=f"^{re.escape(expected)}$"):
        pretrained_tokenizer(folder[0])
