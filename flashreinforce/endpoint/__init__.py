"""The OpenAI-compatible endpoint over the rollout engine: agents we did not write train through it.

record.py (calls stitched into token rows), openai_api.py (the wire format), chat.py (chat templates, tools and
tool calls), service.py (episodes of calls, replay, answers), server.py (aiohttp; the `endpoint` extra). Nothing
here imports aiohttp but server.py, nor knows the RL loop: calls reach the engine through a CallRunner.
"""
