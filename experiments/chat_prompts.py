"""Chat prompts the project writes itself: what SmolLM2's draft trains on.

Templates x topics, enumerated in a fixed order and split by a hash of the
prompt (about 5% held out), so the training set and the held-out set do
not depend on how many prompts a run takes. No file, no download.

    chat_prompts.prompts("train")[:3]
    chat_prompts.prompts("held_out")
"""

import hashlib
import typing

import numpy as np

HELD_OUT_FRACTION = 0.05

_TEMPLATES = (
    "What is {t}?",
    "Explain {t} in simple terms.",
    "Give me three facts about {t}.",
    "Why does {t} matter?",
    "Write a short paragraph about {t}.",
    "How would you describe {t} to a child?",
    "What are the main ideas behind {t}?",
    "Summarize what you know about {t}.",
    "What is a common misconception about {t}?",
    "Write a haiku about {t}.",
    "List some pros and cons of {t}.",
    "How can I learn more about {t}?",
    "Tell me a short story that involves {t}.",
    "What questions should I ask about {t}?",
    "Compare {t} with something similar.",
    "What is the history of {t}?",
)

_TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "the moon",
    "volcanoes", "earthquakes", "climate change", "rainbows", "gravity",
    "electricity", "magnets", "the human heart", "sleep", "exercise",
    "healthy eating", "vitamins", "the immune system", "bacteria", "DNA",
    "evolution", "dinosaurs", "bees", "whales", "forests", "deserts",
    "oceans", "rivers", "mountains", "the solar system", "Mars",
    "the internet", "computers", "programming", "Python", "databases",
    "encryption", "artificial intelligence", "robots", "smartphones",
    "batteries", "solar power", "wind energy", "recycling", "plastic",
    "coffee", "tea", "bread", "chocolate", "cooking pasta", "gardening",
    "time management", "writing an essay", "public speaking",
    "learning a language", "reading books", "music", "the piano",
    "painting", "photography", "chess", "football", "running a marathon",
    "swimming", "cycling", "travel", "maps", "the Roman Empire",
    "ancient Egypt", "the printing press", "democracy", "money",
    "inflation", "saving money", "banks", "taxes", "friendship",
    "kindness", "happiness", "stress", "teamwork", "leadership",
    "mathematics", "prime numbers", "fractions", "geometry", "statistics",
    "probability", "the Pythagorean theorem", "algebra", "calendars",
    "clocks", "weather forecasts", "snow", "thunderstorms", "cats", "dogs",
    "birds", "trees", "flowers", "the Eiffel Tower", "Paris", "Japan",
    "the Amazon rainforest", "libraries", "museums", "newspapers",
    "email etiquette", "job interviews", "cars", "trains", "airplanes",
    "bridges", "skyscrapers", "the telephone", "light", "sound", "colors",
    "the alphabet", "poetry", "Shakespeare", "fairy tales", "volunteering",
)


def is_held_out(prompt: str) -> bool:
  """Whether a prompt is in the held-out split (a hash of its text)."""
  digest = hashlib.sha256(prompt.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") < HELD_OUT_FRACTION * 2.0**64


def prompts(split: str = "train") -> list[str]:
  """Every prompt of a split ("train" or "held_out"), in a fixed order that
  interleaves templates and topics."""
  if split not in ("train", "held_out"):
    raise ValueError(f"chat_prompts: split must be 'train' or 'held_out', "
                     f"got {split!r}")
  # Row j pairs topic i with template i + j: neighbours differ in both.
  every = [_TEMPLATES[(i + j) % len(_TEMPLATES)].format(t=_TOPICS[i])
           for j in range(len(_TEMPLATES)) for i in range(len(_TOPICS))]
  return [p for p in every if is_held_out(p) == (split == "held_out")]


def held_out_prompts(tokenizer: typing.Any, n: int, length: int, seed: int,
                     chat: typing.Callable[[str], str]) -> np.ndarray:
  """int32[n, length]: held-out prompts in the chat template (`chat`),
  each cut to its last `length` tokens (so a batch needs no padding; the
  cut drops the start of the system message), drawn with replacement in
  a seeded order.

  Raises:
    ValueError: a held-out prompt is shorter than `length` tokens.
  """
  encoded = [tokenizer.encode(chat(p)) for p in prompts("held_out")]
  shortest = min(e.size for e in encoded)
  if length > shortest:
    raise ValueError(f"chat prompts: the shortest held-out prompt has "
                     f"{shortest} tokens, fewer than {length}")
  order = np.random.default_rng(seed).permutation(len(encoded))
  picks = [order[i % len(order)] for i in range(n)]
  return np.stack([encoded[i][-length:] for i in picks]).astype(np.int32)
