"""Prompts whose structured answers copy the prompt, for speculative decoding with
structured outputs.

Each gives one customer record as free text and asks for it as JSON; the answer, held to
SCHEMA by a structured output, copies the record's values, which is what an n-gram lookup
drafts from (engine/speculation.py) while the constraint checks each draft
(structured_outputs/step_masks.py). One JSON line {"prompt": ...} a prompt, for `vllm bench
serve --dataset-name custom`; `--schema` prints the request body's structured output
instead, for `--extra-body`.

    python bench/json_extraction_prompts.py > /tmp/json.jsonl
    python bench/json_extraction_prompts.py --schema   # '{"structured_outputs": {...}}'
"""

from __future__ import annotations

import argparse
import json
import random

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "maxLength": 60},
        "city": {"type": "string", "maxLength": 30},
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "item": {"type": "string", "maxLength": 40},
                    "quantity": {"type": "integer"},
                },
                "required": ["item", "quantity"],
                "additionalProperties": False,
            },
            "maxItems": 6,
        },
        "note": {"type": "string", "maxLength": 200},
    },
    "required": ["name", "email", "city", "orders", "note"],
    "additionalProperties": False,
}

FIRST = ["Ana", "Bruno", "Chen", "Dalia", "Emeka", "Fatima", "Goran", "Hana"]
LAST = ["Lopes", "Okafor", "Nakamura", "Schneider", "Ivanova", "Haddad", "Larsen", "Moreau"]
CITIES = ["Lisbon", "Lagos", "Osaka", "Hamburg", "Kazan", "Beirut", "Bergen", "Lyon"]
ITEMS = ["blue ceramic mug", "walnut cutting board", "linen tea towel", "cast iron skillet",
         "glass storage jar", "bamboo utensil set", "copper kettle", "wool table runner"]  # fmt: skip
NOTES = [
    "Please leave the parcel with the neighbour at number 12 if nobody answers the door.",
    "The customer asked for gift wrapping and a handwritten card saying happy birthday.",
    "Deliver after six in the evening on weekdays; the office is closed at weekends.",
    "Two items arrived damaged last time, so pack the glass ones with extra paper.",
]


def prompts(count: int = 16, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        email = name.lower().replace(" ", ".") + "@example.com"
        orders = [(rng.choice(ITEMS), rng.randint(1, 9)) for _ in range(rng.randint(2, 4))]
        lines = "\n".join(f"- {quantity} x {item}" for item, quantity in orders)
        out.append(
            "Turn this customer record into JSON with the keys name, email, city, orders "
            "(item, quantity) and note, copying the values exactly.\n\n"
            f"Customer: {name}\nEmail: {email}\nCity: {rng.choice(CITIES)}\n"
            f"Orders:\n{lines}\nNote: {rng.choice(NOTES)}\n\nJSON:"
        )
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schema", action="store_true", help="print the --extra-body instead")
    args = parser.parse_args()
    if args.schema:
        # No whitespace between tokens of JSON, so that both servers are held to the same
        # text (vLLM's xgrammar and aioserve's outlines differ in the whitespace they allow).
        print(json.dumps({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}))
    else:
        for prompt in prompts():
            print(json.dumps({"prompt": prompt}))
