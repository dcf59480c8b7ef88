"""Instruction families of mix v3: combinatorial templates that do not run out after a few
thousand prompts (the v2 families did: a third dataset drawn from them got 35 new Python requests
and no chat, advice or comparison prompts at all).

Every list and template here is written for this project; nothing comes from, or is derived from,
the benchmark prompts (``BenchmarkFilter`` still checks every generated text).  Two families read
material that is not a benchmark:

* ``pydoc``: Python standard-library functions (name, signature, first docstring sentence) found
  with :mod:`inspect` in the modules of :data:`PYDOC_MODULES` of the running interpreter;
* ``passage``: rewrite / summarize / extract requests over *passages*, paragraphs of the target's
  own earlier responses (an earlier dataset's records), when the caller passes them.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import random
import re
from functools import lru_cache
from typing import Callable, Dict, List, Optional, Tuple

__all__ = ["V3_SOURCES", "v3_makers", "pydoc_entries", "split_passages"]

V3_SOURCES: Dict[str, str] = {
    "pydoc": "(mix v3) Python requests over standard-library functions (name, signature, first docstring "
             "sentence read with inspect from PYDOC_MODULES), in phrasings written here",
    "roleplay": "(mix v3) persona x task x phrasing, lists in families_v3.py",
    "reasoning": "(mix v3) generated logic puzzles: orderings, syllogisms, sequences, calendars, relations",
    "stem": "(mix v3) subject x aspect x audience explanation requests, lists in families_v3.py",
    "writing3": "(mix v3) form x topic x constraint writing requests, lists in families_v3.py",
    "passage": "(mix v3) summarize / rewrite / extract / question requests over paragraphs of the target's own "
               "earlier responses",
}

PYDOC_MODULES = ["math", "statistics", "string", "textwrap", "itertools", "functools", "operator", "collections",
                 "heapq", "bisect", "random", "re", "json", "os.path", "shutil", "fnmatch", "glob", "difflib",
                 "urllib.parse", "html", "base64", "hashlib", "calendar", "datetime", "decimal", "fractions",
                 "copy", "pprint", "csv", "zlib", "binascii", "colorsys", "keyword", "unicodedata", "secrets",
                 "uuid", "ipaddress", "email.utils", "shlex", "locale", "time", "cmath", "array", "struct",
                 "pathlib", "tempfile", "zipfile", "gzip", "inspect", "typing", "enum", "dataclasses",
                 "contextlib", "weakref", "codecs", "io", "sys", "platform", "filecmp", "posixpath"]


@lru_cache(maxsize=1)
def pydoc_entries() -> Tuple[Tuple[str, str, str, str], ...]:
    """(module, name, signature, summary) of the documented public functions of PYDOC_MODULES."""
    out = []
    for mod_name in PYDOC_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:  # pragma: no cover - every module is in the standard library
            continue
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not callable(obj) or inspect.isclass(obj):
                continue
            doc = inspect.getdoc(obj) or ""
            first = doc.strip().split("\n\n")[0].replace("\n", " ")
            m = re.match(r"(.+?[.!?])(\s|$)", first)
            summary = (m.group(1) if m else first).strip()
            if not (4 <= len(summary.split()) <= 30) or summary.startswith(name + "("):
                continue
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                sig = ""
            if len(sig) > 80:
                continue
            out.append((mod_name, name, sig, summary))
    return tuple(out)


def _infinitive(summary: str) -> str:
    """"Returns the sum." -> "return the sum" (the docstring's third-person verb made bare)."""
    s = summary.rstrip(".")
    verb, _, rest = s.partition(" ")
    v = verb.lower()
    if re.search(r"(ch|sh|ss|x|o)es$", v):
        v = v[:-2]
    elif v.endswith("s") and not v.endswith("ss"):
        v = v[:-1]
    return f"{v} {rest}".strip()


def _pydoc(r: random.Random) -> str:
    mod, name, sig, summary = r.choice(pydoc_entries())
    q = f"{mod}.{name}"
    forms = [f"Explain what `{q}` does in Python and give a short example.",
             f"How do I use `{q}` in Python? Show an example.",
             f"Write a Python function `my_{name}{sig}` that does the same as `{q}` without using it. "
             f"The documentation says: \"{summary}\"",
             f"Write a python function to {_infinitive(summary)}",
             f"What does this Python documentation line mean? \"{summary}\" (from `{q}`)",
             f"Give two practical use cases for `{q}` with code.",
             f"Write a short Python script that demonstrates `{q}`.",
             f"What arguments does `{q}` take, and what does it return?"]
    return r.choice(forms)


PERSONAS = ["a pirate captain", "a medieval knight", "a friendly robot", "a detective in 1920s London",
            "a chef at a busy restaurant", "a tour guide in Rome", "a high school chemistry teacher",
            "an astronaut on a space station", "a museum curator", "a personal fitness coach", "a travel agent",
            "a small-town librarian", "a wizard's apprentice", "a sports commentator", "a customer support agent",
            "a startup founder", "a park ranger", "a news reporter", "a kindergarten teacher", "a famous painter",
            "a marine biologist", "a barista", "a mountain guide", "a video game character", "a job interviewer",
            "a family doctor", "a poet", "a historian", "a taxi driver", "an ancient Greek philosopher",
            "a car mechanic", "a lawyer", "a real estate agent", "a farmer", "a lighthouse keeper", "a gardener",
            "a stand-up comedian", "a software engineer", "a math tutor", "a yoga instructor"]
ROLE_TASKS = ["introduce yourself to a new visitor", "describe a typical day at work", "give advice to a beginner",
              "explain the most important rule of your job", "tell me about your biggest challenge",
              "say what you enjoy most about your work", "convince me to try something new",
              "describe the place where you work", "tell a short story from your past", "give me three tips",
              "respond to a customer who is unhappy", "explain your favorite tool", "answer a child's question "
              "about what you do", "write a short speech for your team", "describe your proudest moment",
              "explain a common mistake people make", "plan my weekend", "recommend a book and say why"]


def _roleplay(r: random.Random) -> str:
    p, t = r.choice(PERSONAS), r.choice(ROLE_TASKS)
    T = t[0].upper() + t[1:]
    return r.choice([f"Pretend you are {p}. {T}.", f"Act as {p} and {t}.", f"Imagine you are {p}. {T}.",
                     f"You are {p}. {T}.", f"Role-play as {p}: {t}.",
                     f"Stay in character as {p} and {t}. Keep it under 120 words."])


DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
KINDS = [("cats", "animals", "pets"), ("roses", "flowers", "red things"), ("pilots", "people", "travelers"),
         ("squares", "rectangles", "shapes"), ("oaks", "trees", "plants"), ("violins", "instruments", "wooden things"),
         ("sparrows", "birds", "animals that fly"), ("novels", "books", "long texts")]
ADJ = [("older", "youngest", "oldest"), ("taller", "shortest", "tallest"), ("faster", "slowest", "fastest"),
       ("heavier", "lightest", "heaviest")]


def _reasoning(r: random.Random, NAMES: List[str]) -> str:
    kind = r.randrange(6)
    if kind == 0:
        a, b, c, d = r.sample(NAMES, 4)
        comp, low, high = r.choice(ADJ)
        facts = [f"{a} is {comp} than {b}.", f"{b} is {comp} than {c}.", f"{c} is {comp} than {d}."]
        r.shuffle(facts)
        return " ".join(facts) + f" Who is the {r.choice([low, high])}? Explain your reasoning."
    if kind == 1:
        x, y, z = r.choice(KINDS)
        q = r.choice([f"All {x} are {y}. Some {y} are {z}. Does it follow that some {x} are {z}?",
                      f"All {x} are {y}. All {y} are {z}. Are all {x} {z}?",
                      f"No {y} are {z}. All {x} are {y}. Can any {x} be {z}?"])
        return q + " Explain."
    if kind == 2:
        a, d, g = r.randint(1, 20), r.randint(2, 9), r.randint(2, 4)
        seq = r.choice([[a + i * d for i in range(5)], [a * g ** i for i in range(5)],
                        [a + i * i for i in range(5)], [a + d * i * (i + 1) // 2 for i in range(5)]])
        return f"What is the next number in the sequence {', '.join(map(str, seq))}? Explain the pattern."
    if kind == 3:
        day, n = r.choice(DAYS), r.randint(3, 100)
        return r.choice([f"If today is {day}, what day of the week will it be in {n} days?",
                         f"If it was {day} {n} days ago, what day is it today?"])
    if kind == 4:
        a, b = r.sample(NAMES, 2)
        rel = r.choice(["father", "mother", "sister", "brother", "aunt", "uncle", "grandmother"])
        rel2 = r.choice(["brother", "sister", "father", "mother", "son", "daughter"])
        return f"{a}'s {rel} is {b}'s {rel2}. How could {a} and {b} be related? Explain."
    n = r.randint(3, 9)
    item, where = r.choice([("socks", "drawer"), ("coins", "box"), ("balls", "bag"), ("cards", "deck")])
    return (f"A {where} has {n} red {item} and {n + r.randint(1, 5)} blue {item}. What is the smallest number "
            f"of {item} you must take without looking to be sure of having two of the same color?")


SUBJECTS = ["quantum computing", "climate change", "the French Revolution", "supply and demand", "inflation",
            "the theory of relativity", "the human brain", "bacteria", "rainforests", "democracy",
            "the Cold War", "impressionist painting", "jazz music", "the stock market", "renewable energy",
            "coral reefs", "the Great Wall of China", "artificial intelligence", "cryptography", "the Moon landing",
            "genetics", "urbanization", "the Byzantine Empire", "game theory", "probability", "linear algebra",
            "calculus", "stoicism", "Shakespeare's plays", "the Amazon river", "photosynthesis in algae",
            "the Big Bang", "antibiotic resistance", "social media", "electric cars", "the Mediterranean diet",
            "volcanic islands", "the printing of money", "the scientific method", "mythology", "minimalism",
            "the history of chess", "bees", "deserts", "glaciers", "satellites", "3D printing", "microplastics"]
ASPECTS = ["{s}", "the history of {s}", "the main causes and effects of {s}", "common misconceptions about {s}",
           "the future of {s}", "why {s} matters today", "the key terms one needs to understand {s}",
           "how scientists or historians study {s}", "the pros and cons of {s}", "{s} in everyday life"]
AUDIENCES = ["", "", " to a ten-year-old", " to a high school student", " to a busy executive",
             " in simple words", " for a university exam", " in exactly three paragraphs", " as a numbered list"]


def _stem(r: random.Random) -> str:
    a = r.choice(ASPECTS).format(s=r.choice(SUBJECTS))
    aud = r.choice(AUDIENCES)
    return r.choice([f"Explain {a}{aud}.", f"Tell me about {a}{aud}.", f"Write a short overview of {a}{aud}.",
                     f"What should I know about {a}?", f"Describe {a}{aud}."])


FORMS = ["a blog post", "a short speech", "a tweet", "a letter", "a dialogue between two friends",
         "a product review", "an advertisement", "a motivational message", "a diary entry", "a news headline "
         "and a short article", "a fairy tale", "a song chorus", "a travel guide entry", "a restaurant review",
         "a persuasive essay", "a cover letter", "a thank-you note", "a short mystery story", "a sonnet",
         "a social media post", "a podcast introduction", "a toast for a wedding", "a job advertisement"]
TOPICS3 = ["a rainy Sunday", "learning to swim", "a new coffee shop", "moving to another country", "an old bicycle",
           "the last day of summer", "a robot chef", "a community garden", "a missed train", "a school science fair",
           "an abandoned castle", "climate action", "a smartphone that can read minds", "a grandmother's recipe",
           "a marathon", "a snowy village", "the first snowfall", "a startup's launch day", "a lost dog that "
           "finds its way home", "a volunteer project", "a concert in the park", "a power outage", "a new library",
           "the night sky", "a family road trip", "a talking tree", "recycling", "a chess tournament"]
CONSTRAINTS = ["", "", " Keep it under 100 words.", " Use a humorous tone.", " Use exactly five sentences.",
               " Make it suitable for children.", " Write it in the first person.", " End with a surprising twist.",
               " Include a title.", " Use simple vocabulary.", " Make it formal."]


def _writing3(r: random.Random) -> str:
    return f"Write {r.choice(FORMS)} about {r.choice(TOPICS3)}.{r.choice(CONSTRAINTS)}"


PASSAGE_TASKS = ["Summarize the following text in two sentences.", "Rewrite the following text in a formal tone.",
                 "Extract the key facts from the following text as a bulleted list.",
                 "Give the following text a short title.", "Write three questions a reader might ask after reading "
                 "this text.", "Rewrite the following text so a child can understand it.",
                 "List any numbers or names mentioned in the following text.",
                 "What is the main idea of the following text?", "Shorten the following text to one paragraph.",
                 "Identify the tone of the following text and explain your answer.",
                 "Continue the following text with one more paragraph.",
                 "Turn the following text into a short email to a friend."]


def split_passages(texts: List[str], min_words: int = 30, max_words: int = 150) -> List[str]:
    """Paragraphs of ``texts`` with ``min_words``..``max_words`` words (code blocks dropped)."""
    out = []
    for t in texts:
        t = re.sub(r"```.*?```", "", t, flags=re.S)
        for p in re.split(r"\n\s*\n", t):
            p = p.strip()
            if min_words <= len(p.split()) <= max_words and "\\boxed" not in p:
                out.append(p)
    return out


def v3_makers(v2_makers: Dict[str, Callable], names: List[str], passages: Optional[List[str]] = None
              ) -> Tuple[Dict[str, Callable], Dict[str, int]]:
    """Makers and weights of mix v3: ``v2_makers`` (the v2 families, passed in by the
    instructions module, which imports this one) plus the ones above; ``names`` the people the
    logic puzzles use; ``passage`` only with passages."""
    makers = dict(v2_makers, pydoc=_pydoc, roleplay=_roleplay, reasoning=functools.partial(_reasoning, NAMES=names),
                  stem=_stem, writing3=_writing3)
    weights = {"math": 1, "arith": 1, "mathcot": 3, "code": 1, "pycode": 2, "explain": 1, "writing": 1,
               "advice": 1, "compare": 1, "list": 1, "pydoc": 4, "roleplay": 3, "reasoning": 2, "stem": 3,
               "writing3": 3}
    if passages:
        pool = list(passages)

        def _passage(r: random.Random) -> str:
            return f"{r.choice(PASSAGE_TASKS)}\n\n{r.choice(pool)}"

        makers["passage"] = _passage
        weights["passage"] = 4
    return makers, weights
