"""The shipped training prompts (prompts.jsonl), composed: `python -m specdec.train.compose_prompts > FILE`.

A head learns the target's continuations of the kinds of text it is served, so the set spreads over many
kinds of request (advice, stories, explanations, lists, comparisons, plans, letters, dialogue, code, ...)
and many subjects: every template crossed with every topic, then a seeded draw of `COUNT` of them. Grounded
requests (summarise, rewrite, answer from a text) are made from the target's own answers at training time
(data.grounded_prompts), since their texts should be the target's kind of text too.

Disjoint from the benchmark's prompts (bench/prompts_*.jsonl): none of their subjects is a topic here, and a
unit test checks that no shipped prompt shares a run of five words with any of them.
"""

from __future__ import annotations

import json
import random
import sys

COUNT = 1800
SEED = 0

TEMPLATES = (
    "Give me three interesting facts about {t}.",
    "List five questions a student might ask about {t}, with short answers.",
    "Write a friendly email inviting a colleague to a talk about {t}.",
    "Write a short poem about {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "Explain {t} to a ten-year-old.",
    "Summarise the history of {t} in a few sentences.",
    "Describe a typical day for someone who works with {t}.",
    "I am new to {t}. Where should I start?",
    "Write a two-paragraph blog post introducing {t} to beginners.",
    "What are common misconceptions about {t}?",
    "Give me a step-by-step guide to learning about {t} in one month.",
    "Write a dialogue between a teacher and a curious pupil about {t}.",
    "Compose a tweet-length announcement of a new museum exhibit on {t}.",
    "How has {t} changed over the last hundred years?",
    "Write a haiku and then explain the imagery, on the subject of {t}.",
    "What would a world without {t} look like?",
    "Create a five-question multiple-choice quiz about {t}, with the answers at the end.",
    "Write the opening paragraph of a mystery novel in which {t} plays a part.",
    "Give three tips for explaining {t} in a presentation.",
    "Write a product description for a board game themed around {t}.",
    "Describe {t} using only simple words.",
    "What careers are connected to {t}, and what skills do they need?",
    "Write a short speech for a school assembly about {t}.",
    "Outline an essay on {t} with an introduction, three points and a conclusion.",
    "Tell a bedtime tale featuring {t}.",
    "Which books or films would you recommend to someone interested in {t}, and why?",
    "Argue for and against spending public money on {t}.",
    "Write a limerick about {t}.",
    "Write a diary entry from someone who has just discovered {t}.",
    "Define five key terms related to {t}.",
    "What are the biggest open questions about {t} today?",
    "Explain how {t} affects everyday life.",
    "Write a short news report about a surprising discovery involving {t}.",
    "Plan a one-day school trip on the theme of {t}.",
    "Write a Python function related to {t}, with a docstring and an example call.",
    "Write a short FAQ about {t} with four questions.",
    "In a table with two columns, list facts and myths about {t}.",
    "Summarise what a beginner should know about {t} in bullet points.",
    "Write a motivational message for someone studying {t}.",
)

TOPICS = (
    "solar panels", "dinosaurs", "black holes", "the printing press", "ancient Egypt", "glaciers", "volcanoes",
    "electric cars", "jazz music", "wind turbines", "origami", "honey bees", "coral reefs", "the human heart",
    "submarines", "tides", "the periodic table", "the stock market", "recycling", "penguins", "kites", "maps",
    "museums", "tea ceremonies", "the moon landing", "the internet", "earthquakes", "rivers", "the water cycle",
    "photosynthesis", "the Roman Empire", "chess", "knitting", "bread baking", "lighthouses", "the Silk Road",
    "quantum computers", "magnets", "rainbows", "bicycles", "trains", "hot air balloons", "the Olympic Games",
    "opera", "sculpture", "the violin", "jigsaw puzzles", "board games", "cheese making", "spices", "chocolate",
    "sourdough", "beekeeping", "bonsai trees", "mushrooms", "whales", "octopuses", "owls", "elephants", "ants",
    "sharks", "butterflies", "wolves", "cats", "horses", "deserts", "caves", "islands", "mountains", "waterfalls",
    "the ocean floor", "the Arctic", "Mars", "Jupiter", "comets", "telescopes", "satellites", "the speed of light",
    "gravity", "electricity", "batteries", "microscopes", "DNA", "the human brain", "sleep", "memory", "dreams",
    "laughter", "music therapy", "meditation", "nutrition", "bones", "the immune response to allergies",
    "first aid", "libraries", "newspapers", "radio", "photography", "cinema", "animation", "video games",
    "smartphones", "passwords", "spreadsheets", "databases", "open-source software", "robots in factories",
    "artificial intelligence", "machine translation", "sorting algorithms", "binary numbers", "prime numbers",
    "fractions", "geometry", "probability", "statistics", "cryptography", "the metric system", "clocks",
    "calendars", "money", "banks", "taxes", "small businesses", "advertising", "supply chains", "shipping containers",
    "bridges", "skyscrapers", "castles", "pyramids", "cathedrals", "city parks", "public transport",
    "urban gardens", "composting", "bird migration", "fossils", "the ice age", "the Vikings", "ancient Greece",
    "the Renaissance", "the Industrial Revolution", "the Great Wall of China", "the Aztecs", "samurai",
    "democracy", "human rights", "volunteering", "languages", "sign language", "poetry", "fairy tales",
    "mythology", "comic books", "theatre", "dance", "the piano", "drums", "choirs", "folk music", "painting",
    "pottery", "architecture", "fashion", "textiles", "dyes and pigments", "glass making", "steel",
    "plastics", "paper", "ink", "soap", "salt", "sugar", "rice", "potatoes", "olive oil", "tomatoes",
    "fermentation", "ice cream", "street food", "table manners", "birthdays", "holidays around the world",
    "friendship", "teamwork", "time management", "public speaking", "negotiation", "job interviews",
    "saving money", "moving to a new city", "learning a language", "keeping a journal", "houseplants",
    "aquariums", "dogs as working animals", "zoos", "national parks", "sailing", "mountain climbing",
    "swimming", "cycling races", "football", "tennis", "the marathon's origin", "yoga", "gymnastics",
)


def compose(count: int = COUNT, seed: int = SEED) -> list[str]:
    """`count` distinct template x topic prompts, drawn with `seed` (the same list every time)."""
    every = [template.format(t=topic) for template in TEMPLATES for topic in TOPICS]
    return random.Random(seed).sample(every, min(count, len(every)))


def main() -> int:
    for prompt in compose():
        sys.stdout.write(json.dumps({"prompt": prompt}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
