"""OpenAI's Responses API family: /v1/responses and its per-key store.

routes (the handlers), decode (request bodies to the request model), encode (answers and
event streams), store (stored responses, bounded per key).
"""
