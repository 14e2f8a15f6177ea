"""The one error type model loading raises, so callers see the path and the expectation."""


class ModelLoadError(ValueError):
    """A model that cannot be loaded; the message names the path and what was expected there."""
