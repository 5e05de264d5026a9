"""The edgellm test suite."""
