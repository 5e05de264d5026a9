"""The shape of an API key, and its secret taken out of any text that may reach a log or a client.

A token is `elk_<12 hex id>_<secret>`. The id is kept: it is what an operator needs to find
the key. The secret is replaced wherever the token's shape turns up, glued to other text
(`/v1/models/X<key>`, `a<key>` in a header, `"user": "x<key>"`) or cut short.
"""

from __future__ import annotations

import re
from typing import Final

KEY_PREFIX: Final = "elk"  # "edgellm key": recognisable in configs, logs of other tools, scanners
# A whole token (the keys file's and the Authorization header's): (id, secret).
KEY_TOKEN: Final = re.compile(r"elk_([0-9a-f]{12})_([A-Za-z0-9_-]{20,128})")
# A token's start anywhere in a text, with whatever follows it of a secret's alphabet.
KEY_LIKE: Final = re.compile(r"(elk_[0-9a-f]{12}_)[A-Za-z0-9_-]+")
REDACTED: Final = "[redacted]"


def redact(text: str) -> str:
    """`text` with the secret part of everything shaped like an API key replaced."""
    return KEY_LIKE.sub(r"\1" + REDACTED, text) if "elk_" in text else text


def holds_key(text: str) -> bool:
    """True when `text` holds something shaped like an API key."""
    return "elk_" in text and KEY_LIKE.search(text) is not None
