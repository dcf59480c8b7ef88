"""The training instruction set: programmatic templates over topic lists.

Nothing here comes from, or is derived from, the benchmark sets shipped in ``pyllama_dspark/data/prompts``
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

from pyllama_dspark.training.families_v3 import V3_SOURCES, v3_makers

__all__ = ["Instruction", "build_instructions", "SOURCES", "is_benchmark_text", "BenchmarkFilter", "MIXES"]

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
    "mathcot": "(mix v2) word problems, exercises and LaTeX-notation problems written here, with a "
               "step-by-step / boxed-answer request in several phrasings written here",
    "pycode": "(mix v2) 'write a python function to ...' requests over the task lists, and Python "
              "function stubs (signature, docstring, doctest examples) from FUNCTION_SPECS in this file",
    "multiturn": "a second user turn (follow-up templates) after the target's own first answer",
    **V3_SOURCES,
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


MORE_CODE_TASKS = [
    "counts how many times each character appears in a string", "checks whether a year is a leap year",
    "returns the list of prime numbers below n", "computes the median of a list of numbers",
    "splits a string into words and sorts them alphabetically", "finds the index of the first repeated element",
    "checks whether a list is sorted", "returns the product of all numbers in a list",
    "converts a list of tuples into a dictionary", "removes all whitespace from a string",
    "finds the common prefix of a list of strings", "computes the dot product of two vectors",
    "returns every k-th element of a list", "checks whether a number is a perfect square",
    "finds the largest difference between two elements of a list", "counts the uppercase letters in a string",
    "replaces every vowel in a string with an asterisk", "returns the n smallest numbers of a list",
    "converts a string of digits into an integer without int()", "checks whether a string contains only digits",
    "interleaves two lists", "finds the missing number in a list containing 1..n",
    "computes the nth triangular number", "returns the cumulative product of a list",
    "finds pairs of numbers in a list that add up to a target", "converts hours, minutes and seconds to seconds",
    "returns the unique characters of a string in order", "computes the area of a circle from its radius",
    "finds the position of the largest element in a list", "checks whether all elements of a list are equal",
]

FUNCTION_SPECS = [
    ("count_evens", "nums: list", "int", "Return how many numbers in nums are even.", [("[1, 2, 4, 7]", "2"), ("[]", "0")]),
    ("last_digit_sum", "a: int, b: int", "int", "Return the sum of the last digits of a and b.", [("27, 45", "12")]),
    ("shout", "text: str", "str", "Return text in upper case followed by an exclamation mark.", [("'hi'", "'HI!'")]),
    ("middle", "items: list", "list", "Return items without its first and last element.", [("[1, 2, 3, 4]", "[2, 3]")]),
    ("digits_of", "n: int", "list", "Return the decimal digits of a non-negative integer, most significant first.", [("409", "[4, 0, 9]")]),
    ("is_vowel_heavy", "word: str", "bool", "Return True if more than half of the letters of word are vowels.", [("'aeiox'", "True"), ("'strength'", "False")]),
    ("swap_pairs", "items: list", "list", "Swap every two neighbouring elements; a last odd element stays.", [("[1, 2, 3, 4, 5]", "[2, 1, 4, 3, 5]")]),
    ("longest_run", "items: list", "int", "Return the length of the longest run of equal neighbouring elements.", [("[1, 1, 2, 2, 2, 3]", "3")]),
    ("initials", "name: str", "str", "Return the initials of a full name, upper case, without spaces.", [("'ada lovelace'", "'AL'")]),
    ("clamp", "x: float, lo: float, hi: float", "float", "Limit x to the interval [lo, hi].", [("5.0, 0.0, 2.5", "2.5"), ("-1.0, 0.0, 2.5", "0.0")]),
    ("word_lengths", "sentence: str", "dict", "Map every word of the sentence to its length.", [("'to be or'", "{'to': 2, 'be': 2, 'or': 2}")]),
    ("every_other", "text: str", "str", "Return the characters of text at even positions.", [("'abcdef'", "'ace'")]),
    ("running_max", "nums: list", "list", "Return the maximum seen so far at every position.", [("[3, 1, 4, 1, 5]", "[3, 3, 4, 4, 5]")]),
    ("count_words_starting_with", "text: str, letter: str", "int", "Count the words of text that begin with letter (case-insensitive).", [("'Big blue boat sails', 'b'", "3")]),
    ("to_celsius", "f: float", "float", "Convert a temperature from Fahrenheit to Celsius, rounded to one decimal.", [("212.0", "100.0"), ("50.0", "10.0")]),
    ("pairwise_sums", "nums: list", "list", "Return the sums of neighbouring pairs.", [("[1, 2, 3, 4]", "[3, 5, 7]")]),
    ("is_increasing", "nums: list", "bool", "Return True if every number is larger than the one before it.", [("[1, 3, 8]", "True"), ("[2, 2]", "False")]),
    ("compress", "text: str", "str", "Run-length encode text: each run becomes the character followed by its count.", [("'aaabcc'", "'a3b1c2'")]),
    ("second_smallest", "nums: list", "int", "Return the second smallest distinct value of nums.", [("[4, 1, 3, 1]", "3")]),
    ("bin_ones", "n: int", "int", "Return how many 1 bits the binary form of n has.", [("13", "3")]),
    ("title_case", "text: str", "str", "Capitalize every word of text and lower-case the rest of each word.", [("'hELLO wORLD'", "'Hello World'")]),
    ("rotate_left", "items: list, k: int", "list", "Rotate items left by k positions.", [("[1, 2, 3, 4], 1", "[2, 3, 4, 1]")]),
    ("safe_divide", "a: float, b: float", "float", "Return a / b, or 0.0 when b is zero.", [("6.0, 3.0", "2.0"), ("1.0, 0.0", "0.0")]),
    ("keep_positive", "nums: list", "list", "Return the strictly positive numbers of nums, in order.", [("[-2, 0, 5, 3]", "[5, 3]")]),
    ("char_histogram", "text: str", "dict", "Count the letters of text, ignoring case and non-letters.", [("'Aab!'", "{'a': 2, 'b': 1}")]),
    ("nearest_multiple", "n: int, m: int", "int", "Return the multiple of m closest to n (the larger one on a tie).", [("17, 5", "15"), ("18, 4", "20")]),
    ("sum_of_squares", "n: int", "int", "Return 1*1 + 2*2 + ... + n*n.", [("3", "14")]),
    ("matrix_trace", "m: list", "int", "Return the sum of the diagonal of a square matrix.", [("[[1, 2], [3, 4]]", "5")]),
    ("dedupe_words", "text: str", "str", "Remove repeated words, keeping the first occurrence of each.", [("'a b a c b'", "'a b c'")]),
    ("count_islands_1d", "cells: list", "int", "Count the groups of consecutive 1s in a list of 0s and 1s.", [("[1, 1, 0, 1, 0, 0, 1]", "3")]),
    ("weekday_name", "k: int", "str", "Return the name of weekday k, where 0 is Monday.", [("0", "'Monday'"), ("6", "'Sunday'")]),
    ("mean_absolute", "nums: list", "float", "Return the mean of the absolute values of nums.", [("[-2.0, 2.0, 5.0]", "3.0")]),
]

BOXED_REQUESTS = [
    "Please think step by step and write the final answer in \\boxed{}.",
    "Reason step by step, then give the final answer inside \\boxed{}.",
    "Work through it step by step and put the final answer in a \\boxed{}.",
    "Show your reasoning step by step; the final answer goes in \\boxed{}.",
]
STUB_WRAPPERS = [
    "Complete the following Python function so that its examples pass:\n```python\n{stub}\n```",
    "Write a solution to this problem and make sure the doctests pass:\n```python\n{stub}\n```",
    "Implement the function below.\n```python\n{stub}\n```",
    "Here is a function stub with examples. Write the full implementation:\n```python\n{stub}\n```",
]
STYLE_TAILS = ["", "", " Keep it under 150 words.", " Use a friendly tone.", " Format the answer as a bulleted list.",
               " Answer in no more than three paragraphs.", " Make it engaging and vivid.", " Be concise."]


def _latex(r: random.Random) -> str:
    a, b, c, d = r.randint(2, 9), r.randint(2, 20), r.randint(1, 30), r.randint(1, 6)
    n, k = r.randint(5, 12), r.randint(2, 4)
    forms = [
        f"If $f(x) = {a}x^2 - {b}x + {c}$, what is $f({d})$?",
        f"Solve for $x$: $\\frac{{x}}{{{a}}} + {b} = {b + c}$.",
        f"Find the slope of the line passing through $({a}, {b})$ and $({a + d}, {b + 2 * d + 1})$.",
        f"How many positive divisors does ${a * b * d}$ have?",
        f"What is the greatest common divisor of ${a * c}$ and ${a * b}$?",
        f"Compute $\\binom{{{n}}}{{{k}}}$.",
        f"Find the sum of the first ${n}$ terms of the arithmetic sequence ${a}, {a + d}, {a + 2 * d}, \\ldots$",
        f"The sum of two numbers is ${b + c + 10}$ and their difference is ${abs(b - c) + 2}$. What is the larger number?",
        f"What is the remainder when ${a * 1000 + b * 10 + c}$ is divided by ${d + 6}$?",
        f"Find the distance between the points $({a}, {d})$ and $({a + 3 * k}, {d + 4 * k})$.",
        f"Evaluate $\\log_{{{k}}} {k ** d}$.",
        f"If ${a}x + {c} = {a + k}x - {b}$, what is the value of $x$?",
        f"How many ways can ${min(n, 7)}$ people be arranged in a row?",
        f"What is the probability of rolling a sum of ${k + 3}$ with two fair six-sided dice? Express your answer as a common fraction.",
        f"Simplify $\\sqrt{{{a * a * b}}}$.",
        f"Find all real solutions of $x^2 - {a + d}x + {a * d} = 0$.",
        f"What is the value of ${a}^{k} - {d}^{k}$?",
        f"A rectangle has perimeter ${2 * (a + b)}$ and one side of length ${a}$. What is its area?",
        f"Find the least common multiple of ${a * d}$, ${b}$ and ${k + 1}$.",
        f"What is ${a}\\%$ of ${b * 50}$?",
    ]
    return r.choice(forms)


def _mathcot(r: random.Random) -> str:
    base = r.choice([_math, _arith, _latex, _latex])(r)
    base = re.sub(r" (Explain your reasoning step by step|Show your work)\.$", "", base)
    return base + "\n" + r.choice(BOXED_REQUESTS)


def _stub(spec) -> str:
    name, params, ret, doc, examples = spec
    lines = [f"def {name}({params}) -> {ret}:", f'    """ {doc}']
    for args, out in examples:
        lines += [f"    >>> {name}({args})", f"    {out}"]
    lines.append('    """')
    return "\n".join(lines) + "\n"


def _pycode(r: random.Random) -> str:
    if r.random() < 0.5:
        spec = r.choice(FUNCTION_SPECS)
        return r.choice(STUB_WRAPPERS).format(stub=_stub(spec))
    task = r.choice(CODE_TASKS + MORE_CODE_TASKS)
    verb, rest = task.split(" ", 1)
    inf = f"{verb[:-1]} {rest}"
    return r.choice([f"Write a python function to {inf}.", f"Write a Python function to {inf}.",
                     f"Write a function to {inf}.", f"Write a python program to {inf}."])


def _writing_v2(r: random.Random) -> str:
    return _writing(r) + r.choice(STYLE_TAILS)


_MAKERS = {"math": _math, "arith": _arith, "code": _code, "explain": _explain, "writing": _writing,
           "advice": _advice, "compare": _compare, "list": _list}
_WEIGHTS = {"math": 4, "arith": 2, "code": 4, "explain": 3, "writing": 3, "advice": 2, "compare": 1, "list": 1}
# mix v2: the same families plus the prompt styles the v1 set lacked (boxed-answer math with LaTeX
# notation, "write a python function to ...", function stubs with doctests, length/tone requests)
_MAKERS_V2 = dict(_MAKERS, mathcot=_mathcot, pycode=_pycode, writing=_writing_v2)
_WEIGHTS_V2 = {"math": 2, "arith": 1, "mathcot": 5, "code": 2, "pycode": 5, "explain": 3, "writing": 3,
               "advice": 2, "compare": 1, "list": 1}
MIXES = ("v1", "v2", "v3")

_BENCH_MARKERS = re.compile(r"def \w+\(.*\):\s*\n\s*\"\"\"|>>> ", re.S)


def is_benchmark_text(text: str) -> bool:
    """The v1 guard: HumanEval-style docstring stubs or doctests are kept out altogether (v2
    writes its own stubs and relies on :class:`BenchmarkFilter` instead)."""
    return bool(_BENCH_MARKERS.search(text))


def _words(text: str) -> List[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


class BenchmarkFilter:
    """Decontamination against the benchmark prompts: a text is rejected when its normalized form
    equals a benchmark turn or when it shares any ``n``-word shingle with one, except shingles that
    occur in ``boilerplate`` or more different benchmark turns (instruction boilerplate such as a
    "reason step by step" line, not problem content)."""

    def __init__(self, bench_texts: List[str], n: int = 8, boilerplate: int = 3):
        self.n = n
        self.exact = {_norm(t) for t in bench_texts}
        seen: Dict[tuple, int] = {}
        for t in set(bench_texts):
            for g in set(self._shingles(t)):
                seen[g] = seen.get(g, 0) + 1
        self.shingles = {g for g, c in seen.items() if c < boilerplate}

    def _shingles(self, text: str):
        w = _words(text)
        return [tuple(w[i:i + self.n]) for i in range(len(w) - self.n + 1)]

    def matches(self, text: str) -> bool:
        if _norm(text) in self.exact:
            return True
        return any(g in self.shingles for g in self._shingles(text))


def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", s.strip().lower())


def build_instructions(n: int, seed: int = 0, multiturn_frac: float = 0.12, chat_frac: float = 0.04,
                       exclude: Optional[List[str]] = None, mix: str = "v1",
                       avoid: Optional[List[str]] = None,
                       passages: Optional[List[str]] = None) -> List[Instruction]:
    """``n`` distinct instructions (fewer if the templates run out), deterministic for ``seed``.

    ``exclude``: the benchmark turns.  Mix ``v1`` (what the shipped drafter was trained on) drops a
    prompt whose normalized text equals one of them and never makes stubs or doctests; mix ``v2``
    adds the v2 families and rejects anything :class:`BenchmarkFilter` matches (equal text or a
    shared 8-word shingle that is not instruction boilerplate).  ``avoid``: prompts an earlier
    dataset already has (normalized-text match), so a second dataset adds new ones.  Mix ``v3``
    adds the combinatorial families of :mod:`.families_v3` (filtered like v2); ``passages``
    (paragraphs of the target's earlier responses) enable its ``passage`` family."""
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {MIXES}, got {mix!r}")
    r = random.Random(seed)
    if mix == "v3":
        makers, weights = v3_makers(_MAKERS_V2, NAMES, passages)
    else:
        makers, weights = (_MAKERS, _WEIGHTS) if mix == "v1" else (_MAKERS_V2, _WEIGHTS_V2)
    if mix == "v1":
        banned = {_norm(t) for t in (exclude or [])}

        def rejected(text: str) -> bool:
            return _norm(text) in banned or is_benchmark_text(text)
    else:
        filt = BenchmarkFilter(list(exclude or []))
        rejected = filt.matches
    seen = {_norm(t) for t in (avoid or [])}
    out: List[Instruction] = []
    kinds = [k for k, w in weights.items() for _ in range(w)]
    for c in CHAT:
        if len(out) >= int(n * chat_frac) + 1:
            break
        if _norm(c) in seen:
            continue
        out.append(Instruction("chat", [{"role": "user", "content": c}]))
        seen.add(_norm(c))
    tries = 0
    while len(out) < n and tries < n * 50:
        tries += 1
        kind = r.choice(kinds)
        text = makers[kind](r)
        key = _norm(text)
        if key in seen or rejected(text):
            continue
        seen.add(key)
        follow = r.choice(FOLLOWUPS) if r.random() < multiturn_frac else None
        out.append(Instruction(kind, [{"role": "user", "content": text}], followup=follow))
    r.shuffle(out)
    return out
