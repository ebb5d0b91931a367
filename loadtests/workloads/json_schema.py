"""`json-schema`: requests that ask for JSON matching a schema through `response_format`.

Each request draws an entity kind and a subset of its fields, builds a JSON schema from
them and asks for one such object. Requests do not ignore EOS: a constrained answer ends
when the object is complete, and --json-schema-output-len only bounds it.
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

from loadtests.workloads.base import Session, Tokenizer, Turn, Workload, check_positive, count_tokens

_ENTITIES: dict[str, dict[str, dict[str, Any]]] = {
    "person": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string"}, "city": {"type": "string"}, "is_member": {"type": "boolean"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "product": {
        "title": {"type": "string"}, "price": {"type": "number", "minimum": 0},
        "in_stock": {"type": "boolean"}, "sku": {"type": "string"},
        "category": {"type": "string", "enum": ["books", "tools", "food", "toys"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "event": {
        "title": {"type": "string"}, "date": {"type": "string"}, "venue": {"type": "string"},
        "capacity": {"type": "integer", "minimum": 1}, "is_online": {"type": "boolean"},
        "speakers": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "book": {
        "title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"},
        "pages": {"type": "integer", "minimum": 1}, "genre": {"type": "string"},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
    },
}
MIN_FIELDS = 2
"""Fewest properties in a generated schema."""


class JsonSchemaWorkload:
    def add_args(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("json-schema workload")
        group.add_argument("--json-schema-output-len", type=int, default=128, help="most output tokens")

    def build(self, args: argparse.Namespace, tokenizer: Tokenizer, num_prompts: int, seed: int) -> Workload:
        check_positive(json_schema_output_len=args.json_schema_output_len)
        rng = random.Random(seed)
        sessions = []
        for i in range(num_prompts):
            entity, schema = make_schema(rng)
            prompt = (f"Describe one {entity} as a JSON object with the fields "
                      f"{', '.join(schema['properties'])}. Schema: {json.dumps(schema, sort_keys=True)}")
            response_format = {"type": "json_schema", "json_schema": {"name": entity, "schema": schema}}
            turn = Turn(prompt=prompt, prompt_len=count_tokens(tokenizer, prompt),
                        output_len=args.json_schema_output_len, ignore_eos=False, response_format=response_format)
            sessions.append(Session(session_id=i, turns=(turn,)))
        return Workload(name="json-schema", sessions=tuple(sessions),
                        params={"json_schema_output_len": args.json_schema_output_len})


def make_schema(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """(entity kind, JSON schema of an object with a random subset of its fields, all required)."""
    entity = rng.choice(sorted(_ENTITIES))
    fields = _ENTITIES[entity]
    names = sorted(rng.sample(sorted(fields), rng.randint(MIN_FIELDS, len(fields))))
    schema = {"type": "object", "properties": {n: fields[n] for n in names}, "required": names,
              "additionalProperties": False}
    return entity, schema


JSON_SCHEMA = JsonSchemaWorkload()
