"""The long-context recall haystack: filler prose with access codes planted at known depths.

Everything is generated from a seed, so a run is repeatable and nothing is downloaded. The filler
is built from a fixed vocabulary of lower-case words with no digits, so a planted code (upper-case
letters and digits) can never occur in it by chance, and every code is asked for by a key (an
adjective and a noun) that appears exactly once in the document.

Depth is measured in filler tokens: a code at depth 0.25 follows the first quarter of the filler's
tokens, depth 0 opens the document and depth 1 closes it. Length is measured in prompt tokens of the
model's own chat format (the messages as the model sees them), so "context length 32768" means the
prompt the model prefills has at most 32768 tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

CODE_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"  # no 0/O, 1/I: a misread is a miss, not a near-miss
_ADJECTIVES = (
    "amber",
    "silent",
    "crimson",
    "hollow",
    "northern",
    "golden",
    "quiet",
    "frozen",
    "scarlet",
    "gentle",
    "ancient",
    "bright",
    "copper",
    "distant",
    "emerald",
    "fallen",
    "hidden",
    "iron",
    "jade",
    "lonely",
    "marble",
    "narrow",
    "olive",
    "pale",
    "restless",
    "silver",
    "tidal",
    "velvet",
    "wild",
    "young",
)
_NOUNS = (
    "falcon",
    "harbor",
    "lantern",
    "meadow",
    "orchard",
    "river",
    "tower",
    "violin",
    "willow",
    "compass",
    "glacier",
    "heron",
    "island",
    "journal",
    "kettle",
    "lighthouse",
    "mirror",
    "needle",
    "otter",
    "pillar",
    "quarry",
    "saddle",
    "thistle",
    "umbrella",
    "valley",
    "wagon",
    "anchor",
    "beacon",
    "canyon",
    "dragon",
)
_SUBJECTS = (
    "the old farmer",
    "a tired traveller",
    "the village council",
    "the river",
    "a small bird",
    "the northern wind",
    "the librarian",
    "a quiet student",
    "the market crowd",
    "the evening train",
    "the weaver",
    "a patient teacher",
    "the harbor master",
    "the morning fog",
    "a wandering poet",
)
_VERBS = (
    "watched",
    "remembered",
    "carried",
    "described",
    "followed",
    "painted",
    "ignored",
    "counted",
    "repaired",
    "praised",
    "questioned",
    "measured",
    "gathered",
    "visited",
    "explained",
)
_OBJECTS = (
    "the long shadows of the hills",
    "a basket of ripe apples",
    "the story of the flood",
    "the colors of the autumn sky",
    "an old map of the coast",
    "the sound of distant bells",
    "the path along the stone wall",
    "a letter from the capital",
    "the rules of the winter games",
    "the roots of the great oak",
    "the price of grain at the fair",
    "a song about the sea",
    "the cracks in the bridge",
    "the names of the stars",
    "the smell of bread in the square",
)
_CODAS = (
    "before the rain began",
    "while the lamps were lit",
    "without saying a word",
    "as the season turned",
    "for reasons nobody recalled",
    "in the middle of the afternoon",
    "after the festival ended",
    "with great care",
    "once again",
    "long after midnight",
)

INSTRUCTION = (
    "Below is a long document. Hidden in it are access codes, each one stated once. Read the "
    "document, then answer the question after it."
)


@dataclass(frozen=True)
class Needle:
    """One planted code: the key it is asked for by, the code, and the depth it sits at (0..1)."""

    key: str
    code: str
    depth: float

    @property
    def sentence(self) -> str:
        return f"The access code for the {self.key} is {self.code}."

    @property
    def question(self) -> str:
        return f"What is the access code for the {self.key}? Reply with the code only."


def make_needles(depths: list[float], per_depth: int, seed: int) -> list[Needle]:
    """``per_depth`` needles at each depth, with distinct keys and distinct codes (seeded)."""
    rng = random.Random(f"needles-{seed}")
    n = len(depths) * per_depth
    pairs = [(a, b) for a in _ADJECTIVES for b in _NOUNS]
    if n > len(pairs):
        raise ValueError(f"at most {len(pairs)} codes can be planted, asked for {n}")
    keys = [f"{a} {b}" for a, b in rng.sample(pairs, n)]
    codes: list[str] = []
    while len(codes) < n:
        code = (
            "".join(rng.choice(CODE_ALPHABET) for _ in range(4))
            + "-"
            + "".join(rng.choice(CODE_ALPHABET) for _ in range(4))
        )
        if code not in codes:
            codes.append(code)
    return [Needle(keys[i], codes[i], depths[i // per_depth]) for i in range(n)]


def filler_sentences(seed: int):
    """An endless, seeded stream of plain sentences (no digits, no upper-case runs)."""
    rng = random.Random(f"filler-{seed}")
    while True:
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_CODAS)}."
        yield s[0].upper() + s[1:]


def document(filler: list[str], filler_tokens: list[int], needles: list[Needle]) -> str:
    """The filler with each needle inserted after the sentence where its depth (in tokens) falls."""
    total = sum(filler_tokens)
    slots: dict[int, list[Needle]] = {}
    for needle in needles:
        # index of the first sentence that starts at or after depth * total filler tokens
        target, seen, at = needle.depth * total, 0, len(filler)
        for i, t in enumerate(filler_tokens):
            if seen >= target:
                at = i
                break
            seen += t
        slots.setdefault(at, []).append(needle)
    parts: list[str] = []
    for i in range(len(filler) + 1):
        parts.extend(n.sentence for n in slots.get(i, []))
        if i < len(filler):
            parts.append(filler[i])
    return " ".join(parts)


def user_message(doc: str, needle: Needle) -> str:
    return f"{INSTRUCTION}\n\n<document>\n{doc}\n</document>\n\n{needle.question}"


@dataclass(frozen=True)
class Haystack:
    """One context length's document and the prompts (token ids in the model's chat format) built on it."""

    context_length: int
    doc: str
    needles: list[Needle]
    prompts: list[list[int]]  # one per needle, same order

    def messages(self, i: int) -> list[dict]:
        return [{"role": "user", "content": user_message(self.doc, self.needles[i])}]


def build_haystack(context_length: int, needles: list[Needle], encode_messages, count_tokens, seed: int) -> Haystack:
    """The largest document whose every question prompt fits ``context_length`` tokens.

    ``encode_messages(messages) -> list[int]`` renders the model's chat format; ``count_tokens(text)``
    counts plain text. Filler is counted per sentence (a sentence tokenises almost the same alone as
    in place), then the real prompts are encoded and whole sentences dropped from the end until the
    longest prompt fits."""
    longest = max(needles, key=lambda n: len(n.question))

    def prompt_len(doc: str) -> int:
        return len(encode_messages([{"role": "user", "content": user_message(doc, longest)}]))

    floor = prompt_len(document([], [], needles))
    if floor > context_length:
        raise ValueError(
            f"context length {context_length} is too short for {len(needles)} codes: the instruction, "
            f"codes and question alone take {floor} tokens"
        )
    budget = context_length - floor
    filler, counts = [], []
    stream = filler_sentences(seed)
    while sum(counts) < budget:
        s = next(stream)
        filler.append(s)
        counts.append(max(1, count_tokens(" " + s)))
    for _ in range(64):  # converges in a step or two; bounded so a strange tokenizer cannot spin
        over = prompt_len(document(filler, counts, needles)) - context_length
        if over <= 0:
            break
        drop = max(1, -(-over // max(1, round(sum(counts) / max(1, len(counts))))))
        del filler[-drop:], counts[-drop:]
    doc = document(filler, counts, needles)
    prompts = [encode_messages([{"role": "user", "content": user_message(doc, n)}]) for n in needles]
    return Haystack(context_length, doc, needles, prompts)
