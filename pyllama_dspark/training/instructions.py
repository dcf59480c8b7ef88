"""The training instruction set: programmatic templates over topic lists.

Nothing here comes from, or is derived from, the benchmark sets in ``shared/bench/prompts``
(GSM8K, MATH, HumanEval, MBPP, MT-Bench): every prompt is a template from :data:`TEMPLATES`
filled with items from the topic lists below, written for this project.  Math word problems are
generated from random names, objects and numbers; code requests from a list of small programming
tasks; the rest from topic lists.  ``SOURCES`` names each family for the data card.  Prompts are
deduplicated by their normalized text and shuffled with a fixed seed.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

__all__ = ["Instruction", "build_instructions", "SOURCES", "is_benchmark_text"]

SOURCES: Dict[str, str] = {
    "math": "word problems generated from random names/objects/numbers (templates in this file)",
    "arith": "arithmetic and algebra exercises with random operands (templates in this file)",
    "code": "small programming tasks x languages (task list in this file)",
    "explain": "explanation requests over a science/technology/history topic list",
    "writing": "emails, stories, poems, summaries over topic lists",
    "advice": "practical advice / how-to questions over an everyday-topics list",
    "compare": "compare-two-things questions over paired topic lists",
    "list": "list/brainstorm requests over topic lists",
    "chat": "short conversational messages",
    "multiturn": "a second user turn (follow-up templates) after the target's own first answer",
}

NAMES = ["Ava", "Liam", "Maya", "Noah", "Zara", "Omar", "Lena", "Ravi", "Iris", "Tomas", "Keiko",
         "Diego", "Freya", "Hugo", "Priya", "Sam", "Nadia", "Felix", "Aisha", "Jonah", "Mila", "Yusuf"]
OBJECTS = [("apples", "bag"), ("pencils", "box"), ("stickers", "sheet"), ("cookies", "tray"),
           ("marbles", "jar"), ("books", "shelf"), ("eggs", "carton"), ("cards", "pack"),
           ("flowers", "vase"), ("coins", "purse"), ("bottles", "crate"), ("tiles", "row")]
JOBS = ["baker", "gardener", "painter", "tailor", "carpenter", "librarian", "farmer", "courier"]
UNITS = [("km", "hour"), ("pages", "day"), ("liters", "minute"), ("meters", "second"), ("boxes", "hour")]

CODE_TASKS = [
    "reverses the words in a sentence", "checks whether a string is a palindrome",
    "counts the vowels in a string", "returns the n-th Fibonacci number",
    "merges two sorted lists into one sorted list", "removes duplicates from a list while keeping order",
    "finds the second largest number in a list", "converts Celsius to Fahrenheit",
    "computes the greatest common divisor of two integers", "flattens a nested list",
    "counts word frequencies in a text", "checks whether a number is prime",
    "transposes a matrix given as a list of lists", "validates an email address with a simple rule",
    "returns the running sum of a list", "rotates a list by k positions",
    "groups a list of words by their first letter", "converts a Roman numeral to an integer",
    "finds the longest word in a sentence", "implements binary search on a sorted list",
    "computes the factorial of n iteratively", "parses a CSV line into fields",
    "returns the intersection of two lists", "capitalizes the first letter of every word",
    "implements a simple stack class with push and pop", "reads a file and counts its lines",
    "checks whether two strings are anagrams", "computes the average of the numbers in a list",
    "finds all even numbers in a range", "sorts a list of dictionaries by a key",
    "implements bubble sort", "converts a number to binary", "computes the sum of digits of an integer",
    "returns the most common element of a list", "chunks a list into pieces of size n",
    "builds a dictionary from two lists of keys and values", "checks balanced parentheses in a string",
    "computes compound interest", "finds the minimum and maximum of a list in one pass",
    "implements a queue using two stacks",
]
LANGS = ["Python", "Python", "Python", "JavaScript", "C", "Java", "Rust", "Go"]

SCIENCE = ["photosynthesis", "black holes", "the water cycle", "plate tectonics", "vaccines",
           "the greenhouse effect", "DNA replication", "electric circuits", "the speed of light",
           "how rainbows form", "volcanoes", "the immune system", "magnetism", "sound waves",
           "the periodic table", "evolution by natural selection", "tides", "nuclear fusion",
           "the human heart", "clouds", "gravity", "friction", "the moon's phases", "earthquakes",
           "batteries", "solar panels", "antibiotics", "the nervous system", "ocean currents", "seasons"]
TECH = ["the internet", "a CPU", "machine learning", "databases", "encryption", "compilers",
        "operating systems", "cloud computing", "version control with git", "HTTP", "recursion",
        "hash tables", "neural networks", "GPS", "Wi-Fi", "blockchains", "open source software",
        "unit testing", "APIs", "caching", "virtual memory", "sorting algorithms", "DNS", "Linux"]
HISTORY = ["the printing press", "the Roman Empire", "the Industrial Revolution", "ancient Egypt",
           "the Silk Road", "the invention of the telephone", "the Renaissance", "the first moon landing",
           "the history of writing", "the steam engine", "the Olympic Games", "the invention of paper"]
EVERYDAY = ["saving money", "learning a new language", "sleeping better", "cooking rice",
            "starting to run", "keeping houseplants alive", "studying for an exam", "organizing a closet",
            "making friends in a new city", "reducing screen time", "preparing for a job interview",
            "planning a road trip", "writing a resume", "staying focused while working from home",
            "packing for a trip", "caring for a puppy", "learning to play guitar", "baking bread",
            "managing stress", "starting a vegetable garden", "public speaking", "drinking more water"]
WRITING_TOPICS = ["the ocean", "autumn", "a lost key", "friendship", "a city at night", "a robot that learns to paint",
                  "the first day of school", "a lighthouse keeper", "rain", "a mountain village",
                  "an old library", "a journey by train", "a forgotten toy", "the stars", "a small cafe",
                  "a dragon who is afraid of fire", "a time traveler", "a garden in spring", "winter morning"]
EMAILS = ["ask my manager for a day off", "thank a colleague for their help", "invite friends to a dinner",
          "complain politely about a late delivery", "ask a professor for a recommendation letter",
          "reschedule a meeting", "welcome a new team member", "request a refund",
          "apologize for missing a deadline", "introduce myself to a new client"]
PAIRS = [("cats", "dogs"), ("tea", "coffee"), ("Python", "JavaScript"), ("trains", "planes"),
         ("renting", "buying a home"), ("e-books", "paper books"), ("summer", "winter"),
         ("SQL", "NoSQL databases"), ("solar power", "wind power"), ("running", "swimming"),
         ("cities", "the countryside"), ("laptops", "desktops"), ("TCP", "UDP"), ("lists", "tuples in Python")]
LIST_TOPICS = ["healthy breakfast ideas", "indoor hobbies", "tips for writing clean code", "ways to save energy at home",
               "names for a bakery", "fun facts about space", "board games for families", "ways to reduce waste",
               "questions to ask in an interview", "things to do on a rainy day", "study techniques",
               "features of a good website", "benefits of reading", "safety tips for hiking", "weekend project ideas"]
CHAT = ["Hi! How are you today?", "Can you tell me a joke?", "What can you help me with?",
        "I'm bored. Any ideas?", "Good morning! Any tips to start the day well?",
        "What's your favorite book and why?", "Tell me something interesting.",
        "I just finished a big project at work!", "Can you recommend a movie for tonight?",
        "What should I cook for dinner?", "I feel a bit tired today.", "Say something encouraging.",
        "Do you like music?", "What's a good way to relax after work?", "Tell me a fun fact about animals."]
FOLLOWUPS = ["Can you make that shorter?", "Can you explain that in simpler words?",
             "Thanks! Can you give one more example?", "Can you summarize that in three bullet points?",
             "Why is that?", "What would you change to make it better?", "Can you rewrite it in a more formal tone?",
             "What is the most important point?"]


@dataclass
class Instruction:
    source: str
    messages: List[Dict[str, str]]
    followup: Optional[str] = None
    meta: Dict[str, str] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "\n".join(m["content"] for m in self.messages)


def _math(r: random.Random) -> str:
    a, b = r.sample(NAMES, 2)
    obj, cont = r.choice(OBJECTS)
    job = r.choice(JOBS)
    n1, n2, n3 = r.randint(2, 12), r.randint(3, 40), r.randint(2, 9)
    price = r.choice([0.5, 1.25, 2, 3, 4.5, 6, 7.5, 12])
    u, per = r.choice(UNITS)
    forms = [
        f"{a} has {n1} {cont}s of {obj} with {n2} {obj} in each {cont}. {a} gives {n3} {obj} to {b}. How many {obj} does {a} have left?",
        f"A {job} earns ${n2} per {per} and works {n1} {per}s a week. How much does the {job} earn in {n3} weeks?",
        f"{a} buys {n1} {obj} at ${price} each and pays with a ${n2 * 5} bill. How much change does {a} get?",
        f"{a} travels {n2} {u} every {per}. How many {u} does {a} cover in {n1} {per}s and a half?",
        f"{a} and {b} share {n2 * n3} {obj} in the ratio {n1}:{n3}. How many {obj} does each get?",
        f"A {cont} holds {n2} {obj}. If {a} needs {n2 * n1 + n3} {obj}, how many {cont}s must {a} buy?",
        f"{a} is {n2} years old. {b} is {n3} years younger than twice {a}'s age. How old will {b} be in {n1} years?",
        f"A shop sells {obj} for ${price} each, with a {r.choice([10, 15, 20, 25])}% discount on orders over {n2}. What does {n2 + n1} {obj} cost?",
        f"{a} read {n2} pages on Monday and {n3} more pages each day after that. How many pages did {a} read in {n1} days?",
        f"The {job} has {n2} {obj}. Each day {n3} are used and {n1} new ones arrive. After how many days will there be none left, if ever?",
    ]
    tail = r.choice(["", " Explain your reasoning step by step.", " Show your work.", ""])
    return r.choice(forms) + tail


def _arith(r: random.Random) -> str:
    a, b, c = r.randint(2, 99), r.randint(2, 99), r.randint(2, 20)
    forms = [
        f"Solve for x: {a}x + {b} = {a * c + b}.", f"What is {a} times {b}?", f"Simplify the fraction {a * c}/{b * c}.",
        f"Compute {a}% of {b * 10}.", f"Find the area of a rectangle that is {a} cm by {b} cm.",
        f"What is the sum of the integers from 1 to {a}?", f"Expand (x + {c})(x - {b % 10 + 1}).",
        f"Find the perimeter of a triangle with sides {a}, {b} and {a + b - 1}.",
        f"Convert {a * 37} minutes into hours and minutes.", f"What is the square root of {c * c}?",
        f"Is {a * 2 + 1} a prime number? Explain.", f"Factor x^2 + {b + c}x + {b * c}.",
        f"What is the average of {a}, {b} and {c}?", f"Write {a}/{c} as a decimal.",
        f"A circle has radius {c}. What are its circumference and area?",
    ]
    return r.choice(forms)


def _code(r: random.Random) -> str:
    task, lang = r.choice(CODE_TASKS), r.choice(LANGS)
    forms = [f"Write a {lang} function that {task}.",
             f"Write a {lang} function that {task}. Include a short explanation.",
             f"How would I write a program in {lang} that {task}?",
             f"Write a {lang} function that {task}, with a few example calls.",
             f"Explain how to write code that {task}, then give a {lang} implementation."]
    return r.choice(forms)


def _explain(r: random.Random) -> str:
    topic = r.choice(SCIENCE + TECH + HISTORY)
    forms = [f"Explain {topic} in simple terms.", f"What is {topic}?", f"How does {topic} work?",
             f"Give me a short overview of {topic}.", f"Explain {topic} to a ten-year-old.",
             f"Why is {topic} important?", f"Describe {topic} in a few paragraphs.",
             f"What are the key ideas behind {topic}?"]
    return r.choice(forms)


def _writing(r: random.Random) -> str:
    t = r.choice(WRITING_TOPICS)
    forms = [f"Write a short poem about {t}.", f"Write a short story about {t}.",
             f"Write a haiku about {t}.", f"Write a paragraph describing {t}.",
             f"Write an email to {r.choice(EMAILS)}.", f"Write a short email to {r.choice(EMAILS)}.",
             f"Write a limerick about {t}.", f"Write the opening of a novel about {t}.",
             f"Write a product description for a notebook inspired by {t}."]
    return r.choice(forms)


def _advice(r: random.Random) -> str:
    t = r.choice(EVERYDAY)
    return r.choice([f"What are some tips for {t}?", f"How do I get better at {t}?",
                     f"Give me a step-by-step plan for {t}.", f"What mistakes should I avoid when {t}?",
                     f"I need advice on {t}."])


def _compare(r: random.Random) -> str:
    a, b = r.choice(PAIRS)
    return r.choice([f"Compare {a} and {b}.", f"What are the pros and cons of {a} versus {b}?",
                     f"Which is better, {a} or {b}? Explain.", f"What is the difference between {a} and {b}?"])


def _list(r: random.Random) -> str:
    t = r.choice(LIST_TOPICS)
    n = r.choice([3, 5, 5, 7, 10])
    return r.choice([f"List {n} {t}.", f"Give me {n} {t}.", f"Can you suggest {n} {t}?",
                     f"Brainstorm {n} {t} and explain each briefly."])


_MAKERS = {"math": _math, "arith": _arith, "code": _code, "explain": _explain, "writing": _writing,
           "advice": _advice, "compare": _compare, "list": _list}
_WEIGHTS = {"math": 4, "arith": 2, "code": 4, "explain": 3, "writing": 3, "advice": 2, "compare": 1, "list": 1}

_BENCH_MARKERS = re.compile(r"def \w+\(.*\):\s*\n\s*\"\"\"|>>> ", re.S)


def is_benchmark_text(text: str) -> bool:
    """Cheap guard: HumanEval-style docstring stubs or doctests never belong to the training set."""
    return bool(_BENCH_MARKERS.search(text))


def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", s.strip().lower())


def build_instructions(n: int, seed: int = 0, multiturn_frac: float = 0.12, chat_frac: float = 0.04,
                       exclude: Optional[List[str]] = None) -> List[Instruction]:
    """``n`` distinct instructions (fewer if the templates run out), deterministic for ``seed``.

    ``exclude``: texts that must not appear (e.g. every benchmark prompt); a generated prompt whose
    normalized text equals one of them is dropped."""
    r = random.Random(seed)
    banned = {_norm(t) for t in (exclude or [])}
    seen = set()
    out: List[Instruction] = []
    kinds = [k for k, w in _WEIGHTS.items() for _ in range(w)]
    for c in CHAT:
        if len(out) >= int(n * chat_frac) + 1:
            break
        out.append(Instruction("chat", [{"role": "user", "content": c}]))
        seen.add(_norm(c))
    tries = 0
    while len(out) < n and tries < n * 50:
        tries += 1
        kind = r.choice(kinds)
        text = _MAKERS[kind](r)
        key = _norm(text)
        if key in seen or key in banned or is_benchmark_text(text):
            continue
        seen.add(key)
        follow = r.choice(FOLLOWUPS) if r.random() < multiturn_frac else None
        out.append(Instruction(kind, [{"role": "user", "content": text}], followup=follow))
    r.shuffle(out)
    return out
