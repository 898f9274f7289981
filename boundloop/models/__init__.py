"""Models: the deterministic ScriptedModel; provider adapters come as optional extras."""

from boundloop.models.scripted import ScriptedModel, ScriptExhausted

__all__ = ["ScriptExhausted", "ScriptedModel"]
