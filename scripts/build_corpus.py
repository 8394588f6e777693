#!/usr/bin/env python3
"""Rebuilds benches/data/corpus.txt, the embedding-throughput corpus of issue 23.

    apt-get install bible-kjv           # the KJV text (bible-kjv-text) and its reader `bible`
    .venv/bin/python scripts/build_corpus.py [--out benches/data/corpus.txt] [--stats]

One sentence (or short passage) per line, no blank lines, deterministic: the same inputs give
the same file byte for byte. Sources, all offline on this machine:

* King James Version of the Bible (1611, public domain), Debian package bible-kjv-text 4.38,
  read through its `bible -f` reader: single verses from a fixed list of chapters, and a few
  runs of consecutive verses joined into passages of 120-200 WordPiece tokens (the long tail).
* Shakespeare's Sonnets 18, 116, 130 and 73 (1609, public domain): examples/data/sonnets.txt,
  lines joined and split into sentences.
* Docstrings of Python standard-library modules (PSF License), split into sentences: the
  docstrings of the interpreter that runs this script (record its version; 3.11.7 made the
  committed file).

Every line is kept between MIN_TOKENS and MAX_TOKENS tokens as counted by the shipped
tokenizer (weights/tokenizer.json, [CLS] and [SEP] included, no truncation), so no peer
truncates (sentence-transformers cuts at 256). Lines are de-duplicated and shuffled with a
fixed seed. --stats prints the counts that benches/data/README.md quotes.
"""
import argparse
import importlib
import inspect
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIN_TOKENS, MAX_TOKENS = 4, 200
SEED = 23

# Chapters whose verses are taken one per line (`bible` verse specs).
KJV_VERSES = [
    "Ge1:1-11:32",  # creation to Babel
    "Ex20:1-20:26",
    "Ru1:1-4:22",
    "Job38:1-38:41",
    "Ps1:1-1:6", "Ps8:1-8:9", "Ps19:1-19:14", "Ps23:1-23:6", "Ps46:1-46:11", "Ps90:1-90:17",
    "Ps103:1-103:22", "Ps104:1-104:35", "Ps121:1-121:8", "Ps139:1-139:24",
    "Pr1:1-6:35",
    "Ec1:1-12:14",
    "Isa40:1-40:31",
    "Mt5:1-7:29",  # the Sermon on the Mount
    "Lu15:1-15:32",
    "Joh1:1-1:51", "Joh11:1-11:57",
    "Ac27:1-27:44",
    "Ro8:1-8:39",
    "1Co13:1-13:13",
    "Es8:1-8:17",  # Esther 8:9, the longest verse
]
# Runs of consecutive verses, joined into passages of 120-200 tokens.
KJV_PASSAGES = ["Ge37:1-37:36", "Job1:1-2:13", "Lu10:25-10:37", "Re21:1-21:27", "Da3:1-3:30"]
PASSAGE_MIN = 120
# Standard-library modules whose docstrings (module, public classes, functions, methods) are
# split into sentences, in this order.
STDLIB_MODULES = [
    "argparse", "bisect", "calendar", "collections", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email.message", "fractions", "functools", "glob",
    "gzip", "heapq", "http.client", "ipaddress", "itertools", "json", "logging", "pathlib",
    "pickle", "queue", "random", "shutil", "statistics", "string", "subprocess", "tarfile",
    "tempfile", "textwrap", "threading", "typing", "unittest.case", "urllib.parse", "uuid",
    "zipfile",
]


def kjv(spec):
    """(reference, text) of each verse of a `bible` verse spec."""
    out = subprocess.run(["bible", "-f", spec], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "COLUMNS": "100000"}).stdout
    verses = []
    for line in out.splitlines():
        ref, _, text = line.partition(" ")
        if text.strip():
            verses.append((ref, " ".join(text.split())))
    if not verses:
        sys.exit(f"`bible -f {spec}` printed no verse: is the bible-kjv package installed?")
    return verses


SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+(?=[A-Z\"'(])")


def sonnet_sentences():
    text = (ROOT / "examples/data/sonnets.txt").read_text(encoding="utf-8")
    out = []
    for stanza in re.split(r"\n\s*\n", text):
        joined = " ".join(stanza.split())
        out += [s for s in re.split(r"(?<=[.!?])\s+", joined) if s]
    return out


def docstrings(module_name):
    module = importlib.import_module(module_name)
    docs = [inspect.getdoc(module)]
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            docs.append(inspect.getdoc(obj))
        if inspect.isclass(obj):
            for mname, member in sorted(vars(obj).items()):
                if not mname.startswith("_") and inspect.isfunction(member):
                    docs.append(inspect.getdoc(member))
    return [d for d in docs if d]


PROSE = re.compile(r"^[A-Z][^\n]*[.!?]$")


def prose_sentences(doc):
    """Sentences from the prose paragraphs of a docstring (code, tables, lists dropped)."""
    out = []
    for para in re.split(r"\n\s*\n", doc):
        lines = para.splitlines()
        if any(l.startswith((" ", "\t", ">>>", "-", "*", "+", "|", "=", ":", "..")) for l in lines):
            continue
        joined = " ".join(para.split())
        for s in SENTENCE_END.split(joined):
            s = s.strip()
            letters = sum(c.isalpha() or c == " " for c in s)
            if (PROSE.match(s) and len(s.split()) >= 3 and letters >= 0.85 * len(s)
                    and not re.search(r"[{}\[\]<>\\]|\w\(|\)\w|__|==|->|\w\.\w+\(", s)):
                out.append(s)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benches/data/corpus.txt"))
    ap.add_argument("--tokenizer", default=str(ROOT / "weights/tokenizer.json"))
    ap.add_argument("--stats", action="store_true", help="print token statistics")
    args = ap.parse_args()

    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(args.tokenizer)
    tok.no_truncation()
    tok.no_padding()

    def ntok(text):
        return len(tok.encode(text).ids)

    groups = {}
    groups["kjv verse"] = [text for spec in KJV_VERSES for _, text in kjv(spec)]
    passages = []
    for spec in KJV_PASSAGES:
        cur = []
        for _, text in kjv(spec):
            cur.append(text)
            n = ntok(" ".join(cur))
            if n > MAX_TOKENS:  # too long: start again from this verse
                cur = [text]
            elif n >= PASSAGE_MIN:
                passages.append(" ".join(cur))
                cur = []
    groups["kjv passage"] = passages
    groups["sonnets"] = sonnet_sentences()
    groups["stdlib docstrings"] = [s for m in STDLIB_MODULES for d in docstrings(m)
                                   for s in prose_sentences(d)]

    seen, lines, origin = set(), [], []
    for group, items in groups.items():
        for s in items:
            s = " ".join(s.split())
            if s and s not in seen and MIN_TOKENS <= ntok(s) <= MAX_TOKENS:
                seen.add(s)
                lines.append(s)
                origin.append(group)
    order = list(range(len(lines)))
    random.Random(SEED).shuffle(order)
    Path(args.out).write_text("".join(lines[i] + "\n" for i in order), encoding="utf-8")

    counts = [ntok(s) for s in lines]
    print(f"wrote {args.out}: {len(lines)} lines, {Path(args.out).stat().st_size} bytes "
          f"(python {sys.version.split()[0]})")
    if args.stats:
        print(f"{'source':<20} {'lines':>6} {'tokens':>8} {'median':>7} {'max':>5}")
        for group in list(groups) + ["all"]:
            c = [n for n, g in zip(counts, origin) if group in (g, "all")]
            print(f"{group:<20} {len(c):>6} {sum(c):>8} {statistics.median(c):>7g} {max(c):>5}")
        qs = statistics.quantiles(counts, n=20)
        print(f"tokens per line: min {min(counts)}, p5 {qs[0]:g}, p25 {qs[4]:g}, median "
              f"{statistics.median(counts):g}, p75 {qs[14]:g}, p95 {qs[18]:g}, max {max(counts)}, "
              f"mean {statistics.mean(counts):.1f}; lines over 128 tokens: "
              f"{sum(n > 128 for n in counts)}")


if __name__ == "__main__":
    main()
