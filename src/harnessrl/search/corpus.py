"""A corpus of invented people, companies, cities and countries, generated from a seed, with two-hop questions.

Invented rather than taken from the web so that nothing is downloaded, the corpus is the same on every machine,
and no model can know an answer without searching: every name is made of random syllables. Each question needs
two documents: the one about its subject gives a bridge entity (a birthplace, an employer), the one about the
bridge gives the answer (a country, a city). Every document also carries distractor facts about other entities,
so a lexical match on the question alone does not find the second document.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SYLLABLES = ("ka", "lo", "mi", "ren", "tah", "vor", "sel", "qui", "dun", "bri", "zo", "fen", "gal", "pra", "ush",
             "el", "mar", "tov", "ix", "nae", "rho", "ul", "sav", "kin", "dre", "yo", "bal", "cor", "thi", "wen")
TRADES = ("glassblower", "cartographer", "archivist", "ferry pilot", "beekeeper", "luthier", "surveyor",
          "typesetter", "tanner", "astronomer", "chemist", "weaver")
GOODS = ("lanterns", "ropes", "maps", "clocks", "ink", "sails", "bells", "lenses", "kites", "spices")


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    text: str

    def as_json(self) -> dict:
        return {"id": self.id, "title": self.title, "text": self.text}


@dataclass(frozen=True)
class Question:
    id: str
    kind: str
    question: str
    answer: str
    supporting: tuple[str, ...]  # the document ids, in hop order


def _names(rng: random.Random, count: int, syllables: tuple[int, int], taken: set[str]) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(*syllables))).capitalize()
        if name not in taken:
            taken.add(name)
            names.append(name)
    return names


def generate(seed: int, people: int = 60) -> tuple[list[Document], list[Question]]:
    """The corpus and every question it answers; the same for the same seed and size."""
    rng = random.Random(seed)
    taken: set[str] = set()
    countries = _names(rng, 8, (2, 3), taken)
    cities = _names(rng, 20, (2, 3), taken)
    companies = [f"{name} {rng.choice(('Works', 'Guild', 'Company', 'Foundry'))}"
                 for name in _names(rng, 15, (2, 2), taken)]
    persons = [f"{first} {last}" for first, last in zip(_names(rng, people, (2, 2), taken),
                                                        _names(rng, people, (2, 3), taken), strict=True)]
    country_of = {city: rng.choice(countries) for city in cities}
    seat_of = {company: rng.choice(cities) for company in companies}
    born_in = {person: rng.choice(cities) for person in persons}
    # never a company seated in the person's birthplace: the first document would hold the second hop's answer
    works_for = {person: rng.choice([c for c in companies if seat_of[c] != born_in[person]]) for person in persons}

    documents: list[Document] = []

    def add(title: str, sentences: list[str]) -> str:
        doc_id = f"doc-{len(documents):04d}"
        documents.append(Document(doc_id, title, " ".join(sentences)))
        return doc_id

    doc_of: dict[str, str] = {}
    for country in countries:
        doc_of[country] = add(country, [f"{country} is a country.", f"Its capital trades in {rng.choice(GOODS)}."])
    for city in cities:
        other = rng.choice(persons)
        doc_of[city] = add(city, [f"{city} is a city in the country of {country_of[city]}.",
                                  f"It is known for its {rng.choice(GOODS)}.",
                                  f"The {rng.choice(TRADES)} {other} once visited {city}."])
    for company in companies:
        doc_of[company] = add(company, [f"{company} makes {rng.choice(GOODS)}.",
                                        f"{company} has its headquarters in the city of {seat_of[company]}."])
    for person in persons:
        doc_of[person] = add(person, [f"{person} is a {rng.choice(TRADES)}.",
                                      f"{person} was born in {born_in[person]}.",
                                      f"{person} works for {works_for[person]}."])

    questions: list[Question] = []
    for person in persons:
        city, company = born_in[person], works_for[person]
        questions.append(Question(f"country-{len(questions):04d}", "birth-country",
                                  f"In which country was {person} born?", country_of[city],
                                  (doc_of[person], doc_of[city])))
        questions.append(Question(f"seat-{len(questions):04d}", "employer-seat",
                                  f"In which city is the headquarters of the company {person} works for?",
                                  seat_of[company], (doc_of[person], doc_of[company])))
    return documents, questions
