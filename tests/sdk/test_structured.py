"""Structured outputs through the official OpenAI Python SDK, unmodified.

`client.chat.completions.parse(response_format=<pydantic model>)` on 20 schemas (objects,
arrays, enums, nested models, optional fields, literals, unions, recursion): every answer
must validate, whatever the model would have written unconstrained, even one the token
budget cut short (`finish_reason` `length`: the grammar closed the value in the tokens left).

Usage: SLUICE_ENGINE_URL=http://127.0.0.1:PORT python3 tests/sdk/test_structured.py (an engine), or with
demo.env's OPENAI_* variables (a gateway; SLUICE_SDK_MODEL picks the model). Run by
tests/engine_server.rs and, through `sluice up`, tests/up.rs; plain asserts, a non-zero exit code on failure.
"""

import enum
import json
import sys
import time
from typing import Literal, Optional, Union

import openai
from sdk_client import sdk_client
from pydantic import BaseModel


class Color(str, enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class City(BaseModel):
    name: str
    country: str


class Person(BaseModel):
    name: str
    age: int


class Point(BaseModel):
    x: float
    y: float


class Capital(BaseModel):
    capital: str


class Sum(BaseModel):
    result: int


class Yes(BaseModel):
    answer: bool


class Colors(BaseModel):
    colors: list[Color]


class Favorite(BaseModel):
    color: Color
    reason: str


class People(BaseModel):
    people: list[Person]


class Trip(BaseModel):
    origin: City
    destination: City


class Contact(BaseModel):
    name: str
    email: Optional[str]
    phone: Optional[str]


class Review(BaseModel):
    sentiment: Literal["positive", "negative", "neutral"]
    score: int


class Tags(BaseModel):
    tags: list[str]


class Matrix(BaseModel):
    rows: list[list[int]]


class Shape(BaseModel):
    kind: Literal["circle", "square"]
    size: float
    center: Point


class Event(BaseModel):
    title: str
    day: int
    month: Literal["january", "february", "march", "april", "may", "june", "july",
                   "august", "september", "october", "november", "december"]


class Reading(BaseModel):
    value: Union[int, str]
    unit: Optional[Literal["celsius", "fahrenheit"]]


class Step(BaseModel):
    action: str
    done: bool


class Plan(BaseModel):
    goal: str
    steps: list[Step]


class Node(BaseModel):
    label: str
    children: list["Node"]


class Inventory(BaseModel):
    item: str
    count: int
    price: float
    in_stock: bool
    color: Optional[Color]


CASES = [
    (Capital, "What is the capital of France?"),
    (Sum, "What is 2 plus 3?"),
    (Yes, "Is the sky blue?"),
    (Person, "Describe a person named Alice who is 30 years old."),
    (Point, "Give the point with x 1.5 and y -2."),
    (City, "Name a city and its country."),
    (Colors, "List two colors."),
    (Favorite, "What is your favorite color, and why? Answer in a few words."),
    (People, "List two people with their ages."),
    (Trip, "Plan a trip from Paris to Rome."),
    (Contact, "Make a contact card for Bob, email bob@example.com."),
    (Review, "Rate this review: 'The food was great!'"),
    (Tags, "Give three tags for a blog post about cooking."),
    (Matrix, "Write the 2 by 2 identity matrix."),
    (Shape, "Describe a circle of size 2 centered at the origin."),
    (Event, "My birthday party is on the 4th of July."),
    (Reading, "The temperature is 21 degrees celsius."),
    (Plan, "Plan how to make tea, in two steps."),
    (Node, "Make a tree with a root labelled 'a' and one child labelled 'b'."),
    (Inventory, "We have 3 red chairs in stock at 19.99 each."),
]


def parse(client, model, schema, question):
    """The parsed answer's tokens and whether it ended by itself (else the token budget
    made the grammar close it: `finish_reason` is `length`, the content still validates)."""
    started = time.monotonic()
    try:
        r = client.chat.completions.parse(
            model=model,
            messages=[
                {"role": "system", "content": "Answer in JSON, briefly."},
                {"role": "user", "content": question},
            ],
            response_format=schema,
            max_tokens=200,
            temperature=0,
        )
        ended = True
    except openai.LengthFinishReasonError as e:
        r = e.completion
        ended = False
    choice = r.choices[0]
    assert choice.finish_reason == ("stop" if ended else "length"), (schema.__name__, choice)
    # The content is the JSON itself, nothing around it, and it validates either way.
    parsed = schema.model_validate_json(choice.message.content)
    if ended:
        assert choice.message.parsed == parsed, (schema.__name__, choice.message)
    return r.usage.completion_tokens, time.monotonic() - started, ended


def check_refusals(client, model):
    """A schema the server cannot enforce is a 400 naming the keyword, never ignored."""
    fmt = {
        "type": "json_schema",
        "json_schema": {
            "name": "p",
            "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}}},
        },
    }
    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], response_format=fmt
        )
    except openai.BadRequestError as e:
        assert e.param == "response_format.json_schema.schema", e.body
        assert "pattern" in str(e.body), e.body
    else:
        raise AssertionError("an unenforceable schema was accepted")


def check_json_object(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a cat in JSON."}],
        response_format={"type": "json_object"},
        max_tokens=120,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length"), choice
    assert isinstance(json.loads(choice.message.content), dict), choice.message.content



def main():
    client, model = sdk_client()
    names = [schema.__name__ for schema, _ in CASES]
    assert len(set(names)) == 20, names
    tokens = 0
    seconds = 0.0
    ended = 0
    for schema, question in CASES:
        n, t, e = parse(client, model, schema, question)
        tokens += n
        seconds += t
        ended += e
    # Greedy, so the same every run: most answers end by themselves; the constraint does not
    # merely cut every one short.
    assert ended >= len(CASES) // 2, f"only {ended} of {len(CASES)} answers ended by themselves"
    check_json_object(client, model)
    check_refusals(client, model)
    print(
        f"openai {openai.__version__}: {len(CASES)} of {len(CASES)} schemas validated "
        f"({ended} ended by themselves, {len(CASES) - ended} closed by the token budget; "
        f"{tokens} tokens in {seconds:.1f} s), json_object parsed, an unenforceable schema "
        f"refused"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
