"""A built-in, learnable translation task generated in memory, so the quickstart needs no download.

The source language is a small English grammar (determiners, numbers, adjectives, nouns, verbs in present
and past, negation, prepositional phrases). The target language has its own words and its own rules, so a
model has to learn more than a word-for-word lexicon:

- verb last (SVO becomes SOV), negation particle just before the verb;
- adjectives after the noun, numbers after the adjectives;
- plural nouns take the suffix ``-j``; the past tense takes the verb suffix ``-ta``;
- prepositions become postpositions.

For example ``the two big dogs saw a cat near my house`` becomes
``la hundoj granda du vidta un kato mia domo apud``. Each source sentence has exactly one translation,
so a small Transformer reaches a high BLEU within minutes on a laptop CPU.
"""

import random
import zlib
from dataclasses import dataclass

from torch_handle.errors import DataError

DEMO_SPLITS = ("train", "val", "test")

# source noun (singular) -> target noun; source plural is the noun + "s"
_NOUNS = {
    "dog": "hundo",
    "cat": "kato",
    "bird": "birdo",
    "horse": "cevalo",
    "cook": "kuiristo",
    "singer": "kantisto",
    "farmer": "farmisto",
    "teacher": "instruisto",
    "king": "rego",
    "sailor": "maristo",
    "girl": "knabino",
    "boy": "knabo",
    "friend": "amiko",
    "baker": "bakisto",
    "doctor": "kuracisto",
    "student": "studento",
}
_ADJECTIVES = {
    "big": "granda",
    "small": "malgranda",
    "red": "ruga",
    "old": "olda",
    "young": "juna",
    "happy": "felica",
    "quiet": "kvieta",
    "green": "verda",
    "tired": "laca",
    "clever": "sagxa",
    "brave": "kuragxa",
    "hungry": "malsata",
}
# source verb: (third person singular, plural, past) -> target stem
_VERBS = {
    ("sees", "see", "saw"): "vid",
    ("likes", "like", "liked"): "sxat",
    ("chases", "chase", "chased"): "cas",
    ("finds", "find", "found"): "trov",
    ("helps", "help", "helped"): "asist",
    ("follows", "follow", "followed"): "sekv",
    ("paints", "paint", "painted"): "pentr",
    ("calls", "call", "called"): "vok",
    ("feeds", "feed", "fed"): "nutr",
    ("visits", "visit", "visited"): "vizit",
    ("teaches", "teach", "taught"): "instru",
    ("meets", "meet", "met"): "renkont",
}
_PLACES = {
    "house": "domo",
    "river": "rivero",
    "tree": "arbo",
    "market": "bazaro",
    "school": "lernejo",
    "garden": "gxardeno",
    "bridge": "ponto",
    "church": "pregxejo",
}
_PREPOSITIONS = {
    "near": "apud",
    "behind": "malantaux",
    "under": "sub",
    "in": "en",
    "beside": "flanke",
    "above": "super",
}
_SINGULAR_DETERMINERS = {"the": "la", "a": "un", "this": "ci", "my": "mia", "every": "ciu"}
_PLURAL_DETERMINERS = {"the": "la", "these": "cij", "my": "miaj", "": ""}
_NUMBERS = {"two": "du", "three": "tri", "four": "kvar", "five": "kvin", "many": "multaj"}
_NEGATION = {"present_singular": "does not", "present_plural": "do not", "past": "did not"}
_TARGET_NEGATION = "ne"
_TARGET_PLURAL = "j"
_TARGET_PAST = "ta"
_MIN_WORDS, _MAX_WORDS = 4, 14


@dataclass(frozen=True)
class _Phrase:
    source: list[str]
    target: list[str]
    plural: bool


def _noun_phrase(rng: random.Random, nouns: dict[str, str], max_adjectives: int) -> _Phrase:
    """A determiner/number, up to ``max_adjectives`` adjectives and a noun, in both languages."""
    plural = rng.random() < 0.35
    adjectives = rng.sample(sorted(_ADJECTIVES), rng.randint(0, max_adjectives))
    noun = rng.choice(sorted(nouns))
    source_adj = list(adjectives)
    target_adj = [_ADJECTIVES[a] for a in adjectives]
    if plural:
        det = rng.choice(sorted(_PLURAL_DETERMINERS))
        number = rng.choice(sorted(_NUMBERS)) if rng.random() < 0.6 else ""
        source = [det, number, *source_adj, noun + "s"]
        target = [
            _PLURAL_DETERMINERS[det],
            nouns[noun] + _TARGET_PLURAL,
            *target_adj,
            _NUMBERS.get(number, ""),
        ]
    else:
        det = rng.choice(sorted(_SINGULAR_DETERMINERS))
        source = [det, *source_adj, noun]
        target = [_SINGULAR_DETERMINERS[det], nouns[noun], *target_adj]
    return _Phrase([w for w in source if w], [w for w in target if w], plural)


def _sentence(rng: random.Random) -> tuple[str, str]:
    """One source sentence and its translation, within the word-count bounds."""
    while True:
        subject = _noun_phrase(rng, _NOUNS, max_adjectives=2)
        obj = _noun_phrase(rng, _NOUNS, max_adjectives=2)
        forms, stem = rng.choice(sorted(_VERBS.items()))
        past = rng.random() < 0.4
        negated = rng.random() < 0.25
        if past:
            tense = "past"
        else:
            tense = "present_plural" if subject.plural else "present_singular"
        if negated:
            source_verb = [*_NEGATION[tense].split(), forms[1]]
        else:
            source_verb = [forms[2] if past else forms[1] if subject.plural else forms[0]]
        target_verb = ([_TARGET_NEGATION] if negated else []) + [stem + (_TARGET_PAST if past else "")]
        source = subject.source + source_verb + obj.source
        target = subject.target + obj.target
        if rng.random() < 0.4:
            prep = rng.choice(sorted(_PREPOSITIONS))
            place = _noun_phrase(rng, _PLACES, max_adjectives=1)
            source += [prep, *place.source]
            target += [*place.target, _PREPOSITIONS[prep]]
        target += target_verb
        if _MIN_WORDS <= len(source) <= _MAX_WORDS:
            return " ".join(source), " ".join(target)


def _split_of(source: str) -> str:
    """Assigns a sentence to a split by a stable hash of its text, which keeps the splits disjoint."""
    bucket = zlib.crc32(source.encode("utf-8")) % 20
    return "test" if bucket == 0 else "val" if bucket == 1 else "train"


def demo_corpus(split: str, size: int, seed: int) -> list[tuple[str, str]]:
    """Generates ``size`` distinct (source, target) pairs of the demo task.

    Args:
        split: ``"train"``, ``"val"`` or ``"test"``. A sentence belongs to exactly one split (by a hash of
            its text), so no evaluation sentence is ever seen in training, whatever the sizes and seed.
        size: Number of pairs; all distinct within the split.
        seed: Seeds the generator; the same (split, size, seed) always gives the same pairs, in any process.

    Returns:
        The pairs, source first.
    """
    if split not in DEMO_SPLITS:
        raise DataError(f"unknown demo split {split!r}; use one of {', '.join(DEMO_SPLITS)}")
    rng = random.Random(f"torch-handle-demo-{seed}-{split}")  # str seeds hash the same in every process
    pairs: dict[str, str] = {}
    while len(pairs) < size:
        source, target = _sentence(rng)
        if _split_of(source) == split:
            pairs.setdefault(source, target)
    return list(pairs.items())
