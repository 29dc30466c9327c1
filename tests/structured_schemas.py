"""JSON schemas for the structured-output tests and benchmark: small outputs, every feature the tests name.

Every string has a ``maxLength`` or a ``pattern`` and every array a ``maxItems``, so a sampled output fits a modest
token budget; what is under test is that it always parses and validates, not how long it may grow.
"""

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}

SCHEMAS: list[dict] = [
    # flat objects and scalar types
    {"type": "object", "properties": {"name": NAME, "age": AGE}, "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"value": {"type": "null"}}, "required": ["value"]},
    {"type": "object", "properties": {"count": {"type": "integer", "minimum": -5, "maximum": 5}},
     "required": ["count"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"]},
    {"type": "object", "properties": {"t": {"type": "number", "exclusiveMinimum": -40, "exclusiveMaximum": 50}},
     "required": ["t"]},
    {"type": "object", "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
     "required": ["year"]},
    # enums and constants
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3, "max", None]}}, "required": ["level"]},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": AGE}, "required": ["kind", "x"]},
    {"enum": ["yes", "no"]},
    # string patterns and lengths
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 5}},
     "required": ["word"]},
    {"type": "object", "properties": {"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}, "required": ["hex"]},
    # optional fields
    {"type": "object", "properties": {"name": NAME, "nickname": NAME}, "required": ["name"]},
    {"type": "object", "properties": {"a": AGE, "b": {"type": "boolean"}, "c": {"enum": ["x", "y"]}}},
    # arrays
    {"type": "array", "items": AGE, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2,
                                               "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"names": {"type": "array", "items": NAME, "maxItems": 2}}, "required": ["names"]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
    {"type": "array", "prefixItems": [NAME, AGE], "items": False},
    # nesting
    {"type": "object", "properties": {"person": {"type": "object", "properties": {"name": NAME, "age": AGE},
                                                 "required": ["name", "age"]}}, "required": ["person"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": AGE, "y": AGE},
                                                "required": ["x", "y"]},
                                      "label": NAME}, "required": ["point", "label"]},
    {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {"id": AGE, "done": {"type": "boolean"}},
                                               "required": ["id", "done"]}},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["c"]}}, "required": ["b"]}},
     "required": ["a"]},
    # anyOf / oneOf / type unions
    {"type": "object", "properties": {"id": {"anyOf": [AGE, NAME]}}, "required": ["id"]},
    {"anyOf": [{"type": "object", "properties": {"cat": NAME}, "required": ["cat"]},
               {"type": "object", "properties": {"dog": AGE}, "required": ["dog"]}]},
    {"type": "object", "properties": {"v": {"type": ["integer", "null"], "minimum": 0, "maximum": 50}},
     "required": ["v"]},
    {"type": "object", "properties": {"shape": {"oneOf": [{"const": "circle"}, {"const": "square"}]},
                                      "size": {"type": "integer", "minimum": 1, "maximum": 10}},
     "required": ["shape", "size"]},
    # references
    {"$defs": {"pt": {"type": "object", "properties": {"x": AGE, "y": AGE}, "required": ["x", "y"]}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}},
     "required": ["start", "end"]},
    # a small extraction record
    {"type": "object", "properties": {"city": NAME, "country": {"enum": ["FR", "DE", "IT", "ES"]},
                                      "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
                                      "capital": {"type": "boolean"}},
     "required": ["city", "country", "population", "capital"]},
]
