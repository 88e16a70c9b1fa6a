"""The constraints the structured-output tests generate under."""

# An object with a boolean, an enum and a bounded string; nothing else may appear.
SCHEMA = {
    "type": "object",
    "properties": {
        "done": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
    },
    "required": ["done", "color", "name"],
    "additionalProperties": False,
}
REGEX = r"(ab|cd)[0-9]{2,4}-[a-z]{1,8}\.(com|org)"
CHOICES = ["alpha", "beta", "gamma delta", "ε"]
# Room for the longest output of SCHEMA in byte tokens (a 10-character name of 4-byte
# characters), so every constrained output completes.
MAX_TOKENS = 160
