#!/usr/bin/env python3
"""Write a deterministic corpus of English sentences for the embedding benchmark.

The corpus is generated, not downloaded: a fixed seed drives a small grammar (subjects, verbs,
objects, prepositional phrases, subordinate clauses, numbers, names, quotes and questions) over
word lists in this file, so every run on every machine writes byte-identical text. Sentences are
5 to 120 words long, of varied length (mostly short and medium, some long), one per line, in the
order they were drawn (not sorted by length), with no empty lines.

Usage (from the repository root)::

    python3 tools/embed_corpus.py                      # target/embed_corpus.txt, 2000 sentences
    python3 tools/embed_corpus.py --count 500 --out /tmp/c.txt --seed 7

It prints the word-count statistics and the SHA-256 of the file. ``build_corpus()`` is what
``tools/bench_embed.py`` calls.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "target/embed_corpus.txt"
DEFAULT_SEED = 20261130
DEFAULT_COUNT = 2000
MIN_WORDS, MAX_WORDS = 5, 120

NAMES = ["Maria", "James", "Aiko", "Tomasz", "Fatima", "Oliver", "Priya", "Lucas", "Chen Wei",
         "Amara", "Henrik", "Sofia", "Diego", "Nadia", "Samuel", "Ingrid", "Rahul", "Elena",
         "Kwame", "Hannah", "Mateo", "Zainab", "Felix", "Grace", "Dr. Patel", "Mrs. Okafor",
         "Professor Lindqvist", "Captain Moreau", "our neighbour", "my grandmother"]
GROUPS = ["the city council", "the research team", "the committee", "the farmers", "the students",
          "the engineers", "the museum staff", "the local newspaper", "the hospital",
          "the volunteers", "the orchestra", "the school board", "the small bakery",
          "the football club", "the railway company", "the library", "the startup",
          "the fishing crew", "the village choir", "the night shift"]
ADJS = ["old", "new", "quiet", "busy", "small", "large", "bright", "dark", "narrow", "wide",
        "careful", "curious", "tired", "cheerful", "ancient", "modern", "wooden", "broken",
        "empty", "crowded", "remote", "familiar", "strange", "heavy", "gentle", "cold", "warm",
        "green", "red", "local", "famous", "simple", "detailed", "unexpected", "final", "early",
        "late", "rare", "ordinary", "fragile", "steady", "noisy", "patient", "generous"]
NOUNS = ["harbour", "bridge", "report", "garden", "letter", "museum", "station", "experiment",
         "market", "window", "river", "mountain", "recipe", "bicycle", "contract", "painting",
         "machine", "kitchen", "forest", "village", "budget", "storm", "journey", "festival",
         "library", "engine", "map", "photograph", "theory", "melody", "lighthouse", "orchard",
         "spreadsheet", "telescope", "notebook", "factory", "island", "meeting", "proposal",
         "sculpture", "road", "tunnel", "clock", "manuscript", "greenhouse", "ferry", "dataset",
         "server", "question", "decision", "café", "warehouse", "pipeline", "staircase"]
PLURALS = ["reports", "letters", "tools", "ideas", "children", "visitors", "samples", "photos",
           "questions", "results", "stories", "boxes", "trees", "files", "tickets", "instruments",
           "plans", "measurements", "records", "lanterns", "seeds", "paintings", "customers"]
TRANSITIVE = ["repaired", "described", "reviewed", "painted", "discovered", "rebuilt", "visited",
              "explained", "cleaned", "measured", "opened", "closed", "studied", "sold", "found",
              "carried", "approved", "rejected", "photographed", "organised", "tested", "moved",
              "translated", "designed", "inspected", "finished", "ignored", "recorded",
              "protected", "replaced", "borrowed", "delivered", "questioned", "admired"]
INTRANSITIVE = ["arrived late", "left early", "waited patiently", "laughed", "disagreed",
                "stayed at home", "kept working", "slept badly", "walked home", "changed its mind",
                "agreed at last", "fell silent", "moved abroad", "grew impatient",
                "started again", "gave up", "celebrated", "held its breath", "stopped talking"]
ADVERBS = ["quietly", "eventually", "carefully", "suddenly", "slowly", "finally", "reluctantly",
           "happily", "twice", "again", "already", "almost", "barely", "immediately", "gladly",
           "secretly", "proudly", "nervously"]
PREPS = ["near", "behind", "inside", "across", "under", "beside", "after", "before", "during",
         "around", "beyond", "along", "without", "through", "despite", "towards"]
TIMES = ["yesterday", "last week", "this morning", "in the spring", "on Tuesday",
         "at midnight", "in 1987", "in 2014", "after lunch", "before the holidays",
         "three years ago", "every Sunday", "late in the evening", "at dawn",
         "during the summer of 2009", "on the first of March"]
CONNECTORS = [", and", ", but", " because", " while", " although", ", so", " after", " before",
              " until", " even though", " since", "; meanwhile,", "; however,", ", whereas"]
REPORTING = ["said", "explained", "insisted", "admitted", "wrote", "whispered", "announced",
             "suggested", "claimed", "noted"]
QUESTION_STARTS = ["Why did", "When did", "How did", "Where did", "Did"]
BASE_VERBS = ["repair", "describe", "review", "paint", "discover", "rebuild", "visit",
              "explain", "clean", "measure", "open", "close", "study", "sell", "find", "carry",
              "approve", "test", "move", "translate", "design", "inspect", "finish"]
QUANT = ["about 40 percent of", "nearly half of", "two of", "most of", "a dozen of",
         "at least 300 of", "some of", "none of", "all of", "roughly 1.5 million of"]


class Gen:
    def __init__(self, rng: random.Random):
        self.r = rng

    def c(self, xs):
        return self.r.choice(xs)

    def p(self, prob):
        return self.r.random() < prob

    def np_(self):
        """A noun phrase: determiner, up to two adjectives, noun (sometimes plural or possessive)."""
        r = self.r.random()
        if r < 0.12:
            return self.c(QUANT) + " the " + self.c(PLURALS)
        if r < 0.22:
            return self.c(["several", "many", "a few", "three", "twelve", "some", "the"]) + " " + \
                (self.c(ADJS) + " " if self.p(0.5) else "") + self.c(PLURALS)
        det = self.c(["the", "the", "a", "this", "that", "our", "their", "an old friend's"])
        adjs = self.r.sample(ADJS, self.r.choice([0, 0, 1, 1, 2]))
        noun = self.c(NOUNS)
        words = " ".join([*adjs, noun])
        if det == "a" and words[0] in "aeiou":
            det = "an"
        return f"{det} {words}"

    def subject(self):
        r = self.r.random()
        if r < 0.35:
            return self.c(NAMES)
        if r < 0.6:
            return self.c(GROUPS)
        return self.np_()

    def pp(self):
        if self.p(0.3):
            return self.c(TIMES)
        return self.c(PREPS) + " " + self.np_()

    def clause(self):
        adv = (self.c(ADVERBS) + " ") if self.p(0.25) else ""
        if self.p(0.25):
            # people and groups arrive late or disagree; bridges do not
            subj = self.c(NAMES) if self.p(0.5) else self.c(GROUPS)
            return f"{subj} {adv}{self.c(INTRANSITIVE)}" + "".join(
                " " + self.pp() for _ in range(self.r.choice([0, 1, 1])))
        body = f"{self.subject()} {adv}{self.c(TRANSITIVE)} {self.np_()}"
        for _ in range(self.r.choice([0, 0, 1, 1, 2])):
            body += " " + self.pp()
        return body

    def extend(self, text, target):
        while len(text.split()) < target:
            r = self.r.random()
            if r < 0.55:
                text += self.c(CONNECTORS) + " " + self.clause()
            elif r < 0.8:
                text += " " + self.pp()
            elif r < 0.9:
                text += ", which " + self.c(["surprised", "worried", "pleased", "confused",
                                             "delighted", "annoyed"]) + " " + \
                    self.c(["everyone", "nobody", "the neighbours", "the critics", "us"])
            else:
                text += ", " + self.c(["as usual", "of course", "to be fair", "in the end",
                                       "for the second time", "as expected"])
        return text

    def sentence(self, target):
        kind = self.r.random()
        if kind < 0.1 and target <= 25:
            q = f"{self.c(QUESTION_STARTS)} {self.subject()} {self.c(BASE_VERBS)} {self.np_()}"
            q = self.extend(q, target)
            return q[0].upper() + q[1:] + "?"
        if kind < 0.2:
            inner = self.extend(self.clause(), max(3, target - 3))
            inner = inner[0].upper() + inner[1:]
            return f"\"{inner},\" {self.c(NAMES)} {self.c(REPORTING)}."
        s = self.extend(self.clause(), target)
        if self.p(0.15):
            s = self.c(["In the end, ", "Surprisingly, ", "According to the report, ",
                        "For many years, ", "Meanwhile, ", "As a result, "]) + s
        return s[0].upper() + s[1:] + "."


def draw_length(r: random.Random):
    """Varied lengths: mostly short and medium sentences, a tail of long ones."""
    u = r.random()
    if u < 0.45:
        return r.randint(5, 20)
    if u < 0.8:
        return r.randint(20, 50)
    if u < 0.95:
        return r.randint(50, 90)
    return r.randint(90, 120)


def build_corpus(count=DEFAULT_COUNT, seed=DEFAULT_SEED):
    """`count` sentences, deterministic for a given seed."""
    r = random.Random(seed)
    g = Gen(r)
    out = []
    while len(out) < count:
        target = draw_length(r)
        s = g.sentence(target)
        n = len(s.split())
        if MIN_WORDS <= n <= MAX_WORDS and "\n" not in s:
            out.append(s)
    return out


def write_corpus(path=DEFAULT_OUT, count=DEFAULT_COUNT, seed=DEFAULT_SEED):
    """Writes the corpus (one sentence per line) and returns (sentences, sha256)."""
    texts = build_corpus(count, seed)
    data = ("\n".join(texts) + "\n").encode()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_bytes() != data:
        path.write_bytes(data)
    return texts, hashlib.sha256(data).hexdigest()


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--count", type=int, default=DEFAULT_COUNT)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    a = p.parse_args(argv)
    texts, sha = write_corpus(a.out, a.count, a.seed)
    words = [len(t.split()) for t in texts]
    print(f"{len(texts)} sentences, {min(words)}-{max(words)} words (mean {sum(words) / len(words):.1f}), "
          f"sha256 {sha[:16]}: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
