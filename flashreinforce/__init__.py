"""flashreinforce: asynchronous RL post-training for language models and LLM agents.

`import flashreinforce` stays light: the loss is imported on first use.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "flashreinforce_loss"]


def __getattr__(name: str):
    if name == "flashreinforce_loss":
        from flashreinforce.algorithms.flashreinforce import flashreinforce_loss

        return flashreinforce_loss
    raise AttributeError(f"module 'flashreinforce' has no attribute {name!r}")
