"""Model lifecycle: the registry, loading, the signed lockfile, preloading, file watching."""
