"""The environment's HTTP server, as an OpenEnv environment ships it (`uvicorn openenv_guess.server:app`)."""

from openenv.core.env_server.http_server import create_app

from openenv_guess import GuessAction, GuessEnvironment, GuessObservation

app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="openenv_guess", max_concurrent_envs=64)
