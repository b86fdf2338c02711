"""Writes launch/chat_requests.jsonl: user requests of the four kinds the held-out chat
prompts (launch/real_prompts.jsonl) are, as prompts for a chat model's self-distilled
drafter data (`train.self_distill_prompts`; launch/smollm2_eagle3_requests.py):

- code_completion: a standard-library function's `def` line and docstring, to complete
  or implement (or the docstring as a request for a function of that name);
- code_edit: a short standard-library function to rename (the function or a terse
  variable), add type hints or a docstring to, or strip of comments;
- summary: a paragraph of Python's own reference text (`pydoc_data.topics`) or a module's
  docstring, to summarise or explain;
- chat: everyday questions and writing requests, from the templates and topics below.

Deterministic for one Python version's standard library (the committed file came from
CPython 3.11's), and kept apart from the held-out prompts: none names their function,
their paragraph's subject or their question (checked below and by tests).

    python launch/chat_requests.py [--out=launch/chat_requests.jsonl]

The prose set (launch/chat_requests_prose.jsonl, launch/smollm2_eagle3_prose.py) differs
in two kinds, toward what users write: its summaries are of English paragraphs on
everyday, nature, history and science topics (written greedily by SmolLM2 itself from
"Write a paragraph about ..." and "Describe ... in one paragraph." requests, since no
such text ships offline; the reference text's paragraphs fill the rest), and its edits
also rename a function and a variable in one request. Three commands, the paragraphs
committed:

    python launch/chat_requests.py --paragraph_requests=launch/paragraph_requests.jsonl
    python -m specjax.sample --gguf_target=SmolLM2-135M-Instruct.Q4_1.gguf --quantize=w4a8 --chat \
        --prompts_file=launch/paragraph_requests.jsonl --mode=ars --temperature=0 --max_new_tokens=160 \
        --batch_size=30 --print_samples=false --output=paragraphs.jsonl
    python launch/chat_requests.py --paragraphs=paragraphs.jsonl --out=launch/chat_requests_prose.jsonl

(the committed launch/paragraphs.jsonl keeps each record's prompt and text: the same
requests come from it).
"""
from __future__ import annotations

import argparse
import ast
import json
import pathlib
import random
import re
import sysconfig
import textwrap

PER_KIND = 520
MAX_CHARS = 640  # a request's text at most; ~160-200 SmolLM2 tokens
HELD_OUT = ("merge_sorted", "average_of_positive", "Barrier Reef", "coral", "working from home",
            "staying focused")

CHAT_TEMPLATES = (
    ("What are some good habits for {}?", (
        "staying healthy while travelling", "learning a new language", "saving money", "sleeping better",
        "keeping a clean kitchen", "writing every day", "studying for exams", "reading more books",
        "managing email", "keeping in touch with friends", "running a small team", "eating less sugar",
        "practising the piano", "keeping a garden", "protecting my eyes at a computer", "taking notes in meetings",
        "raising a puppy", "planning the week", "reducing screen time", "working night shifts")),
    ("How do I {}?", (
        "make a monthly budget", "start running as a beginner", "write a good cover letter",
        "keep houseplants alive", "ask for a raise", "prepare for a job interview", "learn to cook rice properly",
        "choose a laptop for university", "get better at public speaking", "clean a cast iron pan",
        "train for a 10k race", "back up my photos", "make friends in a new city", "negotiate rent",
        "write a thank-you note", "fix a squeaky door", "start journaling", "teach a child to ride a bike",
        "set up a home network", "brew good coffee at home")),
    ("Can you explain {} in simple terms?", (
        "photosynthesis", "inflation", "how vaccines work", "recursion", "compound interest", "black holes",
        "how the internet works", "climate change", "machine learning", "supply and demand", "the water cycle",
        "how a bill becomes a law", "what DNA does", "how airplanes fly", "encryption", "the stock market",
        "electric cars", "how memory works in the brain", "gravity", "the greenhouse effect")),
    ("What is the difference between {} and {}?", (
        ("weather", "climate"), ("a virus", "a bacterium"), ("a list", "a tuple in Python"), ("RAM", "storage"),
        ("stocks", "bonds"), ("baking soda", "baking powder"), ("a crocodile", "an alligator"),
        ("affect", "effect"), ("TCP", "UDP"), ("a latte", "a cappuccino"), ("speed", "velocity"),
        ("a simile", "a metaphor"), ("HTTP", "HTTPS"), ("a debit card", "a credit card"),
        ("a process", "a thread"), ("empathy", "sympathy"), ("a lake", "a pond"), ("git merge", "git rebase"),
        ("a democracy", "a republic"), ("frogs", "toads"))),
    ("Give me {} ideas for {}.", (
        ("five", "a rainy weekend"), ("three", "a birthday party for a ten-year-old"), ("some", "healthy lunches"),
        ("five", "a team-building activity"), ("a few", "gifts for a teacher"), ("five", "a short story"),
        ("some", "a science fair project"), ("three", "a date night at home"), ("a few", "a small business"),
        ("five", "vegetarian dinners"), ("some", "things to do in a new city"), ("three", "a blog about cooking"),
        ("five", "exercises without equipment"), ("a few", "a family holiday"), ("some", "a garden in a small yard"),
        ("five", "names for a cat"), ("three", "a podcast"), ("a few", "saving energy at home"),
        ("five", "questions to ask in an interview"), ("some", "a picnic"))),
    ("Write a short {} about {}.", (
        ("poem", "the sea"), ("story", "a lost key"), ("email to my manager", "taking Friday off"),
        ("poem", "autumn leaves"), ("story", "a robot learning to paint"), ("message", "thanking a colleague"),
        ("paragraph", "why reading matters"), ("speech", "the first day of school"),
        ("email", "rescheduling a meeting"), ("poem", "a city at night"), ("story", "a dragon who is afraid of fire"),
        ("review", "a new coffee shop"), ("letter", "a pen pal in another country"),
        ("product description", "a reusable water bottle"), ("poem", "friendship"), ("story", "a time traveller"),
        ("note", "a neighbour about a parcel"), ("introduction", "myself for a new team"),
        ("toast", "a wedding"), ("story", "a cat who runs a bakery"))),
    ("What are the pros and cons of {}?", (
        "working remotely", "electric cars", "renting versus buying a home", "social media", "learning online",
        "nuclear power", "a four-day work week", "living in a big city", "homeschooling", "solar panels",
        "open-plan offices", "freelancing", "public transport", "self-driving cars", "a gap year",
        "smartwatches", "fast fashion", "cloud storage", "standing desks", "having a dog")),
    ("{}", (
        "Why is the sky blue?", "How many hours of sleep does an adult need?", "What should I pack for a hiking trip?",
        "What is a good way to start learning to code?", "Is it better to exercise in the morning or the evening?",
        "How can I be more productive in the afternoon?", "What makes a good password?",
        "How do I deal with stress before an exam?", "What are some easy recipes for beginners?",
        "How can I improve my handwriting?", "What is the best way to learn vocabulary?",
        "How do I keep my phone battery healthy?", "What should I know before adopting a cat?",
        "How can I reduce food waste at home?", "What are good books for learning about history?",
        "How do I politely say no to extra work?", "What is a healthy breakfast?",
        "How can I make my small apartment feel bigger?", "Why do leaves change colour in autumn?",
        "How do I stay motivated when learning something hard?")),
)


def _stdlib_files() -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "site-packages", "ensurepip")
    return sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))


def _functions():
    """(file, function node, its dedented source lines) for every function in the stdlib."""
    for path in _stdlib_files():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.end_lineno:
                body = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
                yield path, node, body


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


def _code(text: str) -> str:
    return f"```python\n{text}\n```"


TERSE = {"s": "text", "n": "count", "x": "value", "i": "index", "f": "file", "d": "mapping", "k": "key",
         "v": "item", "p": "path", "l": "items", "c": "char", "m": "match", "t": "token", "b": "data",
         "e": "error", "a": "first", "r": "result", "fp": "stream", "fn": "func", "obj": "target"}


STOP = {"return", "returns", "the", "a", "an", "of", "to", "and", "for", "is", "this", "that", "if", "in", "with",
        "by", "from", "or", "as", "be", "on", "it", "its", "given", "into", "at", "are", "not", "all"}


def _descriptive(doc: str | None) -> str | None:
    """A snake_case name from a docstring's first words ('Return the quoted string.' ->
    'quoted_string'), or None where it has fewer than two such words."""
    words = [w for w in re.findall(r"[a-z]+", (doc or "").split(".")[0].lower()) if w not in STOP][:3]
    return "_".join(words) if len(words) >= 2 else None


def _camel(name: str) -> str:
    head, *rest = name.strip("_").split("_")
    return head + "".join(w.capitalize() for w in rest)


def completion_and_edit(rng: random.Random, both_renames: bool = False) -> tuple[list[dict], list[dict]]:
    complete, edit = [], []
    for path, node, body in _functions():
        name = node.name
        doc = ast.get_docstring(node)
        sig = body.splitlines()[0]
        if not sig.rstrip().endswith(":") or len(sig) > 100 or name.startswith("__"):
            continue
        if doc and 40 <= len(_first_paragraph(doc)) <= 300 and not name.startswith("_"):
            first = _first_paragraph(doc)
            how = rng.choice((
                "Complete this Python function. Reply with code only.\n\n{code}",
                "Implement this function.\n\n{code}",
                "Write the body of this Python function.\n\n{code}",
                "Write a Python function `{name}` that does this: {doc}",
                "Finish this function for me.\n\n{code}"))
            complete.append({"name": "code_completion", "source": f"{path.name}:{node.lineno}",
                             "prompt": how.format(code=_code(f'{sig}\n    """{first}"""'), name=name, doc=first)})
        n_lines = body.count("\n") + 1
        if 4 <= n_lines <= 16 and len(body) <= MAX_CHARS - 160 and "\t" not in body:
            args = [a.arg for a in node.args.args if a.arg != "self"]
            local = sorted({t.id for t in ast.walk(node) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)})
            terse = [v for v in args + local if v in TERSE and not re.search(rf"\b{TERSE[v]}\b", body)]
            has_comment = any(line.lstrip().startswith("#") for line in body.splitlines())
            options = ["Add type hints to this function. Reply with the whole edited function only.\n\n{code}"]
            if not doc:
                options.append("Add a docstring to this function. Reply with the whole function only.\n\n{code}")
            if terse:
                v = rng.choice(terse)
                options.append(f"Rename the variable `{v}` to `{TERSE[v]}`. Reply with the whole edited function "
                               "only.\n\n{code}")
            if "_" in name.strip("_"):
                options.append(f"Rename the function `{name}` to `{_camel(name)}`. Reply with the whole edited "
                               "function only.\n\n{code}")
            renamed = _camel(name) if "_" in name.strip("_") else _descriptive(doc)
            if both_renames and terse and renamed and renamed != name:  # as users ask: a function and a variable
                options += [f"Rename the function `{name}` to `{renamed}` and the variable `{v}` to "
                            f"`{TERSE[v]}`. Reply with the whole edited function only.\n\n{{code}}"] * 4
            if has_comment:
                options.append("Remove the comments from this function and reply with the code only.\n\n{code}")
            options.append("Make this function easier to read without changing what it does.\n\n{code}")
            edit.append({"name": "code_edit", "source": f"{path.name}:{node.lineno}",
                         "prompt": rng.choice(options).format(code=_code(body))})
    return complete, edit


SUMMARY_ASKS = ("Summarize this paragraph in two sentences.", "Summarize this text in one sentence.",
                "Give a short summary of the following passage.", "Explain this paragraph in simple words.",
                "What is the main point of this text?", "List the key points of this text.")

# Subjects for SmolLM2's own paragraphs (the prose set's summaries): none a held-out one.
PARAGRAPH_TOPICS = (
    "the Amazon rainforest", "the Sahara desert", "the Himalayas", "the Nile river", "volcanoes", "earthquakes",
    "glaciers", "the Arctic", "Antarctica", "the Pacific Ocean", "tides", "hurricanes", "tornadoes", "monsoons",
    "the Grand Canyon", "the Dead Sea", "Mount Everest", "the Mediterranean Sea", "rivers and deltas", "caves",
    "honeybees", "ants", "elephants", "whales", "dolphins", "octopuses", "penguins", "wolves", "owls",
    "butterfly migration", "salmon", "sharks", "sea turtles", "bats", "tigers", "pandas", "camels", "kangaroos",
    "mushrooms", "oak trees", "bamboo", "cacti", "wildflowers", "rice farming", "coffee", "tea", "chocolate",
    "bread", "cheese", "olive oil", "spices", "the potato", "honey", "salt", "the printing press",
    "the Roman Empire", "ancient Egypt", "the Great Wall of China", "the Silk Road", "the Vikings",
    "the Renaissance", "the Industrial Revolution", "the invention of the telephone", "the first airplanes",
    "the Moon landing", "the history of the bicycle", "the history of writing", "ancient Greece", "the Maya",
    "castles in the Middle Ages", "the steam engine", "lighthouses", "the history of money", "the Olympic Games",
    "the history of chess", "trains", "canals", "bridges", "skyscrapers", "the solar system", "Mars", "Jupiter",
    "comets", "the Sun", "stars", "galaxies", "the Moon", "eclipses", "the human heart", "the human brain",
    "sleep", "the immune system", "bones", "muscles", "the sense of smell", "vitamins", "water", "clouds",
    "rainbows", "lightning", "snow", "wind power", "solar power", "batteries", "magnets", "electricity",
    "sound", "light", "plastics", "recycling", "glass", "steel", "paper", "cotton", "wool", "libraries",
    "museums", "public parks", "city buses", "farmers' markets", "post offices", "bakeries", "hospitals",
    "schools in Finland", "the piano", "the violin", "jazz", "folk music", "painting with watercolours",
    "pottery", "photography", "cinema", "theatre", "poetry", "newspapers", "radio", "television", "video games",
    "board games", "football", "tennis", "swimming", "cycling", "marathons", "yoga", "gardening", "camping",
    "hiking", "birdwatching", "knitting", "baking", "cooking pasta", "street food", "picnics", "tea ceremonies",
    "festivals of light", "New Year celebrations", "weddings around the world", "maps", "compasses", "clocks",
    "calendars", "the metric system", "vaccines", "antibiotics", "microscopes", "telescopes", "satellites",
    "the internet", "email", "smartphones", "robots", "electric bicycles", "3D printing", "bees and pollination",
    "soil", "deserts at night", "wetlands", "mangroves", "kelp forests", "mountain goats", "arctic foxes",
    "migrating birds", "frogs", "spiders", "earthworms", "dinosaurs", "fossils", "the Ice Age", "islands",
    "the Galapagos Islands", "Iceland", "Venice", "Kyoto", "Istanbul", "the Andes", "the Alps", "the Rhine",
)


PARAGRAPH_ASKS = ("Write a paragraph about {}.", "Describe {} in one paragraph.")


def paragraph_requests() -> list[dict]:
    return [{"name": "paragraph", "source": topic, "prompt": ask.format(topic)}
            for ask in PARAGRAPH_ASKS for topic in PARAGRAPH_TOPICS]


def paragraph_summaries(path: str, rng: random.Random) -> list[dict]:
    """Summary requests over SmolLM2's paragraphs (`sample --output` JSON lines: each
    record's prompt and text, all launch/paragraphs.jsonl keeps), each flattened to one
    paragraph of prose (headings and list marks dropped)."""
    out = []
    for line in pathlib.Path(path).read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        words = [w for w in " ".join(record["text"].split()).split(" ") if not re.fullmatch(r"[#*\-]+|\d+\.", w)]
        text = " ".join(words)
        if len(text) > MAX_CHARS - 80:  # cut at the last full sentence that fits
            text = text[:MAX_CHARS - 80].rsplit(". ", 1)[0] + "."
        if len(text) >= 240 and text.count(".") >= 2:
            topic = re.sub(r"^(Write a paragraph about|Describe) | in one paragraph\.$|\.$", "", record["prompt"])
            out.append({"name": "summary", "source": f"paragraph: {topic}",
                        "prompt": f"{rng.choice(SUMMARY_ASKS)}\n\n{text}"})
    return out


def summaries(rng: random.Random) -> list[dict]:
    from pydoc_data.topics import topics
    texts = []
    for topic in sorted(topics):
        for n, para in enumerate(topics[topic].split("\n\n")):
            flat = " ".join(para.split())
            prose = para.lstrip()[:1].isalpha() and not para.startswith(" ") and flat.count(".") >= 2
            if prose and 240 <= len(flat) <= MAX_CHARS - 80 and "*" not in flat[:3]:
                texts.append((f"topics[{topic!r}] #{n}", flat))
    for path in _stdlib_files():
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for n, para in enumerate((doc or "").split("\n\n")):
            flat = " ".join(para.split())
            if 240 <= len(flat) <= MAX_CHARS - 80 and flat[:1].isalpha() and flat.count(".") >= 2:
                texts.append((f"{path.name} docstring #{n}", flat))
    out = []
    for source, text in texts:
        how = rng.choice(SUMMARY_ASKS)
        out.append({"name": "summary", "source": source, "prompt": f"{how}\n\n{text}"})
    return out


# The same topics asked another way (greedy replies to a repeated prompt would repeat).
REPHRASED = ("Any tips for {}?", "I want to {}. Where should I start?", "Tell me about {}.",
             "Briefly, how do {} and {} differ?", "Suggest {} ideas for {}.",
             "Write a short {} about {}. Keep it under 100 words.", "Should I consider {}? What are the downsides?",
             "Quick question: {}")


def chats() -> list[dict]:
    out = []
    for (template, topics), again in zip(CHAT_TEMPLATES, REPHRASED):
        for form in (template, again):
            for topic in topics:
                out.append({"name": "chat", "source": form,
                            "prompt": form.format(*(topic if isinstance(topic, tuple) else (topic,)))})
    return out


def requests(paragraphs: str | None = None) -> list[dict]:
    """The requests; with `paragraphs` (SmolLM2's, see the module docstring) the prose set:
    summaries of those paragraphs first, the reference text's after them, and the edits
    that rename a function and a variable at once."""
    rng = random.Random(20261207)
    complete, edit = completion_and_edit(rng, both_renames=paragraphs is not None)
    summary = summaries(rng)
    if paragraphs is not None:
        english = paragraph_summaries(paragraphs, random.Random(20261208))
        rng.shuffle(summary)
        summary = english + summary[:PER_KIND - len(english)]
    kinds = [complete, edit, summary]
    out = []
    for kind in kinds:
        kind = [r for r in kind if len(r["prompt"]) <= MAX_CHARS and not any(h in r["prompt"] for h in HELD_OUT)]
        rng.shuffle(kind)
        out += kind[:PER_KIND]
    out += chats()
    for r in out:
        assert not any(h.lower() in r["prompt"].lower() for h in HELD_OUT), r
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(pathlib.Path(__file__).with_name("chat_requests.jsonl")))
    parser.add_argument("--paragraphs", help="SmolLM2's paragraphs (sample --output): write the prose set")
    parser.add_argument("--paragraph_requests", help="write the requests for those paragraphs here, and stop")
    args = parser.parse_args()
    if args.paragraph_requests:
        pathlib.Path(args.paragraph_requests).write_text("".join(json.dumps(r) + "\n" for r in paragraph_requests()),
                                                         encoding="utf-8")
        print(f"{len(PARAGRAPH_ASKS) * len(PARAGRAPH_TOPICS)} paragraph requests")
        return
    out = requests(args.paragraphs)
    pathlib.Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in out), encoding="utf-8")
    counts = {k: sum(r["name"] == k for r in out) for k in ("code_completion", "code_edit", "summary", "chat")}
    print(f"{len(out)} requests: {counts}")


if __name__ == "__main__":
    main()
