"""OpenAI's API family: /v1/models, chat completions, completions, embeddings.

routes (the handlers), decode (request bodies to the request model), encode (answers and
event streams).
"""
