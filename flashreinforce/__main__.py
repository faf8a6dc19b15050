"""`python -m flashreinforce ...` is the `flashreinforce` command."""

from flashreinforce.cli import main

main()
