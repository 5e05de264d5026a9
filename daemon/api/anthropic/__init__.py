"""Anthropic's Messages API family: /v1/messages and count_tokens.

routes (the handlers), decode (request bodies to the request model), encode (answers and
event streams).
"""
