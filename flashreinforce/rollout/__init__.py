"""Rollout: token-level generation with behavior log-probs, abort/resume and versioned weights."""

from flashreinforce.rollout.async_engine import AsyncEngine
from flashreinforce.rollout.engine import Engine, EngineStats, append_forced_tokens

__all__ = ["AsyncEngine", "Engine", "EngineStats", "append_forced_tokens"]
