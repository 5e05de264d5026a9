"""The front door: the app factory, its middlewares, the listening site, auth, keys, rate limits, logs."""
