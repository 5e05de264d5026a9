"""Structured output's grammar compiler: JSON schemas and regexes to llama.cpp GBNF.

A leaf package (it imports nothing of edgellmd above it; `tests/test_layers.py` holds it), as
llama.cpp keeps its own converter outside its server:

- `schema`: a client's JSON schema checked in full against OpenAI's structured-output subset
  and the limits (`SchemaError`, a client-safe message);
- `convert`: a checked schema to GBNF (`schema_to_grammar`, `embedded_grammar`);
- `regex`: the ECMA-262 subset of `pattern` to grammar alternatives;
- `rules`: the grammar builder and its bounds (`Grammar`, `GrammarLimitError`).

`api/structured.py` is the bridge from requests to here.
"""
